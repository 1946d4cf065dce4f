"""SPEAR's options, in the groups a config sets them in: `Spear(budget=SearchBudget(max_seconds=20), ...)`.

Each group is a frozen dataclass, so jsonargparse shows it as a nested block of the CLI help and of
configs (`attack: {class_path: exact.Spear, init_args: {budget: {max_seconds: 20}}}`), and each step
of the attack receives the groups it reads and nothing else. `SpearOptions` holds one of each, with
the device and dtype: what one attack run reads.

Every value is checked when its group is built; a bad one fails with a one-line `ValueError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exact.option_group import OptionGroup


@dataclass(frozen=True)
class SearchBudget(OptionGroup):
    """How long one attack searches.

    Args:
        max_samples: Budget of (b-1)-row submatrices drawn per attack; exhausting it is flagged.
        max_seconds: Optional wall-clock budget per attack (None: only `max_samples` bounds it).
        batch_samples: Submatrices sampled and solved at once per iteration (vectorised).
    """

    max_samples: int = 4_000_000
    max_seconds: float | None = None
    batch_samples: int = 4096

    def _check(self) -> None:
        if self.max_samples < 1 or self.batch_samples < 1:
            raise ValueError("max_samples and batch_samples must be >= 1")


@dataclass(frozen=True)
class Sampling(OptionGroup):
    """Which sampled directions become candidates.

    Args:
        tau: A direction q is a candidate when L q has at least tau * (live rows) zeros (and at least b).
        seed: Seed of the sampler (results are deterministic for a given seed and device).
        prefilter_rows: Random live rows on which every kernel is screened before the full test
            (0 disables the pre-filter).
        screen_factor: Sampled kernels are screened with tolerance screen_factor * zero_tol (they can be
            ill-conditioned); candidates are refined and then counted with zero_tol. 1 = one tolerance.
        line_search: Draw b-2 rows and find the densest line of L K in their 2-D kernel K (one row fewer
            per draw; see `exact.spear.sampling.line_kernels`) instead of the paper's (b-1)-row kernels.
    """

    tau: float = 0.1
    seed: int = 0
    prefilter_rows: int = 128
    screen_factor: float = 1.0
    line_search: bool = False

    def _check(self) -> None:
        if not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau={self.tau} must be in (0, 1)")


@dataclass(frozen=True)
class Tolerances(OptionGroup):
    """What counts as rank, as zero and as a dead neuron.

    Args:
        rank_tol: Numerical rank = singular values above rank_tol * the largest (used when the batch
            size is not given, and reported always).
        zero_tol: (L q)_i counts as zero when |L_i q| <= zero_tol * ||L_i|| * ||q||. None: 1e-9 for
            float64 gradients, 1e-6 for lower precision (float32 rounding of dL/dW is ~1e-8; float64
            gradients whose values are all float32-representable count as float32).
        dead_tol: Rows of L with norm <= dead_tol * the largest row norm are dead neurons. None: 1e-12
            for float64 gradients, 1e-6 for lower precision.
    """

    rank_tol: float = 1e-6
    zero_tol: float | None = None
    dead_tol: float | None = None

    def _check(self) -> None:
        if self.rank_tol <= 0:
            raise ValueError(f"rank_tol={self.rank_tol} must be > 0")


@dataclass(frozen=True)
class Selection(OptionGroup):
    """How the b directions are chosen among the candidates.

    Args:
        max_swaps: Certificate evaluations of single-candidate swaps when the greedy selection is not
            certified (1/16 of this while sampling, all of it for the final selection).
        max_pivotal: "Pivotal" candidates (a zero set that needs one particular row for its rank: usually
            the intersection of two columns' zero sets plus one row, a mixture of two columns) are
            only a fallback for the selection, after all others; at most this many, the sparsest.
    """

    max_swaps: int = 1024
    max_pivotal: int = 64


@dataclass(frozen=True)
class PriorGuidance(OptionGroup):
    """How plausible layer inputs (`Spear.attack(prior=...)`) guide the search (`exact.spear.prior`).

    Args:
        rows: Each guess names its k most inactive neurons, for k = each of these multiples of b (at
            least b - 1); their least-squares kernel is a candidate.
        rounds: Rounds of guesses; each round projects the guesses on the complement of the directions
            found so far (a round that finds nothing ends the prior phase).
        max_inputs: Use at most this many prior inputs (a seeded random subset of larger priors).
        sweep_dims: When at most this many columns are left, the rounds also sweep the subspace their
            p_j lie in (see `exact.spear.prior.sweep`); 0 disables the sweep.
    """

    rows: tuple[float, ...] = (1.25, 2.0)
    rounds: int = 4
    max_inputs: int = 4096
    sweep_dims: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(float(f) for f in self.rows))
        super().__post_init__()

    def _check(self) -> None:
        if not self.rows or any(f <= 0 for f in self.rows) or self.rounds < 0 or self.max_inputs < 1 \
                or self.sweep_dims < 0:
            raise ValueError(f"prior guidance: rows={self.rows} must be positive multiples of b, rounds={self.rounds} "
                             f">= 0, max_inputs={self.max_inputs} >= 1, sweep_dims={self.sweep_dims} >= 0")


@dataclass(frozen=True)
class SpearOptions:
    """Every group of options, with the device and dtype of the computation: what one SPEAR run reads."""

    budget: SearchBudget = field(default_factory=SearchBudget)
    sampling: Sampling = field(default_factory=Sampling)
    tolerances: Tolerances = field(default_factory=Tolerances)
    selection: Selection = field(default_factory=Selection)
    guidance: PriorGuidance = field(default_factory=PriorGuidance)
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float64
