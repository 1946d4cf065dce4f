"""DAGER's options, in the groups a config sets them in: `Dager(span=SpanTests(...), encoder=...)`.

Each group is a frozen dataclass, so jsonargparse shows it as a nested block of the CLI help and
of configs (`attack: {class_path: exact.Dager, init_args: {span: {l2_threshold: 1e-2}}}`), an
attack derived by `Dager.with_options` shares the groups it does not change, and each step of the
attack receives the groups it reads and nothing else. `DagerOptions` holds one of each: what one
attack run reads.

Every value is checked when its group is built; a bad one fails with a one-line `ValueError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from exact.option_group import OptionGroup

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class SpanTests(OptionGroup):
    """The two span tests and the certificate: ranks, thresholds, numerics.

    Args:
        rank_tol: Numerical rank = number of singular values above rank_tol * the largest.
        blocks: Gradient blocks whose columns span the layer inputs: "q" (the paper: query only) or
            "qkv" (query, key and value; needed for the first token of causal models, whose query
            gradient vanishes because it only attends to itself).
        l1_threshold: A token passes the first-layer test when its normalised distance to the span is below this.
        l2_threshold: A sequence passes the second-layer test when every position's distance is below this.
        min_codimension: The strict test needs the second-layer span to miss at least this many of the
            d dimensions (with fewer, random sequences pass by chance); otherwise relaxed mode.
        coverage_tol: Certificate: the recovered sequences' inputs must leave less than this fraction of
            the layer-1 and layer-2 gradients (their numerical ranges) unexplained.
        dtype: Dtype of the SVD and of all distances: "float64" (default) or "float32".
    """

    rank_tol: float = 1e-6
    blocks: Literal["q", "qkv"] = "qkv"
    l1_threshold: float = 1e-3
    l2_threshold: float = 1e-3
    min_codimension: int = 4
    coverage_tol: float = 1e-4
    dtype: Literal["float64", "float32"] = "float64"


    def _check(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"DAGER dtype {self.dtype!r} not allowed; use 'float64' (default) or 'float32'")
        for name in ("rank_tol", "l1_threshold", "l2_threshold"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"DAGER {name}={value} must be a finite number > 0")
        if self.blocks not in ("q", "qkv"):
            raise ValueError(f"DAGER blocks={self.blocks!r} not allowed; use 'q' or 'qkv'")

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class Budgets(OptionGroup):
    """How much of the vocabulary and of block 1 is run at once, and how many candidates a position keeps.

    Args:
        vocab_chunk: Vocabulary tokens tested at once.
        probe_tokens: Tokens per forward pass of the second-layer probe (block 1).
        max_candidates: At most this many candidates per position (the closest); more is flagged.
    """

    vocab_chunk: int = 8192
    probe_tokens: int = 16384
    max_candidates: int = 1024



@dataclass(frozen=True)
class CausalOptions(OptionGroup):
    """The prefix search of causal (decoder) models and their last token.

    Args:
        max_prefixes: At most this many live prefixes in the causal search (the closest); more is flagged.
            Also bounds the sequences the certificate chooses from.
        max_pairs: At most this many (prefix, candidate) pairs per position in the causal search.
        use_cache: Use a key/value cache for the causal prefix search where the model supports it.
        recover_last_token: Recover each sequence's final token (a label only) from the final-norm gradient.
        last_token_tol: Relative residual of the final-norm gradient below which the last tokens are exact.
    """

    max_prefixes: int = 4096
    max_pairs: int = 65536
    use_cache: bool = True
    recover_last_token: bool = True
    last_token_tol: float = 1e-3



@dataclass(frozen=True)
class EncoderOptions(OptionGroup):
    """The bounded search of bidirectional (encoder) models, and the first-layer split that feeds it.

    Args:
        max_combinations: Exhaustive search over per-position candidates up to this many combinations.
        restarts: Coordinate-descent restarts beyond that (default: batch size + 3).
        token_budget: At most this many tokens run through block 1 by the bidirectional search of one
            update (bounds its time; exhausting it is recorded in the diagnostics, and flagged when the
            sequences found do not explain both gradients).
        max_sweeps: Coordinate-descent sweeps per restart.
        beam: Width of the bidirectional prefix beam search that runs before coordinate descent
            (0: coordinate descent only).
        seed: Seed of the search's random restarts.
        eos_token_id: End-of-sequence token (a sequence ends where it passes).
        split_positions: Models with learned positions: split the first-layer gradient into token and
            position parts (exact.dager.position_split) to pin tokens to their positions and prune the
            per-position candidates before the search.
        split_width: After the split, candidates kept per position for the strict search, in multiples
            of the batch size: the pinned tokens, then the best-fitting others (None: every candidate).
            The default 2 is the relaxed fill's width, checked on development sentences
            (benchmarks/investigations/dager/notes.md, "The split's focus").
    """

    max_combinations: int = 4096
    restarts: int | None = None
    token_budget: int = 2_000_000
    max_sweeps: int = 8
    beam: int = 64
    seed: int = 0
    eos_token_id: int | None = None
    split_positions: bool = True
    split_width: float | None = 2.0


    def _check(self) -> None:
        if self.split_width is not None and self.split_width <= 0:
            raise ValueError(f"DAGER split_width={self.split_width} must be positive (or None: keep every candidate)")


@dataclass(frozen=True)
class RelaxedFill(OptionGroup):
    """The best effort when the strict tests find nothing (or, for encoders, too few sequences).

    Args:
        enabled: Return a best-effort reconstruction ranked by distance (False: an empty, degenerate result).
        top_k: Candidates per position (default: the batch size, at least 2; twice that for an encoder
            whose candidates the first-layer split ranks).
        presence: A position holds a token when its best first-layer distance is below this fraction of
            the vocabulary's median distance there (sets the length).
        span_fraction: The second-layer span keeps at most this fraction of the width d. A (nearly) full
            span (more tokens in context than d) puts every candidate at distance ~0; its top directions
            still rank the true continuation first for the first positions of a sentence
            (benchmarks/investigations/dager/notes.md, "Best effort against a full span"). 1.0: d - 1
            directions.
    """

    enabled: bool = True
    top_k: int | None = None
    presence: float = 0.8
    span_fraction: float = 0.91


    def _check(self) -> None:
        if not 0.0 < self.span_fraction <= 1.0:
            raise ValueError(f"DAGER relaxed span_fraction={self.span_fraction} must be in (0, 1]")


@dataclass(frozen=True)
class Extensions(OptionGroup):
    """Steps beyond the paper: train-mode clients, multi-step clients, and peeling of simulated updates.

    Args:
        dropout_search: A causal model with dropout on its embeddings (GPT-2's embd_pdrop), whose strict
            test finds nothing: look for each first-layer input's dropout mask and chain the inputs by
            their query gradients (exact.dager.dropout) before falling back to the relaxed best effort.
        max_trajectory_points: Multi-step clients: the second-layer test runs at most at this many points
            of the client's path (evenly spread over its local steps, the global weights included);
            each costs one more block-1 pass per candidate.
        peel: When the strict search certifies some sequences of a FedSGD update but not all, and the
            caller can simulate the client (`attack(sequence_update=...)`): subtract the certified
            sequences' own updates and attack the rest again, while rounds certify more
            (exact.dager.peel). Each subtraction must lower the second-layer rank; a certified sequence
            whose subtraction does not is kept out and loses its certificate.
    """

    dropout_search: bool = True
    max_trajectory_points: int = 6
    peel: bool = True


    def _check(self) -> None:
        if self.max_trajectory_points < 2:
            raise ValueError(f"DAGER max_trajectory_points={self.max_trajectory_points} must be >= 2 "
                             "(the global weights and one more)")


#: The span tests for an update read off the float32 weights a client returned, as every server reads it: the
#: returned weights' rounding is fixed in size while a clipped or small step is not, so a true input's distance to
#: the gradient's span sits well above the paper's 1e-3 (its simulated gradients have no such rounding), while a
#: wrong token's stays far beyond 1e-2 (docs/audit.md, "DAGER's thresholds on float32 returned weights": chosen on
#: the auxiliary tail).
RETURNED_FLOAT32 = SpanTests(l1_threshold=1e-2, l2_threshold=1e-2)


@dataclass(frozen=True)
class DagerOptions:
    """Every group of options: what one DAGER run reads."""

    span: SpanTests = field(default_factory=SpanTests)
    budgets: Budgets = field(default_factory=Budgets)
    causal: CausalOptions = field(default_factory=CausalOptions)
    encoder: EncoderOptions = field(default_factory=EncoderOptions)
    relaxed: RelaxedFill = field(default_factory=RelaxedFill)
    extensions: Extensions = field(default_factory=Extensions)
