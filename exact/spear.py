"""SPEAR (Dimitrov et al., NeurIPS 2024): exact recovery of a batch from a ReLU layer's gradient.

For a linear layer Z = W X + b (W: m x n, one column of X per sample, batch size b < min(m, n))
followed by a ReLU, the weight gradient dL/dW = (dL/dZ) X^T has rank b. SPEAR factors it and uses
the sparsity that the ReLU puts into dL/dZ:

1. **Low-rank factorisation.** The truncated SVD dL/dW = L R (L: m x b, R: b x n, float64 by
   default) determines everything up to an unknown invertible Q (b x b): dL/dZ = L Q and
   X^T = Q^-1 R. The rank b is the batch size when it is given, else the numerical rank (singular
   values above `rank_tol` times the largest).
2. **Dead neurons.** Rows of L that are (numerically) zero belong to neurons that are inactive for the
   whole batch; they carry no information and are dropped before sampling.
3. **Sampling.** Where sample j's neuron i is inactive, (dL/dZ)_ij = L_i q_j = 0. If b - 1 rows of L
   all lie in column j's zero set, q_j spans the kernel of that (b-1) x b submatrix. Submatrices are
   drawn at random, `batch_samples` at a time (vectorised: one batched solve); a cheap pre-filter on
   a random subset of rows discards the vast majority of kernels before the full sparsity test.
4. **Filter, refine, merge.** A kernel direction q is a candidate when L q has at least
   max(tau * live rows, b) zeros (relative to the row norms, `zero_tol`); it is then refined as the
   least-squares kernel of all its zero rows, and duplicates (|cos| ~ 1) are merged. Most sparse
   kernels are *mixtures*: b-2 sampled rows from the intersection of two columns' zero sets plus one
   arbitrary row give a direction in span(q_j, q_k) with ~m/4 zeros. Their zero set needs that one
   row for its rank (a row of leverage 1, tested batched in `_pivotal`); such "pivotal" candidates
   are kept only as a bounded fallback (`max_pivotal`), ranked after all others, because a true
   column whose zero set is nearly contained in another's is pivotal too.
5. **Greedy selection and the certificate.** The b sparsest linearly independent candidates form
   Q_hat; the scale and sign of each column come from the bias gradient, dL/db = (dL/dZ) 1 = L Q 1,
   so s = Q_hat^-1 L^+ dL/db and Q = Q_hat diag(s). The reconstruction is X = (Q^-1 R)^T. With the
   layer's weight and bias, the *sparsity-matching certificate* compares the zero pattern of
   dL/dZ = L Q with the ReLU pattern of W X_hat + b: full agreement certifies the recovery as exact
   (a wrong reconstruction would have to reproduce m * b activation signs by chance). When it fails
   and spare candidates exist, a local search over single swaps (best swap per slot, least sparse
   slots first, `max_swaps` certificate evaluations) runs while the agreement improves. Sampling stops
   as soon as the selection is certified (or, without weight and bias, once b independent candidates
   exist), or when the sample budget (`max_samples`, optionally `max_seconds`) is spent.

Expected samples grow like 2^(b-1) ln b (each column needs b - 1 rows from its zero set, about half
the live rows); the paper reports B = 20 in 1.4-2.6 min per batch on a GPU.

Degenerate inputs (rank 0, b >= min(m, n), no bias gradient, fewer live neurons than b, exhausted
budget) never raise: a best-effort result is returned with `exact=False` and the reason in `reason`.

Plain PyTorch: this module never imports Lightning.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

_TINY = 1e-300
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


# ----------------------------------------------------------------------------------------------------------
# Result and certificate


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


def sparsity_agreement(grad_z: Tensor, pre_activation: Tensor, zero_tol: float, dead_tol: float = 0.0) -> float:
    """Sparsity-matching score: fraction of entries where "gradient is zero" equals "ReLU inactive".

    Args:
        grad_z: dL/dZ (m, b), as reconstructed (L Q).
        pre_activation: Z = W X_hat + b (m, b) of the reconstruction.
        zero_tol: An entry of grad_z is zero when |entry| <= zero_tol * (norm of its row).
        dead_tol: A row whose norm is <= dead_tol * the largest row norm is all zero (a dead neuron).
    """
    scale = grad_z.norm(dim=1, keepdim=True)
    zero = (grad_z.abs() <= zero_tol * scale) | (scale <= dead_tol * scale.max())
    inactive = pre_activation <= 0
    return float((zero == inactive).double().mean()) if zero.numel() else 0.0


# ----------------------------------------------------------------------------------------------------------
# Layer lookup (by module name, never by parameter position)


@dataclass
class ReluLinear:
    """A `nn.Linear` found by name, with what is known about the activation that follows it."""

    name: str
    module: nn.Linear
    #: True: a ReLU follows (next module of an nn.Sequential, or a TransformerEncoderLayer's linear1
    #: with ReLU activation); False: something else follows; None: cannot tell from the structure.
    followed_by_relu: bool | None

    @property
    def weight_name(self) -> str:
        return f"{self.name}.weight"

    @property
    def bias_name(self) -> str:
        return f"{self.name}.bias"


def _is_relu(module: Any) -> bool:
    return isinstance(module, nn.ReLU) or module is torch.relu or module is nn.functional.relu


def relu_linear_layer(model: nn.Module, name: str) -> ReluLinear:
    """The `nn.Linear` called `name` in `model` (e.g. "layers.0", "encoder.layers.0.linear1").

    Raises KeyError for an unknown name and TypeError when the module is not a Linear with a bias.
    """
    modules = dict(model.named_modules())
    if name not in modules:
        linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
        raise KeyError(f"no module named {name!r}; Linear modules: {linears[:20]}")
    module = modules[name]
    if not isinstance(module, nn.Linear):
        raise TypeError(f"module {name!r} is a {type(module).__name__}, SPEAR needs an nn.Linear")
    if module.bias is None:
        raise TypeError(f"module {name!r} has no bias; SPEAR needs the bias gradient for scale and sign")
    parent_name, _, child = name.rpartition(".")
    parent = modules.get(parent_name) if parent_name else model
    followed: bool | None = None
    if isinstance(parent, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer) and child == "linear1":
        followed = _is_relu(parent.activation)
    elif isinstance(parent, nn.Sequential):
        children = list(parent.named_children())
        position = [n for n, _ in children].index(child)
        following = [m for _, m in children[position + 1 :] if not isinstance(m, nn.Dropout | nn.Identity)]
        followed = bool(following) and _is_relu(following[0])
    return ReluLinear(name, module, followed)


# ----------------------------------------------------------------------------------------------------------
# The attack


@dataclass
class _SearchState:
    """What one attack's search has found so far (shared by the sampled and the prior-guided phase)."""

    unit: Tensor
    b: int
    need: int
    zero_tol: float
    screen_tol: float
    diag: dict
    candidates: list = field(default_factory=list)
    #: Directions seen (sampled and refined), to skip repeats cheaply.
    known: Tensor | None = None
    #: Pivotal candidates (see `_pivotal`): usually mixtures of two columns, occasionally a true column
    #: whose zero set is almost contained in another's. Kept, unrefined, as a bounded fallback.
    pool: dict = field(default_factory=dict)
    added: bool = False
    pool_changed: bool = False

    def __post_init__(self) -> None:
        if not self.pool:
            self.pool = {"dirs": self.unit.new_zeros(0, self.b), "zeros": torch.zeros(0, dtype=torch.long)}


class Spear:
    """SPEAR with explicit numerics. Call `attack(weight_grad, bias_grad, batch_size, weight, bias)`."""

    def __init__(
        self,
        tau: float = 0.1,
        max_samples: int = 4_000_000,
        max_seconds: float | None = None,
        batch_samples: int = 4096,
        seed: int = 0,
        rank_tol: float = 1e-6,
        zero_tol: float | None = None,
        dead_tol: float | None = None,
        prefilter_rows: int = 128,
        screen_factor: float = 1.0,
        line_search: bool = False,
        max_swaps: int = 1024,
        max_pivotal: int = 64,
        prior_rows: tuple[float, ...] = (1.25, 2.0),
        prior_rounds: int = 4,
        max_prior: int = 4096,
        sweep_dims: int = 3,
        device: str | torch.device = "cpu",
        dtype: str = "float64",
    ) -> None:
        """
        Args:
            tau: A direction q is a candidate when L q has at least tau * (live rows) zeros (and at least b).
            max_samples: Budget of (b-1)-row submatrices drawn per attack; exhausting it is flagged.
            max_seconds: Optional wall-clock budget per attack (None: only `max_samples` bounds it).
            batch_samples: Submatrices sampled and solved at once per iteration (vectorised).
            seed: Seed of the sampler (results are deterministic for a given seed and device).
            rank_tol: Numerical rank = singular values above rank_tol * the largest (used when the batch
                size is not given, and reported always).
            zero_tol: (L q)_i counts as zero when |L_i q| <= zero_tol * ||L_i|| * ||q||. None: 1e-9 for
                float64 gradients, 1e-6 for lower precision (float32 rounding of dL/dW is ~1e-8; float64
                gradients whose values are all float32-representable count as float32).
            dead_tol: Rows of L with norm <= dead_tol * the largest row norm are dead neurons. None: 1e-12
                for float64 gradients, 1e-6 for lower precision.
            prefilter_rows: Random live rows on which every kernel is screened before the full test
                (0 disables the pre-filter).
            line_search: Draw b-2 rows and find the densest line of L K in their 2-D kernel K (one row fewer
                per draw; see `_line_kernels`) instead of the paper's (b-1)-row kernels.
            screen_factor: Sampled kernels are screened with tolerance screen_factor * zero_tol (they can be
                ill-conditioned); candidates are refined and then counted with zero_tol. 1 = one tolerance.
            max_swaps: Certificate evaluations of single-candidate swaps when the greedy selection is not
                certified (1/16 of this while sampling, all of it for the final selection).
            max_pivotal: "Pivotal" candidates (a zero set that needs one particular row for its rank: usually
                the intersection of two columns' zero sets plus one row, a mixture of two columns) are
                only a fallback for the selection, after all others; at most this many, the sparsest.
            prior_rows: With a prior (see `attack`): each guess names its k most inactive neurons, for k = each of
                these multiples of b (at least b - 1); their least-squares kernel is a candidate.
            prior_rounds: Rounds of prior guesses; each round projects the guesses on the complement of the
                directions found so far (a round that finds nothing ends the prior phase).
            max_prior: Use at most this many prior inputs (a seeded random subset of larger priors).
            sweep_dims: When at most this many columns are left, the prior rounds also sweep the subspace
                their p_j lie in (see `_sweep`); 0 disables the sweep.
            device: Device of the computation.
            dtype: "float64" (default) or "float32".
        """
        if not 0.0 < tau < 1.0:
            raise ValueError(f"tau={tau} must be in (0, 1)")
        if max_samples < 1 or batch_samples < 1:
            raise ValueError("max_samples and batch_samples must be >= 1")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} not allowed; use one of {sorted(_DTYPES)}")
        if rank_tol <= 0:
            raise ValueError(f"rank_tol={rank_tol} must be > 0")
        if not prior_rows or any(f <= 0 for f in prior_rows) or prior_rounds < 0 or max_prior < 1 or sweep_dims < 0:
            raise ValueError(f"prior_rows={prior_rows} must be positive multiples of b, prior_rounds={prior_rounds} "
                             f">= 0, max_prior={max_prior} >= 1")
        self.tau = float(tau)
        self.max_samples = int(max_samples)
        self.max_seconds = max_seconds
        self.batch_samples = int(batch_samples)
        self.seed = int(seed)
        self.rank_tol = float(rank_tol)
        self.zero_tol = zero_tol
        self.dead_tol = dead_tol
        self.prefilter_rows = int(prefilter_rows)
        self.screen_factor = float(screen_factor)
        self.line_search = bool(line_search)
        self.max_swaps = int(max_swaps)
        self.max_pivotal = int(max_pivotal)
        self.prior_rows = tuple(float(f) for f in prior_rows)
        self.prior_rounds = int(prior_rounds)
        self.max_prior = int(max_prior)
        self.sweep_dims = int(sweep_dims)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]

    def __repr__(self) -> str:
        return (f"Spear(tau={self.tau}, max_samples={self.max_samples}, batch_samples={self.batch_samples}, "
                f"seed={self.seed}, dtype={self.dtype})")

    # ------------------------------------------------------------------------------------------------------

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
                `_guided`) before random sampling; exactness is still decided by the certificate alone.
        """
        start = time.perf_counter()
        if weight_grad.dim() != 2:
            raise ValueError(f"weight_grad must be (m, n), got {tuple(weight_grad.shape)}")
        m, n = weight_grad.shape
        if bias_grad is not None and bias_grad.shape != (m,):
            raise ValueError(f"bias_grad must be ({m},), got {tuple(bias_grad.shape)}")
        if prior is not None and (prior.dim() < 1 or prior.numel() != prior.shape[0] * n):
            raise ValueError(f"prior must hold N inputs of {n} features (N, {n}), got {tuple(prior.shape)}")
        # float32 gradients cast to float64 still carry float32 rounding: judge by the values.
        low_precision = weight_grad.dtype != torch.float64 or bool(
            torch.equal(weight_grad.detach().float().double(), weight_grad.detach()))
        zero_tol = self.zero_tol if self.zero_tol is not None else (1e-6 if low_precision else 1e-9)
        dead_tol = self.dead_tol if self.dead_tol is not None else (1e-6 if low_precision else 1e-12)
        self._dead_tol = dead_tol
        diag: dict[str, Any] = {
            "samples": 0, "candidates": 0, "rank": 0, "numerical_rank": 0, "live_rows": 0,
            "zero_tol": zero_tol, "dead_tol": dead_tol, "batch_size": batch_size, "iterations": 0,
            "pivotal_seen": 0,
        }

        def finish(inputs: Tensor, exact: bool, reason: str | None, agreement: float | None = None) -> SpearResult:
            diag["seconds"] = time.perf_counter() - start
            return SpearResult(inputs.detach(), exact, reason, agreement, diag)

        try:
            with torch.no_grad():
                return self._attack(weight_grad, bias_grad, batch_size, weight, bias, zero_tol, diag, start, finish,
                                    prior)
        except (RuntimeError, ValueError) as error:  # e.g. an SVD that does not converge on garbage input
            return finish(weight_grad.new_zeros(0, n, dtype=self.dtype), False, f"{type(error).__name__}: {error}")

    def _attack(self, weight_grad, bias_grad, batch_size, weight, bias, zero_tol, diag, start, finish,
                prior=None) -> SpearResult:
        m, n = weight_grad.shape
        dead_tol = self._dead_tol
        g = torch.nan_to_num(weight_grad.detach().to(self.device, self.dtype), nan=0.0, posinf=0.0, neginf=0.0)
        u, s, vh = torch.linalg.svd(g, full_matrices=False)
        top = float(s[0]) if s.numel() else 0.0
        numerical = int((s > self.rank_tol * top).sum()) if top > 0 else 0
        diag["numerical_rank"] = numerical
        diag["singular_values"] = s[: min(s.numel(), 64)].cpu()
        b = int(batch_size) if batch_size is not None else numerical
        diag["rank"] = b
        if numerical == 0 or b == 0:
            return finish(g.new_zeros(0, n), False, "rank 0: the weight gradient is zero (no sample reached the loss)")
        if b >= min(m, n):
            basis = vh[: min(b, numerical)] * s[: min(b, numerical), None]
            return finish(basis, False, f"batch size {b} >= min(m, n) = {min(m, n)}: the gradient does not "
                                         "determine the inputs (best effort: a basis of their span)")
        if numerical < b:
            diag["rank_deficient"] = True  # e.g. duplicate samples: continue, the selection will fail
        left = u[:, :b] * s[:b]  # L (m, b)
        right = vh[:b]  # R (b, n)
        norms = left.norm(dim=1)
        live = norms > dead_tol * float(norms.max())
        live_rows = int(live.sum())
        diag["live_rows"] = live_rows
        if live_rows < b:
            return finish(right * s[:b, None], False, f"only {live_rows} live neurons for batch size {b} "
                                                      "(best effort: a basis of the inputs' span)")
        unit = left[live] / norms[live, None]  # rows of L normalised: zero patterns are scale free
        need = max(math.ceil(self.tau * live_rows), b)
        diag["min_zeros"] = need

        candidates = self._sample(unit, b, need, zero_tol, diag, start, weight, bias, left, right, bias_grad,
                                  live, prior)
        return self._finish(candidates, unit, left, right, live, bias_grad, weight, bias, b, n, zero_tol,
                            diag, finish)

    # ------------------------------------------------------------------------------------------------------
    # Sampling

    def _sample(self, unit: Tensor, b: int, need: int, zero_tol: float, diag: dict, start: float,
                weight, bias, left, right, bias_grad, live: Tensor, prior: Tensor | None = None
                ) -> list[tuple[Tensor, int, bool]]:
        """Find sparse directions until the selection is certified or the budget is spent.

        With `prior` (and the layer's weight and bias), prior-guided directions come first (see
        `_guided`); then (b-1)-row submatrices are drawn at random as in the paper. Returns the distinct
        candidates as (unit direction q (b,), zero count, pivotal): the non-pivotal ones sparsest first,
        then at most `max_pivotal` pivotal ones, sparsest first.
        """
        rows = unit.shape[0]
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        if b == 1:  # the kernel of a 0 x 1 matrix: q = [1]
            q = unit.new_ones(1)
            return [(q, int((unit[:, 0].abs() <= zero_tol).sum()), False)]
        state = _SearchState(unit=unit, b=b, need=need, zero_tol=zero_tol,
                             # Kernels can be ill-conditioned (b-1 rows that nearly span only b-2 dimensions),
                             # so they may be screened with a looser tolerance; refined directions use zero_tol.
                             screen_tol=self.screen_factor * zero_tol, diag=diag)
        can_certify = weight is not None and bias is not None

        def certified_now(force: bool = False) -> bool:
            """Re-select when a regular candidate arrived (or `force`); True once the selection certifies."""
            if not (state.added or force):
                return False
            state.added = False
            state.candidates.sort(key=lambda c: -c[1])
            if len(state.candidates) + len(state.pool["zeros"]) >= b and self._good_enough(
                    state.candidates + self._pool_list(state.pool), left, right, bias_grad, weight, bias, b, zero_tol,
                    diag):
                diag["stopped"] = "certified" if can_certify else "found b directions"
                return True
            return False

        def out_of_time() -> bool:
            if self.max_seconds is not None and time.perf_counter() - start > self.max_seconds:
                diag["stopped"] = "max_seconds"
                return True
            return False

        done = False
        if prior is not None and can_certify:
            done = self._guided(state, prior, live, weight, bias, right, generator, certified_now, out_of_time)
        pre_rows = min(self.prefilter_rows, rows) if self.prefilter_rows > 0 else rows
        # Expected zeros on the pre-filter rows of a true direction: >= tau * pre_rows; accept at a
        # quarter of that so that true directions are hardly ever lost (a lost one is only a lost sample).
        pre_need = max(1, int(0.25 * self.tau * pre_rows)) if pre_rows < rows else need
        drawn = 0
        while not done and drawn < self.max_samples:
            if out_of_time():
                break
            count = min(self.batch_samples, self.max_samples - drawn)
            drawn += count
            diag["iterations"] += 1
            if self.line_search and b >= 3:
                q, ok = self._line_kernels(unit, b, count, generator, state.screen_tol)
            else:
                index = torch.randint(0, rows, (count, b - 1), generator=generator, device=self.device)
                sub = unit[index]  # (count, b-1, b)
                # Kernel of each (b-1) x b submatrix: q = [A^-1 a; -1] with A its first b-1 columns.
                sol, info = torch.linalg.solve_ex(sub[:, :, : b - 1], sub[:, :, b - 1 :])
                q = torch.cat([sol[:, :, 0], -torch.ones_like(sol[:, :1, 0])], dim=1)
                ok = (info == 0) & torch.isfinite(q).all(dim=1)
            q = q / q.norm(dim=1, keepdim=True).clamp_min(_TINY)
            if pre_rows < rows:
                probe = torch.randint(0, rows, (pre_rows,), generator=generator, device=self.device)
                pre_zero = ((unit[probe] @ q.T).abs() <= state.screen_tol).sum(dim=0)
                ok &= pre_zero >= pre_need
            self._absorb(state, q, ok)
            # Re-select when a regular candidate arrived, or every 8th iteration when only the pool changed.
            done = certified_now(force=state.pool_changed and diag["iterations"] % 8 == 0)
            if state.pool_changed and diag["iterations"] % 8 == 0:
                state.pool_changed = False
        if not done:
            diag.setdefault("stopped", "max_samples")
        diag["samples"] = drawn
        diag["candidates"] = len(state.candidates)
        diag["pivotal_kept"] = len(state.pool["zeros"])
        return state.candidates + self._pool_list(state.pool)

    def _absorb(self, state: "_SearchState", q: Tensor, ok: Tensor) -> None:
        """Screen unit kernel directions q (H, b) (rows where `ok`), refine the sparse ones, keep the new ones."""
        unit, need, zero_tol, screen_tol = state.unit, state.need, state.zero_tol, state.screen_tol
        hits = ok.nonzero().flatten()
        if hits.numel() == 0:
            return
        zeros = ((unit @ q[hits].T).abs() <= screen_tol).sum(dim=0)
        hits = hits[zeros >= need]
        if hits.numel() and state.known is not None:  # skip directions found before (cheap, batched)
            hits = hits[(q[hits] @ state.known.T).abs().amax(dim=1) < 1 - 1e-6]
        if hits.numel():
            pivotal = _pivotal(unit, q[hits], screen_tol)
            if pivotal.any():
                piv = q[hits[pivotal]]
                piv_zeros = ((unit @ piv.T).abs() <= screen_tol).sum(dim=0).cpu()
                state.pool_changed |= self._pool_add(state.pool, piv, piv_zeros, need, unit, zero_tol)
                state.diag["pivotal_seen"] += int(pivotal.sum())
            hits = hits[~pivotal]
        for h in hits.tolist():
            known = state.known
            if known is not None and float((known @ q[h]).abs().max()) >= 1 - 1e-6:
                continue  # found earlier in this same batch
            refined = self._refine(unit, q[h], zero_tol, screen_tol)
            if refined is None:
                continue
            direction, zero_count, pivotal = refined
            if zero_count < need:
                continue
            if pivotal:
                state.pool_changed |= self._pool_add(state.pool, direction[None], torch.tensor([zero_count]), need,
                                                     unit, zero_tol)
                continue
            repeat = known is not None and float((known @ direction).abs().max()) >= 1 - 1e-6
            # Remember both the sampled and the refined direction, so that repeats are skipped early.
            state.known = torch.stack([q[h], direction]) if known is None else torch.cat([known, q[h][None], direction[None]])
            if repeat:
                continue
            state.candidates.append((direction, zero_count, pivotal))
            state.added = True

    def _guided(self, state: "_SearchState", prior: Tensor, live: Tensor, weight: Tensor, bias: Tensor,
                right: Tensor, generator, certified_now, out_of_time) -> bool:
        """Prior-guided directions: guesses of a sample's layer input say which neurons it left inactive.

        Sample j's input is x_j = R^T p_j (R: the gradient's right factor, orthonormal rows), so its
        pre-activations are A p_j + b with A = W R^T, and the neurons with the most negative
        pre-activation are in column j's zero set. A guess p (a prior input projected on the span of
        R) close to some p_j therefore names k rows that very likely all lie in that zero set, and
        their least-squares kernel is q_j: one guess succeeds with a probability that does not shrink
        like (zero fraction)^(b-1). Each round also deflates: P Q = I (P = Q^-1 holds the p_j as rows),
        so every p_j of a column not found yet is orthogonal to the directions already found, and the
        guesses are projected on that complement; with b-1 columns found the last p_j is known up to
        scale. Guesses only propose candidates: the filters, the selection and the certificate are the
        same as for sampled ones, so a poor prior costs time, never exactness.
        Returns True once the selection certifies.
        """
        unit, b, diag = state.unit, state.b, state.diag
        rows = unit.shape[0]
        x = prior.detach().to(self.device, self.dtype).reshape(prior.shape[0], -1)
        if x.shape[0] > self.max_prior:
            x = x[torch.randperm(x.shape[0], generator=generator, device=self.device)[: self.max_prior]]
        guesses = x @ right.T  # (G, b) coordinates in the inputs' span
        a = weight.detach().to(self.device, self.dtype)[live] @ right.T  # (rows, b)
        offset = bias.detach().to(self.device, self.dtype)[live]
        sizes = sorted({min(rows, max(b - 1, math.ceil(f * b))) for f in self.prior_rows})
        diag["prior_guesses"] = 0
        scale = float(guesses.norm(dim=1).median())  # a typical |p|, for the sweeps below
        for _ in range(self.prior_rounds):
            before = len(state.candidates)
            p = guesses
            regular = [c[0] for c in state.candidates if not c[2]]
            if regular:
                found = torch.linalg.qr(torch.stack(regular, dim=1)).Q  # (b, found)
                if found.shape[1] >= b:
                    break
                p = p - (p @ found) @ found.T  # unfound p_j are orthogonal to found q's
                left_dims = b - found.shape[1]
                if left_dims <= self.sweep_dims and scale > 0:
                    p = torch.cat([p, self._sweep(found, left_dims, scale, generator)])
            for chunk in p.split(self.batch_samples):
                margins = chunk @ a.T + offset  # (chunk, rows) pre-activations under each guess
                for k in sizes:
                    if out_of_time():
                        return False
                    index = margins.topk(k, dim=1, largest=False).indices  # most inactive rows
                    sub = unit[index]  # (chunk, k, b)
                    _, vecs = torch.linalg.eigh(sub.transpose(1, 2) @ sub)
                    q = vecs[:, :, 0]  # least-squares kernel of the k rows
                    diag["prior_guesses"] += q.shape[0]
                    self._absorb(state, q, torch.isfinite(q).all(dim=1))
                    if certified_now(force=state.pool_changed):
                        return True
                    state.pool_changed = False
            diag["prior_rounds"] = diag.get("prior_rounds", 0) + 1
            if len(state.candidates) == before:
                break
        return False

    def _sweep(self, found: Tensor, left_dims: int, scale: float, generator) -> Tensor:
        """Guesses covering the complement of the found directions, where the unfound p_j lie: directions
        (both signs of a line, 47 angles of a plane, 256 per dimension at random beyond) times 32 scales
        over four decades around a typical |p|. For when no prior input points the right way."""
        b = found.shape[0]
        eye = torch.eye(b, dtype=found.dtype, device=found.device)
        complement = torch.linalg.qr(torch.cat([found, eye], dim=1)).Q[:, found.shape[1]: b]  # (b, left_dims)
        if left_dims == 1:
            coords = torch.tensor([[1.0], [-1.0]], dtype=found.dtype, device=found.device)
        elif left_dims == 2:
            angles = torch.linspace(0, 2 * math.pi, 48, dtype=found.dtype, device=found.device)[:47]
            coords = torch.stack([angles.cos(), angles.sin()], dim=1)
        else:
            coords = torch.randn(256 * left_dims, left_dims, generator=generator, device=found.device, dtype=found.dtype)
            coords = coords / coords.norm(dim=1, keepdim=True)
        directions = coords @ complement.T
        sizes = scale * torch.logspace(-2, 2, 32, dtype=found.dtype, device=found.device)
        return (directions[:, None, :] * sizes[None, :, None]).reshape(-1, b)

    def _line_kernels(self, unit: Tensor, b: int, count: int, generator, screen_tol: float) -> tuple[Tensor, Tensor]:
        """b-2 sampled rows leave a 2-D kernel K; if they lie in column j's zero set, q_j = K c and every
        other zero row i of column j satisfies (L_i K) c = 0: the rows of L K in that set are collinear.
        The densest line (rows of L K sorted by angle, the longest run of equal angles) gives c.
        One row fewer to draw than the paper's (b-1)-row kernels, and robust to sampled rows that lie
        in the intersection of two columns' zero sets (a degenerate (b-1)-row kernel)."""
        rows = unit.shape[0]
        index = torch.randint(0, rows, (count, b - 2), generator=generator, device=self.device)
        sub = unit[index]  # (count, b-2, b)
        basis = torch.linalg.qr(sub.transpose(1, 2), mode="complete").Q[:, :, b - 2 :]  # (count, b, 2)
        proj = unit[None] @ basis  # (count, rows, 2)
        size = proj.norm(dim=2)
        angle = torch.atan2(proj[..., 1], proj[..., 0]).remainder(math.pi)
        # Rows (nearly) in the kernel carry no direction: park them far apart so they never chain.
        parked = size < 1e-3
        angle = torch.where(parked, 10.0 + torch.arange(rows, device=unit.device, dtype=unit.dtype)[None], angle)
        ordered, _ = angle.sort(dim=1)
        close = (ordered[:, 1:] - ordered[:, :-1]) <= 10 * screen_tol
        segment = torch.cat([torch.zeros(count, 1, dtype=torch.long, device=unit.device),
                             torch.cumsum(~close, dim=1)], dim=1)
        lengths = torch.zeros(count, rows, dtype=torch.long, device=unit.device).scatter_add_(
            1, segment, torch.ones_like(segment))
        best = lengths.argmax(dim=1)
        first = (segment == best[:, None]).to(torch.int8).argmax(dim=1)
        theta = ordered.gather(1, first[:, None])[:, 0]
        coeff = torch.stack([-torch.sin(theta), torch.cos(theta)], dim=1)  # orthogonal to the line
        q = (basis @ coeff[:, :, None])[:, :, 0]
        ok = (lengths.amax(dim=1) >= 2) & (theta < 4) & torch.isfinite(q).all(dim=1)
        return q, ok

    @staticmethod
    def _refine(unit: Tensor, q: Tensor, zero_tol: float, start_tol: float | None = None) -> tuple[Tensor, int, bool] | None:
        """Least-squares kernel of all rows on which q is zero; a few rounds until the zero set is stable.

        The first zero set uses `start_tol` (the screening tolerance), the later ones `zero_tol`.
        """
        zero = (unit @ q).abs() <= (zero_tol if start_tol is None else start_tol)
        for _ in range(3):
            if int(zero.sum()) < unit.shape[1] - 1:
                return None
            us, sv, vh = torch.linalg.svd(unit[zero], full_matrices=False)
            if float(sv[-2]) <= 100 * zero_tol:
                return None  # the zero rows leave a kernel of dimension > 1: an intersection, not a column
            direction = vh[-1]
            new_zero = (unit @ direction).abs() <= zero_tol
            if torch.equal(new_zero, zero):
                break
            zero = new_zero
        # A row with leverage ~1 is needed for the rank: typical of a lower-dimensional intersection
        # (rows zero in two or more columns) plus a few arbitrary rows rather than a column. Such
        # candidates are kept but ranked after the others.
        pivotal = float((us[:, :-1] ** 2).sum(dim=1).max()) > 1 - 1e-4
        # Fix the sign convention (largest |entry| positive) so that runs are reproducible.
        direction = direction * torch.sign(direction[direction.abs().argmax()])
        return direction, int(zero.sum()), pivotal

    def _pool_add(self, pool: dict, directions: Tensor, zeros: Tensor, need: int, unit: Tensor, zero_tol: float) -> bool:
        """Merge pivotal directions into the pool (distinct, the `max_pivotal` sparsest). True if it changed."""
        keep = zeros >= need
        directions, zeros = directions[keep], zeros[keep]
        if directions.shape[0] == 0 or self.max_pivotal == 0:
            return False
        before = pool["zeros"].numel()
        dirs = torch.cat([pool["dirs"], directions])
        counts = torch.cat([pool["zeros"], zeros])
        order = torch.argsort(counts, descending=True, stable=True)
        dirs, counts = dirs[order], counts[order]
        similar = (dirs @ dirs.T).abs() >= 1 - 1e-6
        first = ~torch.tril(similar, diagonal=-1).any(dim=1)  # no earlier (sparser) duplicate
        dirs, counts = dirs[first][: self.max_pivotal], counts[first][: self.max_pivotal]
        # Refine the newcomers (the least-squares kernel of their zero rows), as for other candidates.
        old = pool["dirs"]
        for i in range(dirs.shape[0]):
            if old.shape[0] and float((old @ dirs[i]).abs().max()) >= 1 - 1e-12:
                continue
            refined = self._refine(unit, dirs[i], zero_tol, self.screen_factor * zero_tol)
            if refined is not None:
                dirs[i], counts[i] = refined[0], refined[1]
        changed = counts.numel() != before or not torch.equal(counts, pool["zeros"])
        pool["dirs"], pool["zeros"] = dirs, counts
        return changed

    @staticmethod
    def _pool_list(pool: dict) -> list[tuple[Tensor, int, bool]]:
        return [(d, int(c), True) for d, c in zip(pool["dirs"], pool["zeros"].tolist())]

    def _good_enough(self, candidates, left, right, bias_grad, weight, bias, b, zero_tol, diag) -> bool:
        selection = self._select(candidates, left, right, bias_grad, weight, bias, b, zero_tol, diag,
                                 budget=self.max_swaps // 16)
        if selection is None:
            return False
        if weight is None or bias is None or bias_grad is None:
            return not any(candidates[i][2] for i in selection[0])  # b independent non-pivotal directions
        return selection[2] == 1.0

    def _select(self, candidates, left, right, bias_grad, weight, bias, b, zero_tol, diag, budget=None):
        """Greedy choice of b independent candidates, then single swaps while the certificate improves."""
        chosen = _greedy_independent(candidates, b)
        if chosen is None:
            return None
        q_hat = torch.stack([candidates[i][0] for i in chosen], dim=1)
        x, agreement = self._certify(q_hat, left, right, bias_grad, weight, bias, zero_tol)
        if agreement is not None and agreement < 1.0 and len(candidates) > b:
            chosen, x, agreement = self._swap_search(chosen, candidates, left, right, bias_grad, weight, bias,
                                                     zero_tol, x, agreement, diag, budget)
        return chosen, x, agreement

    # ------------------------------------------------------------------------------------------------------
    # Selection, scale, certificate

    def _scaled(self, q_hat: Tensor, left: Tensor, right: Tensor, bias_grad: Tensor | None) -> tuple[Tensor, Tensor]:
        """Q = Q_hat diag(s) with s = Q_hat^-1 L^+ dL/db, and X = (Q^-1 R)^T."""
        if bias_grad is None:
            x = torch.linalg.solve(q_hat, right)
            x = x / x.norm(dim=1, keepdim=True).clamp_min(_TINY)
            return q_hat, x
        db = bias_grad.detach().to(left.device, left.dtype)
        coeff = torch.linalg.lstsq(left, db[:, None]).solution[:, 0]  # L^+ dL/db = Q 1
        scale = torch.linalg.solve(q_hat, coeff)
        q = q_hat * scale[None, :]
        return q, torch.linalg.solve(q, right)

    def _certify(self, q_hat, left, right, bias_grad, weight, bias, zero_tol) -> tuple[Tensor, float | None]:
        q, x = self._scaled(q_hat, left, right, bias_grad)
        if weight is None or bias is None or bias_grad is None or not torch.isfinite(x).all():
            return x, None
        w = weight.detach().to(left.device, left.dtype)
        bb = bias.detach().to(left.device, left.dtype)
        pre = w @ x.T + bb[:, None]  # (m, b)
        return x, sparsity_agreement(left @ q, pre, zero_tol, self._dead_tol)

    def _finish(self, candidates, unit, left, right, live, bias_grad, weight, bias, b, n, zero_tol, diag, finish):
        chosen = _greedy_independent(candidates, b)
        can_certify = weight is not None and bias is not None and bias_grad is not None
        if chosen is None:
            found = _greedy_independent(candidates, len(candidates), partial=True) or []
            reason = (f"sample budget spent ({diag['samples']} submatrices, stopped: {diag.get('stopped')}): "
                      f"{len(found)} of {b} independent sparse directions found")
            if found:
                # Best effort: complete the directions found with an orthonormal complement (not exact).
                q_part = torch.stack([candidates[i][0] for i in found], dim=1)
                full = torch.linalg.qr(q_part, mode="complete").Q
                q_hat = torch.cat([q_part, full[:, len(found):]], dim=1)
                x = self._scaled(q_hat, left, right, bias_grad)[1]
                return finish(torch.nan_to_num(x), False, reason)
            return finish(left.new_zeros(0, n), False, reason)
        chosen, x, agreement = self._select(candidates, left, right, bias_grad, weight, bias, b, zero_tol, diag)
        diag["selected_zeros"] = [candidates[i][1] for i in chosen]
        diag["selected_pivotal"] = sum(candidates[i][2] for i in chosen)
        if bias_grad is None:
            return finish(x, False, "no bias gradient: inputs recovered only up to scale and sign (rows normalised)")
        if not torch.isfinite(x).all():
            return finish(torch.nan_to_num(x), False, "degenerate scale (a column of Q_hat explains no bias gradient)")
        if not can_certify:
            return finish(x, False, "not certified: the layer's weight and bias were not given", None)
        if agreement == 1.0:
            return finish(x, True, None, agreement)
        return finish(x, False, f"certificate failed: sparsity agreement {agreement:.6f} < 1", agreement)

    def _swap_search(self, chosen, candidates, left, right, bias_grad, weight, bias, zero_tol, x, agreement, diag,
                     budget: int | None = None):
        """Local search: for each slot (least sparse first) take the best single swap; repeat while it helps."""
        budget = self.max_swaps if budget is None else budget
        spare = [i for i in range(len(candidates)) if i not in chosen]
        tries = 0
        improved = True
        while improved and agreement < 1.0 and tries < budget:
            improved = False
            for slot in reversed(range(len(chosen))):
                best = None
                for extra in spare:
                    if tries >= budget:
                        break
                    trial = chosen[:slot] + [extra] + chosen[slot + 1 :]
                    q_hat = torch.stack([candidates[i][0] for i in trial], dim=1)
                    if float(torch.linalg.svdvals(q_hat)[-1]) < 1e-6:
                        continue
                    tries += 1
                    x_t, a_t = self._certify(q_hat, left, right, bias_grad, weight, bias, zero_tol)
                    if a_t is not None and a_t > agreement and (best is None or a_t > best[2]):
                        best = (extra, x_t, a_t)
                        if a_t == 1.0:
                            break
                if best is not None:
                    extra, x, agreement = best
                    spare = [i for i in spare if i != extra] + [chosen[slot]]
                    chosen = chosen[:slot] + [extra] + chosen[slot + 1 :]
                    improved = True
                    if agreement == 1.0:
                        break
        diag["swaps_tried"] = diag.get("swaps_tried", 0) + tries
        return chosen, x, agreement


def _pivotal(unit: Tensor, q: Tensor, zero_tol: float, tol: float = 1e-4) -> Tensor:
    """(H,) True where the zero set of direction q_h needs one particular row for its rank b-1.

    Such a zero set is a lower-dimensional intersection (rows that are zero in two or more columns of
    dL/dZ) plus an arbitrary row: the kernel then mixes two columns. A true column's zero set (about
    half the live rows) has no such row. The leverage of row i in zero set Z is a_i^T (A_Z^T A_Z + q q^T)^-1 a_i
    (A_Z^T A_Z has kernel q); a pivotal row has leverage 1. Also True when the zero rows leave a
    kernel of dimension > 1 (a singular Gram matrix). Batched over H directions.
    """
    zero = ((unit @ q.T).abs() <= zero_tol).to(unit.dtype)  # (rows, H)
    gram = torch.einsum("rh,rb,rc->hbc", zero, unit, unit) + q[:, :, None] * q[:, None, :]
    inverse, info = torch.linalg.inv_ex(gram)
    leverage = ((unit[None] @ inverse) * unit[None]).sum(-1) * zero.T  # (H, rows)
    return (info != 0) | ~torch.isfinite(leverage).all(dim=1) | (leverage.amax(dim=1) > 1 - tol)


def _greedy_independent(candidates: list[tuple[Tensor, int, bool]], b: int, partial: bool = False) -> list[int] | None:
    """Indices of the sparsest candidates that are linearly independent (b of them, or fewer if partial)."""
    chosen: list[int] = []
    basis: Tensor | None = None
    for i, (q, _, _) in enumerate(candidates):
        if len(chosen) == b:
            break
        v = q if basis is None else q - basis @ (basis.T @ q)
        if float(v.norm()) < 1e-6:
            continue
        v = v / v.norm()
        basis = v[:, None] if basis is None else torch.cat([basis, v[:, None]], dim=1)
        chosen.append(i)
    if len(chosen) == b or (partial and chosen):
        return chosen
    return None
