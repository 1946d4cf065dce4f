"""DAGER as a configuration object: `Dager(...)` holds the options, `attack(...)` runs one update.

`Dager` is what configs instantiate (`class_path: exact.Dager` or `exact.dager.Dager` with
`init_args`); its constructor's docstring is the CLI help. An attack never writes to it: each call
builds a `_DagerRun` (exact/dager/run.py) that holds that update's state. `with_options` derives a
differently configured attack (e.g. looser thresholds for multi-step clients) without touching this one.
"""

from __future__ import annotations

import inspect
import math
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from exact.dager.peel import SequenceUpdate, peel
from exact.dager.result import DagerResult, degenerate
from exact.dager.run import _DagerRun
from exact.layers import DagerLayers, find_layers


class Dager:
    """DAGER with explicit, configurable numerics. Call `attack(target, update, batch_size, max_length)`."""

    def __init__(
        self,
        rank_tol: float = 1e-6,
        blocks: str = "qkv",
        l1_threshold: float = 1e-3,
        l2_threshold: float = 1e-3,
        dtype: str = "float64",
        vocab_chunk: int = 8192,
        max_candidates: int = 1024,
        max_prefixes: int = 4096,
        max_pairs: int = 65536,
        token_budget: int = 16384,
        encoder_max_combinations: int = 4096,
        encoder_restarts: int | None = None,
        encoder_token_budget: int = 2_000_000,
        encoder_max_sweeps: int = 8,
        encoder_beam: int = 64,
        relaxed: bool = True,
        relaxed_top_k: int | None = None,
        relaxed_presence: float = 0.8,
        relaxed_span_fraction: float = 0.91,
        use_cache: bool = True,
        recover_last_token: bool = True,
        last_token_tol: float = 1e-3,
        coverage_tol: float = 1e-4,
        min_codimension: int = 4,
        eos_token_id: int | None = None,
        seed: int = 0,
        max_trajectory_points: int = 6,
        dropout_search: bool = True,
        split_positions: bool = True,
        split_width: float | None = 2.0,
        peel: bool = True,
    ) -> None:
        """
        Args:
            rank_tol: Numerical rank = number of singular values above rank_tol * the largest.
            blocks: Gradient blocks whose columns span the layer inputs: "q" (the paper: query only) or
                "qkv" (query, key and value; needed for the first token of causal models, whose query
                gradient vanishes because it only attends to itself).
            l1_threshold: A token passes the first-layer test when its normalised distance to the span is below this.
            l2_threshold: A sequence passes the second-layer test when every position's distance is below this.
            dtype: Dtype of the SVD and of all distances: "float64" (default) or "float32".
            vocab_chunk: Vocabulary tokens tested at once.
            max_candidates: At most this many candidates per position (the closest); more is flagged.
            max_prefixes: At most this many live prefixes in the causal search (the closest); more is flagged.
            max_pairs: At most this many (prefix, candidate) pairs per position in the causal search.
            token_budget: Tokens per forward pass of the second-layer probe.
            encoder_max_combinations: Exhaustive search over per-position candidates up to this many combinations.
            encoder_restarts: Coordinate-descent restarts beyond that (default: batch size + 3).
            encoder_token_budget: At most this many tokens run through block 1 by the bidirectional search
                of one update (bounds its time; exhausting it is recorded in the diagnostics, and flagged
                when the sequences found do not explain both gradients).
            encoder_max_sweeps: Coordinate-descent sweeps per restart.
            encoder_beam: Width of the bidirectional prefix beam search that runs before coordinate
                descent (0: coordinate descent only).
            relaxed: When the strict tests find nothing, return a best-effort reconstruction ranked by distance.
            relaxed_top_k: Candidates per position in relaxed mode (default: the batch size, at least 2; twice
                that for an encoder whose candidates the first-layer split ranks).
            relaxed_presence: Relaxed mode: a position holds a token when its best first-layer distance is
                below this fraction of the vocabulary's median distance there (sets the length).
            relaxed_span_fraction: Relaxed mode: the second-layer span keeps at most this fraction of the width
                d. A (nearly) full span (more tokens in context than d) puts every candidate at distance ~0;
                its top directions still rank the true continuation first for the first positions of a
                sentence (benchmarks/investigations/dager/notes.md, "Best effort against a full span"). 1.0: d - 1 directions.
            use_cache: Use a key/value cache for the causal prefix search where the model supports it.
            recover_last_token: Recover each sequence's final token (a label only) from the final-norm gradient.
            last_token_tol: Relative residual of the final-norm gradient below which the last tokens are exact.
            min_codimension: The strict test needs the second-layer span to miss at least this many of the
                d dimensions (with fewer, random sequences pass by chance); otherwise relaxed mode.
            coverage_tol: Certificate: the recovered sequences' inputs must leave less than this fraction of
                the layer-1 and layer-2 gradients (their numerical ranges) unexplained.
            eos_token_id: End-of-sequence token of bidirectional models (sequence ends where it passes).
            seed: Seed of the encoder search's random restarts.
            max_trajectory_points: Multi-step clients: the second-layer test runs at most at this many points
                of the client's path (evenly spread over its local steps, the global weights included);
                each costs one more block-1 pass per candidate.
            dropout_search: A causal model with dropout on its embeddings (GPT-2's embd_pdrop), whose strict
                test finds nothing: look for each first-layer input's dropout mask and chain the inputs by
                their query gradients (exact.dager.dropout) before falling back to the relaxed best effort.
            split_positions: Bidirectional models with learned positions: split the first-layer gradient into
                token and position parts (exact.dager.position_split) to pin tokens to their positions and
                prune the per-position candidates before the search.
            split_width: After the split, candidates kept per position for the strict search, in
                multiples of the batch size: the pinned tokens, then the best-fitting others (None: every
                candidate). The default 2 is the relaxed fill's width, checked on development sentences
                (benchmarks/investigations/dager/notes.md, "The split's focus").
            peel: When the strict search certifies some sequences of a FedSGD update but not all, and the
                caller can simulate the client (`attack(sequence_update=...)`): subtract the certified
                sequences' own updates and attack the rest again, while rounds certify more
                (exact.dager.peel). Each subtraction must lower the second-layer rank; a certified sequence
                whose subtraction does not is kept out and loses its certificate.
        """
        if isinstance(dtype, str):
            if dtype not in ("float64", "float32"):
                raise ValueError(f"DAGER dtype {dtype!r} not allowed; use 'float64' (default) or 'float32'")
            dtype = getattr(torch, dtype)
        for name, value in (("rank_tol", rank_tol), ("l1_threshold", l1_threshold), ("l2_threshold", l2_threshold)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"DAGER {name}={value} must be a finite number > 0")
        self.rank_tol = float(rank_tol)
        if blocks not in ("q", "qkv"):
            raise ValueError(f"DAGER blocks={blocks!r} not allowed; use 'q' or 'qkv'")
        self.blocks = blocks
        self.l1_threshold = float(l1_threshold)
        self.l2_threshold = float(l2_threshold)
        self.dtype = dtype
        self.vocab_chunk = int(vocab_chunk)
        self.max_candidates = int(max_candidates)
        self.max_prefixes = int(max_prefixes)
        self.max_pairs = int(max_pairs)
        self.token_budget = int(token_budget)
        self.encoder_max_combinations = int(encoder_max_combinations)
        self.encoder_restarts = encoder_restarts
        self.encoder_token_budget = int(encoder_token_budget)
        self.encoder_max_sweeps = int(encoder_max_sweeps)
        self.encoder_beam = int(encoder_beam)
        self.relaxed = bool(relaxed)
        self.relaxed_top_k = relaxed_top_k
        self.relaxed_presence = float(relaxed_presence)
        if not 0.0 < relaxed_span_fraction <= 1.0:
            raise ValueError(f"DAGER relaxed_span_fraction={relaxed_span_fraction} must be in (0, 1]")
        self.relaxed_span_fraction = float(relaxed_span_fraction)
        self.use_cache = bool(use_cache)
        self.recover_last_token = bool(recover_last_token)
        self.last_token_tol = float(last_token_tol)
        self.coverage_tol = float(coverage_tol)
        self.min_codimension = int(min_codimension)
        self.eos_token_id = eos_token_id
        self.seed = int(seed)
        if max_trajectory_points < 2:
            raise ValueError(f"DAGER max_trajectory_points={max_trajectory_points} must be >= 2 (the global weights and one more)")
        self.max_trajectory_points = int(max_trajectory_points)
        self.dropout_search = bool(dropout_search)
        self.split_positions = bool(split_positions)
        if split_width is not None and split_width <= 0:
            raise ValueError(f"DAGER split_width={split_width} must be positive (or None: keep every candidate)")
        self.split_width = None if split_width is None else float(split_width)
        self.peel = bool(peel)
        # Which layers DAGER reads in a model does not depend on the options: looked up once per model,
        # and shared with the attacks derived by `with_options`.
        self._layers: weakref.WeakKeyDictionary[nn.Module, DagerLayers] = weakref.WeakKeyDictionary()

    def layers(self, target: nn.Module) -> DagerLayers:
        """The layers DAGER reads in `target` (looked up once per model)."""
        if target not in self._layers:
            self._layers[target] = find_layers(target)
        return self._layers[target]

    def options(self) -> dict[str, Any]:
        """The constructor arguments that give this attack (`dtype` as a torch dtype)."""
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return {name: getattr(self, name) for name in names}

    def with_options(self, **changes: Any) -> Dager:
        """A new attack configured as this one except for `changes` (constructor arguments, validated
        as there); this one is left unchanged."""
        derived = type(self)(**{**self.options(), **changes})
        derived._layers = self._layers
        return derived

    # ------------------------------------------------------------------------------------------------------

    def attack(
        self,
        target: nn.Module,
        update: Mapping[str, Tensor],
        batch_size: int | None = None,
        max_length: int | None = None,
        trajectory: Sequence[float] = (),
        sequence_update: SequenceUpdate | None = None,
    ) -> DagerResult:
        """Recover the sequences behind one client update.

        Args:
            target: The global model (`datamodules.targets` model or a Hugging Face model).
            update: {parameter name: gradient} of ONE client update (the mean over its sequences).
            batch_size: Sequences in the update (the client protocol, known to the server); None = unknown.
            max_length: Longest sequence length (the protocol's block length); None = the model's limit.
            trajectory: For a multi-step client whose `update` is the mean of its local gradients: the
                offsets s_t (t * lr for plain local SGD) at which the second-layer test also runs block 1,
                at weights w - s_t * update, where a straight path puts the client before step t. ()
                = only at w (FedSGD). The client's protocol is known to the server. Used only when the
                result at w is not exact (causal models, whose sequences can pass cut short) or has
                fewer than `batch_size` sequences (bidirectional ones), at most at
                `max_trajectory_points`, and kept when more sequences pass along the path, or as many
                that explain more of the gradients.
            sequence_update: The server's simulation of the client: token ids of one sequence -> the update
                that sequence alone gives ({name: gradient}, undefended), for a FedSGD client whose update is
                the mean of its sequences' own updates; None when it cannot be simulated. With `peel`, the
                certified sequences are subtracted and the rest attacked again (ignored with a `trajectory`).
        """
        start = time.perf_counter()
        diag: dict[str, Any] = {"batch_size": batch_size, "max_length": max_length}
        try:
            layers = self.layers(target)
        except ValueError as error:
            result = degenerate(diag, f"unsupported model: {error}")
            result.diagnostics["seconds"] = time.perf_counter() - start
            return result
        diag["architecture"] = layers.architecture
        was_training = target.training
        target.eval()
        points = self._trajectory_points(trajectory)
        try:
            with torch.no_grad():
                result = _DagerRun(self, target, layers, update, batch_size, max_length, diag).execute()
                # A causal search returns maximal prefixes: a drifted sentence can pass at w cut short, so
                # a full count does not mean the path has nothing to add. A bidirectional search scores
                # whole sequences only: there a full count does (and its search is costly to repeat).
                complete = result.exact if layers.causal else (batch_size is not None and _passed(result) == batch_size)
                if len(points) > 1 and not complete:
                    # Test again along the client's path (one more block-1 pass per point). Keep it if more
                    # sequences pass, or as many that explain more of the gradients.
                    again = _DagerRun(self, target, layers, update, batch_size, max_length,
                                      dict(diag, passed_at_global_weights=_passed(result)), points).execute()
                    if _rank(again) > _rank(result):
                        result = again
                elif len(points) <= 1 and self.peel and sequence_update is not None and batch_size is not None:
                    result = peel(
                        lambda residual, remaining: _DagerRun(self, target, layers, residual, remaining, max_length,
                                                              {"batch_size": remaining, "max_length": max_length}).execute(),
                        update, batch_size, result, sequence_update,
                        lambda u: self._second_singular_values(layers, u), self.rank_tol,
                    )
        except (RuntimeError, ValueError) as error:  # e.g. an SVD that does not converge on garbage input
            result = degenerate(diag, f"{type(error).__name__}: {error}")
        finally:
            target.train(was_training)
        result.diagnostics["seconds"] = time.perf_counter() - start
        return result

    __call__ = attack

    def _second_singular_values(self, layers: DagerLayers, update: Mapping[str, Tensor]) -> Tensor:
        """Singular values of an update's second-layer gradient (what peeling counts its rank from)."""
        g = layers.second.input_space(update, self.blocks)
        return torch.linalg.svdvals(g.to(device=layers.inputs.embedding.device, dtype=self.dtype))

    def _trajectory_points(self, trajectory: Sequence[float]) -> tuple[float, ...]:
        """At most `max_trajectory_points` of the offsets, evenly spread, the first and last kept."""
        points = tuple(float(s) for s in trajectory)
        limit = self.max_trajectory_points
        if len(points) <= limit:
            return points
        picks = sorted({round(i * (len(points) - 1) / (limit - 1)) for i in range(limit)})
        return tuple(points[i] for i in picks)


def local_step_offsets(client: Any) -> tuple[float, ...]:
    """The `trajectory` of a local-SGD client (FedAvg): offsets t * lr of its local steps t = 0..T-1,
    from its protocol (known to the server); () for a client without several steps and a learning rate."""
    steps = client.local_steps() if hasattr(client, "local_steps") else 1
    lr = getattr(client, "lr", None)
    if steps <= 1 or lr is None:
        return ()
    return tuple(t * float(lr) for t in range(steps))


def _passed(result: DagerResult) -> int:
    """Sequences that passed both span tests (a relaxed result's ranked guesses did not)."""
    return len(result.sequences) if result.diagnostics.get("mode") == "strict" else 0


def _rank(result: DagerResult) -> tuple[int, float]:
    """Which of two results is better: more sequences passed, then less of the gradients unexplained."""
    diag = result.diagnostics
    unexplained = diag.get("unexplained1", 1.0) + diag.get("unexplained2", 1.0) if _passed(result) else 2.0
    return _passed(result), -unexplained


def dager_attack(
    target: nn.Module,
    update: Mapping[str, Tensor],
    batch_size: int | None = None,
    max_length: int | None = None,
    trajectory: Sequence[float] = (),
    sequence_update: SequenceUpdate | None = None,
    **options,
) -> DagerResult:
    """Functional shortcut: `Dager(**options).attack(target, update, batch_size, max_length, trajectory, sequence_update)`."""
    return Dager(**options).attack(target, update, batch_size, max_length, trajectory, sequence_update)
