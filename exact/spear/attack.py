"""The `Spear` configuration, its `SpearResult`, and `SpearRun`: one attack call, steps 1-5 of `exact.spear`.

`Spear.attack` builds a `SpearRun` per call, which holds the gradient's factors, the tolerances, the
search state and the diagnostics, so the configuration is never mutated by an attack.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from exact.spear.options import PriorGuidance, Sampling, SearchBudget, Selection, SpearOptions, Tolerances
from exact.spear.prior import guided
from exact.spear.sampling import SearchState, sample_randomly
from exact.spear.selection import Candidate, Selector, greedy_independent

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class SpearResult:
    """What SPEAR recovered from one layer's gradient."""

    #: Recovered layer inputs X, one row per sample (b, n); an unordered set: a gradient has no batch
    #: order. Best effort when `exact` is False (see `reason`); empty (0, n) when nothing was found.
    inputs: Tensor
    #: True when the sparsity-matching certificate holds (needs the layer's weight and bias).
    exact: bool
    #: Why the result is not certified exact (None when it is).
    reason: str | None = None
    #: Fraction of (neuron, sample) pairs whose gradient zero pattern matches the ReLU pattern of the
    #: reconstruction (1.0 certifies; None without weight and bias).
    agreement: float | None = None
    #: samples (submatrices drawn), candidates (distinct sparse directions kept), rank (used),
    #: numerical_rank, live_rows, seconds, and the thresholds used.
    diagnostics: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])


class Spear:
    """SPEAR with explicit numerics. Call `attack(weight_grad, bias_grad, batch_size, weight, bias)`."""

    def __init__(
        self,
        budget: SearchBudget = SearchBudget(),
        sampling: Sampling = Sampling(),
        tolerances: Tolerances = Tolerances(),
        selection: Selection = Selection(),
        guidance: PriorGuidance = PriorGuidance(),
        device: str | torch.device = "cpu",
        dtype: str = "float64",
    ) -> None:
        """
        Args:
            budget: How long one attack searches (submatrices drawn, seconds).
            sampling: Which sampled directions become candidates (sparsity tau, seed, pre-filter).
            tolerances: What counts as rank, as zero and as a dead neuron.
            selection: How the b directions are chosen among the candidates.
            guidance: How plausible layer inputs (`attack(prior=...)`) guide the search.
            device: Device of the computation.
            dtype: "float64" (default) or "float32".
        """
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} not allowed; use one of {sorted(_DTYPES)}")
        #: Every option, by group (exact.spear.options); what each run of this attack reads.
        self.options = SpearOptions(budget, sampling, tolerances, selection, guidance, torch.device(device),
                                    _DTYPES[dtype])

    def __repr__(self) -> str:
        options = self.options
        return (f"Spear(tau={options.sampling.tau}, max_samples={options.budget.max_samples}, "
                f"batch_samples={options.budget.batch_samples}, seed={options.sampling.seed}, dtype={options.dtype})")

    def attack(
        self,
        weight_grad: Tensor,
        bias_grad: Tensor | None,
        batch_size: int | None = None,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        prior: Tensor | None = None,
    ) -> SpearResult:
        """Recover the inputs of a ReLU layer from its weight and bias gradients.

        Args:
            weight_grad: dL/dW (m, n) of the layer Z = W X + b (PyTorch `nn.Linear.weight` layout).
            bias_grad: dL/db (m,); None recovers the inputs only up to scale and sign (flagged).
            batch_size: Rows of X (the client protocol, known to the server); None: the numerical rank.
            weight: The layer's weight W (m, n); with `bias` it enables the exactness certificate.
            bias: The layer's bias b (m,).
            prior: Optional plausible layer inputs (N, n), e.g. auxiliary data the server holds (for a first
                layer: flattened auxiliary images). With weight and bias, they guide the search (see
                `exact.spear.prior.guided`) before random sampling; exactness is still decided by the
                certificate alone.
        """
        start = time.perf_counter()
        if weight_grad.dim() != 2:
            raise ValueError(f"weight_grad must be (m, n), got {tuple(weight_grad.shape)}")
        m, n = weight_grad.shape
        if bias_grad is not None and bias_grad.shape != (m,):
            raise ValueError(f"bias_grad must be ({m},), got {tuple(bias_grad.shape)}")
        if prior is not None and (prior.dim() < 1 or prior.numel() != prior.shape[0] * n):
            raise ValueError(f"prior must hold N inputs of {n} features (N, {n}), got {tuple(prior.shape)}")
        run = SpearRun(self.options, weight_grad, bias_grad, batch_size, weight, bias, prior, start)
        try:
            with torch.no_grad():
                return run.execute()
        except (RuntimeError, ValueError) as error:  # e.g. an SVD that does not converge on garbage input
            return run.finish(weight_grad.new_zeros(0, n, dtype=self.options.dtype), False,
                              f"{type(error).__name__}: {error}")


class SpearRun:
    """One `Spear.attack` call: its inputs, tolerances, the gradient's factors, search state and diagnostics."""

    #: Batch size used (the given one, else the numerical rank).
    b: int
    #: L (m, b) and R (b, n) of the truncated SVD dL/dW = L R.
    left: Tensor
    right: Tensor
    #: Live rows of L (m,) and those rows normalised (zero patterns are scale free).
    live: Tensor
    unit: Tensor
    selector: Selector
    generator: torch.Generator
    state: SearchState

    def __init__(self, options: SpearOptions, weight_grad: Tensor, bias_grad: Tensor | None, batch_size: int | None,
                 weight: Tensor | None, bias: Tensor | None, prior: Tensor | None, start: float) -> None:
        self.options = options
        self.weight_grad, self.bias_grad, self.batch_size = weight_grad, bias_grad, batch_size
        self.weight, self.bias, self.prior = weight, bias, prior
        self.start = start
        # float32 gradients cast to float64 still carry float32 rounding: judge by the values.
        low_precision = weight_grad.dtype != torch.float64 or bool(
            torch.equal(weight_grad.detach().float().double(), weight_grad.detach()))
        tolerances = options.tolerances
        self.zero_tol = tolerances.zero_tol if tolerances.zero_tol is not None else (1e-6 if low_precision else 1e-9)
        self.dead_tol = tolerances.dead_tol if tolerances.dead_tol is not None else (1e-6 if low_precision else 1e-12)
        self.diag: dict[str, Any] = {
            "samples": 0, "candidates": 0, "rank": 0, "numerical_rank": 0, "live_rows": 0,
            "zero_tol": self.zero_tol, "dead_tol": self.dead_tol, "batch_size": batch_size, "iterations": 0,
            "pivotal_seen": 0,
        }

    @property
    def has_layer(self) -> bool:
        """The layer's weight and bias are given (prior guidance and the certificate need them)."""
        return self.weight is not None and self.bias is not None

    def finish(self, inputs: Tensor, exact: bool, reason: str | None, agreement: float | None = None) -> SpearResult:
        self.diag["seconds"] = time.perf_counter() - self.start
        return SpearResult(inputs.detach(), exact, reason, agreement, self.diag)

    def execute(self) -> SpearResult:
        """Factorise (steps 1-2), search (3-4), select and certify (5); degenerate inputs end early."""
        options, diag = self.options, self.diag
        m, n = self.weight_grad.shape
        g = torch.nan_to_num(self.weight_grad.detach().to(options.device, options.dtype), nan=0.0, posinf=0.0,
                             neginf=0.0)
        u, s, vh = torch.linalg.svd(g, full_matrices=False)
        top = float(s[0]) if s.numel() else 0.0
        numerical = int((s > options.tolerances.rank_tol * top).sum()) if top > 0 else 0
        diag["numerical_rank"] = numerical
        diag["singular_values"] = s[: min(s.numel(), 64)].cpu()
        b = int(self.batch_size) if self.batch_size is not None else numerical
        diag["rank"] = b
        if numerical == 0 or b == 0:
            return self.finish(g.new_zeros(0, n), False, "rank 0: the weight gradient is zero (no sample reached the loss)")
        if b >= min(m, n):
            basis = vh[: min(b, numerical)] * s[: min(b, numerical), None]
            return self.finish(basis, False, f"batch size {b} >= min(m, n) = {min(m, n)}: the gradient does not "
                                              "determine the inputs (best effort: a basis of their span)")
        if numerical < b:
            diag["rank_deficient"] = True  # e.g. duplicate samples: continue, the selection will fail
        left = u[:, :b] * s[:b]  # L (m, b)
        right = vh[:b]  # R (b, n)
        norms = left.norm(dim=1)
        live = norms > self.dead_tol * float(norms.max())
        live_rows = int(live.sum())
        diag["live_rows"] = live_rows
        if live_rows < b:
            return self.finish(right * s[:b, None], False, f"only {live_rows} live neurons for batch size {b} "
                                                           "(best effort: a basis of the inputs' span)")
        self.b, self.left, self.right, self.live = b, left, right, live
        self.unit = left[live] / norms[live, None]  # rows of L normalised: zero patterns are scale free
        need = max(math.ceil(options.sampling.tau * live_rows), b)
        diag["min_zeros"] = need
        self.selector = Selector(left, right, self.bias_grad, self.weight, self.bias, self.zero_tol, self.dead_tol,
                                 options.selection.max_swaps, diag)
        return self.conclude(self.search(need), n)

    def search(self, need: int) -> list[Candidate]:
        """Find sparse directions until the selection is certified or the budget is spent.

        With `prior` (and the layer's weight and bias), prior-guided directions come first (see
        `exact.spear.prior.guided`); then (b-1)-row submatrices are drawn at random as in the paper
        (`exact.spear.sampling.sample_randomly`). Returns the distinct candidates as (unit direction
        q (b,), zero count, pivotal): the non-pivotal ones sparsest first, then at most `max_pivotal`
        pivotal ones, sparsest first.
        """
        options, unit, b, diag = self.options, self.unit, self.b, self.diag
        self.generator = torch.Generator(device=options.device).manual_seed(options.sampling.seed)
        if b == 1:  # the kernel of a 0 x 1 matrix: q = [1]
            q = unit.new_ones(1)
            return [(q, int((unit[:, 0].abs() <= self.zero_tol).sum()), False)]
        self.state = SearchState(unit=unit, b=b, need=need, zero_tol=self.zero_tol,
                                 # Kernels can be ill-conditioned (b-1 rows that nearly span only b-2 dimensions),
                                 # so they may be screened with a looser tolerance; refined directions use zero_tol.
                                 screen_tol=options.sampling.screen_factor * self.zero_tol,
                                 max_pivotal=options.selection.max_pivotal, diag=diag)
        done = False
        if self.prior is not None and self.has_layer:
            done = guided(self.prior, self.state, self.right, self.weight, self.bias, self.live, options.guidance,
                          options.budget.batch_samples, self.generator, self.out_of_time, self.certified_now)
        drawn = 0
        if not done:
            done, drawn = sample_randomly(self.state, options.sampling, options.budget, self.generator, options.device,
                                          self.out_of_time, self.certified_now)
        if not done:
            diag.setdefault("stopped", "max_samples")
        diag["samples"] = drawn
        diag["candidates"] = len(self.state.candidates)
        diag["pivotal_kept"] = len(self.state.pool["zeros"])
        return self.state.all_candidates()

    def certified_now(self, force: bool = False) -> bool:
        """Re-select when a regular candidate arrived (or `force`); True once the selection certifies."""
        state = self.state
        if not (state.added or force):
            return False
        state.added = False
        state.candidates.sort(key=lambda c: -c[1])
        if len(state.candidates) + len(state.pool["zeros"]) >= self.b and self.selector.good_enough(
                state.all_candidates(), self.b):
            self.diag["stopped"] = "certified" if self.has_layer else "found b directions"
            return True
        return False

    def out_of_time(self) -> bool:
        max_seconds = self.options.budget.max_seconds
        if max_seconds is not None and time.perf_counter() - self.start > max_seconds:
            self.diag["stopped"] = "max_seconds"
            return True
        return False

    def conclude(self, candidates: list[Candidate], n: int) -> SpearResult:
        """Select from the candidates, scale, certify, and say why the result is not exact when it is not."""
        b, selector, diag = self.b, self.selector, self.diag
        chosen = greedy_independent(candidates, b)
        if chosen is None:
            found = greedy_independent(candidates, len(candidates), partial=True) or []
            reason = (f"sample budget spent ({diag['samples']} submatrices, stopped: {diag.get('stopped')}): "
                      f"{len(found)} of {b} independent sparse directions found")
            if found:
                # Best effort: complete the directions found with an orthonormal complement (not exact).
                q_part = torch.stack([candidates[i][0] for i in found], dim=1)
                full = torch.linalg.qr(q_part, mode="complete").Q
                q_hat = torch.cat([q_part, full[:, len(found):]], dim=1)
                x = selector.scaled(q_hat)[1]
                return self.finish(torch.nan_to_num(x), False, reason)
            return self.finish(self.left.new_zeros(0, n), False, reason)
        chosen, x, agreement = selector.select(candidates, b)
        diag["selected_zeros"] = [candidates[i][1] for i in chosen]
        diag["selected_pivotal"] = sum(candidates[i][2] for i in chosen)
        if self.bias_grad is None:
            return self.finish(x, False, "no bias gradient: inputs recovered only up to scale and sign (rows normalised)")
        if not torch.isfinite(x).all():
            return self.finish(torch.nan_to_num(x), False, "degenerate scale (a column of Q_hat explains no bias gradient)")
        if not selector.can_certify:
            return self.finish(x, False, "not certified: the layer's weight and bias were not given", None)
        if agreement == 1.0:
            return self.finish(x, True, None, agreement)
        return self.finish(x, False, f"certificate failed: sparsity agreement {agreement:.6f} < 1", agreement)
