"""DAGER as a configuration object: `Dager(...)` holds the options, `attack(...)` runs one update.

`Dager` is what configs instantiate (`class_path: exact.Dager` or `exact.dager.Dager` with
`init_args`); its constructor's docstring is the CLI help. An attack never writes to it: each call
builds a `DagerRun` (exact/dager/run.py) that holds that update's state. The options come in groups
(exact/dager/options.py), nested in configs and in the CLI help. `with_options` derives a differently
configured attack (e.g. looser thresholds for multi-step clients) without touching this one.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from datamodules.federated.protocols.base import model_mode
from exact.dager.options import (
    Budgets,
    CausalOptions,
    DagerOptions,
    EncoderOptions,
    Extensions,
    RelaxedFill,
    SpanTests,
)
from exact.dager.peel import SequenceUpdate, peel
from exact.dager.result import DagerResult, degenerate
from exact.dager.run import DagerRun
from exact.layers import DagerLayers, find_layers


class Dager:
    """DAGER with explicit, configurable numerics. Call `attack(target, update, batch_size, max_length)`."""

    def __init__(
        self,
        span: SpanTests = SpanTests(),
        budgets: Budgets = Budgets(),
        causal: CausalOptions = CausalOptions(),
        encoder: EncoderOptions = EncoderOptions(),
        relaxed: RelaxedFill = RelaxedFill(),
        extensions: Extensions = Extensions(),
    ) -> None:
        """
        Args:
            span: The two span tests and the certificate: ranks, thresholds, numerics.
            budgets: How much of the vocabulary and of block 1 is run at once; candidates per position.
            causal: The prefix search of causal (decoder) models and their last token.
            encoder: The bounded search of bidirectional (encoder) models, and the first-layer split.
            relaxed: The best effort when the strict tests find nothing.
            extensions: Steps beyond the paper: train-mode clients (dropout), multi-step clients
                (the trajectory), peeling of updates the server can simulate.
        """
        #: Every option, by group (exact.dager.options); what each run of this attack reads.
        self.options = DagerOptions(span, budgets, causal, encoder, relaxed, extensions)
        # Which layers DAGER reads in a model does not depend on the options: looked up once per model,
        # and shared with the attacks derived by `with_options`.
        self._layers: weakref.WeakKeyDictionary[nn.Module, DagerLayers] = weakref.WeakKeyDictionary()

    def layers(self, target: nn.Module) -> DagerLayers:
        """The layers DAGER reads in `target` (looked up once per model)."""
        if target not in self._layers:
            self._layers[target] = find_layers(target)
        return self._layers[target]

    def with_options(self, **changes: Any) -> Dager:
        """A new attack configured as this one except for `changes`, this one left unchanged.

        Each keyword names a group (`span`, `budgets`, `causal`, `encoder`, `relaxed`, `extensions`) and
        gives either a new group or a mapping of the fields to change in it, e.g.
        `with_options(span={"l1_threshold": 1e-2, "l2_threshold": 1e-2})`; the values are checked as
        in the constructor.
        """
        groups = {f.name: getattr(self.options, f.name) for f in fields(self.options)}
        for name, change in changes.items():
            if name not in groups:
                raise ValueError(f"DAGER has no option group {name!r}; the groups are {sorted(groups)}")
            if isinstance(change, Mapping):
                allowed = {f.name for f in fields(groups[name])}
                unknown = sorted(set(change) - allowed)
                if unknown:
                    raise ValueError(f"DAGER {name} has no option {unknown[0]!r}; it has {sorted(allowed)}")
                change = replace(groups[name], **change)
            elif not isinstance(change, type(groups[name])):
                raise ValueError(f"DAGER {name}: expected a {type(groups[name]).__name__} or a mapping of its "
                                 f"fields, got {type(change).__name__}")
            groups[name] = change
        derived = type(self)(**groups)
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
                `extensions.max_trajectory_points`, and kept when more sequences pass along the path, or as many
                that explain more of the gradients.
            sequence_update: The server's simulation of the client: token ids of one sequence -> the update
                that sequence alone gives ({name: gradient}, undefended), for a FedSGD client whose update is
                the mean of its sequences' own updates; None when it cannot be simulated. With `extensions.peel`, the
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
        points = self._trajectory_points(trajectory)
        with model_mode(target, "eval"):  # no dropout in the span tests' forward passes
            try:
                with torch.no_grad():
                    result = DagerRun(self.options, target, layers, update, batch_size, max_length, diag).execute()
                    # A causal search returns maximal prefixes: a drifted sentence can pass at w cut short, so
                    # a full count does not mean the path has nothing to add. A bidirectional search scores
                    # whole sequences only: there a full count does (and its search is costly to repeat).
                    complete = result.exact if layers.causal else (batch_size is not None and _passed(result) == batch_size)
                    if len(points) > 1 and not complete:
                        # Test again along the client's path (one more block-1 pass per point). Keep it if more
                        # sequences pass, or as many that explain more of the gradients.
                        again = DagerRun(self.options, target, layers, update, batch_size, max_length,
                                         dict(diag, passed_at_global_weights=_passed(result)), points).execute()
                        if _rank(again) > _rank(result):
                            result = again
                    elif (len(points) <= 1 and self.options.extensions.peel and sequence_update is not None
                          and batch_size is not None):
                        result = peel(
                            lambda residual, remaining: DagerRun(self.options, target, layers, residual, remaining, max_length,
                                                                 {"batch_size": remaining, "max_length": max_length}).execute(),
                            update, batch_size, result, sequence_update,
                            lambda u: self._second_singular_values(layers, u), self.options.span.rank_tol,
                        )
            except (RuntimeError, ValueError) as error:  # e.g. an SVD that does not converge on garbage input
                result = degenerate(diag, f"{type(error).__name__}: {error}")
        result.diagnostics["seconds"] = time.perf_counter() - start
        return result

    __call__ = attack

    def _second_singular_values(self, layers: DagerLayers, update: Mapping[str, Tensor]) -> Tensor:
        """Singular values of an update's second-layer gradient (what peeling counts its rank from)."""
        span = self.options.span
        g = layers.second.input_space(update, span.blocks)
        return torch.linalg.svdvals(g.to(device=layers.inputs.embedding.device, dtype=span.torch_dtype))

    def _trajectory_points(self, trajectory: Sequence[float]) -> tuple[float, ...]:
        """At most `extensions.max_trajectory_points` of the offsets, evenly spread, the first and last kept."""
        points = tuple(float(s) for s in trajectory)
        limit = self.options.extensions.max_trajectory_points
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
    """Functional shortcut: `Dager(**options).attack(target, update, batch_size, max_length, trajectory, sequence_update)`
    (`options`: the constructor's groups)."""
    return Dager(**options).attack(target, update, batch_size, max_length, trajectory, sequence_update)
