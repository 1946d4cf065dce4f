"""What every client protocol shares: the registry, the observation context and the model mode.

A protocol (FedSGD, FedAvg, LoRA) turns one client batch into the defended update the server sees.
It is written once for every modality: the `ClientLoss` in the `Observation` knows the batch's
fields and computes the gradients (text: next-token loss; images/tables: classification loss).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from datamodules.federated.defenses import Defense, NoDefense
from datamodules.federated.losses import ClientBatch, ClientLoss
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.protocols.local_sgd import SingleStep
from datamodules.registry import Registry

CLIENT_PROTOCOLS: Registry["ClientProtocol"] = Registry("client protocol")

#: Called on raw gradients/deltas before the defense; raises on nan/inf (the pipeline names the parameter).
FiniteCheck = Callable[[Tensor], None]


def default_check(values: Tensor) -> None:
    # A sum is ~20x cheaper than an element-wise scan and is non-finite whenever an element is; the
    # scan only runs then (or on overflow of the sum).
    if not torch.isfinite(values.sum()) and not torch.isfinite(values).all():
        raise FloatingPointError("non-finite client update (nan/inf); check the target model and data")


@dataclass
class Observation:
    """Everything a protocol needs besides the batch: the global model and its observed parameters,
    the client's loss, the defense, the random draws, the finiteness check and (for protocols with
    local steps) which parameters the client trains (None: the protocol's own choice)."""

    target: nn.Module
    names: Sequence[str]
    loss: ClientLoss
    defense: Defense = field(default_factory=NoDefense)
    generator: torch.Generator | None = None
    check: FiniteCheck = default_check
    trainable: Sequence[str] | None = None


@contextmanager
def model_mode(target: nn.Module, mode: str):
    """Run with the model in `train()` (dropout on) or `eval()` mode, restoring afterwards (also on an error) each
    module's own mode: a wrapper and the model it holds, or a frozen part kept in eval, may differ, and
    `target.train(was_training)` would set them all alike."""
    if mode not in ("train", "eval"):
        raise ValueError(f"mode={mode!r} must be 'train' or 'eval'")
    modes = [(module, module.training) for module in target.modules()]
    target.train(mode == "train")
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def check_choice(what: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        names = [repr(a) for a in allowed]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise ValueError(f"client {what} {value!r} is not allowed; use {listed}")


class ClientProtocol(CLIENT_PROTOCOLS.base(), ABC, SingleStep):
    """How a client computes what it sends (FedSGD gradient, FedAvg weight delta, LoRA adapters ...).

    The pipeline calls `prepare(target)` once (LoRA injects its adapters there), resolves the observed
    parameters with `observed_names`, and per batch calls `observe`, which returns the *defended*
    updates: the protocol decides where the defense acts (FedSGD: on the per-sample gradients;
    FedAvg: DP-SGD on every local step, the other defenses on the delta it sends). Step counts for
    the accountant and the exact attacks: `SingleStep` (FedSGD) unless the protocol overrides them.
    """

    name: ClassVar[str]
    mode: str
    samples_per_update: int
    #: The update of m samples is the mean of the m one-sample updates at the global weights (FedSGD):
    #: so the one-sample updates of a fixed pool can be averaged into fresh groupings (hashing is linear).
    update_is_sample_mean: ClassVar[bool] = False

    @classmethod
    def create(cls, name: str, **kwargs) -> "ClientProtocol":
        return CLIENT_PROTOCOLS.create(name, **kwargs)

    def prepare(self, target: nn.Module) -> nn.Module:
        """The global model as the clients train it (default: unchanged)."""
        return target

    def observed_names(self, target: nn.Module, selection: ParameterSelection) -> list[str]:
        """Names of the parameters whose update the server observes."""
        return selection.resolve(target)

    def check_batch(self, batch: ClientBatch, loss: ClientLoss) -> tuple[int, int]:
        """(U, m) of the batch; raises when m is not this client's."""
        updates, per_update = loss.shape(batch)
        if per_update != self.samples_per_update:
            raise ValueError(f"batch has {per_update} samples per update, client expects {self.samples_per_update}")
        return updates, per_update

    def single_sample(self) -> "ClientProtocol":
        """This client with one sample per update: the updates that fresh groupings average (only for a
        client whose update is the mean of its samples' own updates)."""
        raise ValueError(f"{type(self).__name__}'s update is not the mean of its samples' own updates: "
                         "its updates of several samples cannot be averaged from one-sample updates")

    @abstractmethod
    def observe(self, batch: ClientBatch, observation: Observation) -> Tensor:
        """A client batch (fields (U, m, ...)) -> (U, D) defended updates of the observed parameters."""

    def describe(self) -> dict:
        """JSON-safe summary (saved with checkpoints and results)."""
        out = {"name": self.name}
        for key, value in vars(self).items():
            if not key.startswith("_"):
                out[key] = value.describe() if isinstance(value, ClientProtocol) else (list(value) if isinstance(value, tuple) else value)
        return out

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"
