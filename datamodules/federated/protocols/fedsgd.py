"""FedSGD: the client sends one gradient, the mean of its m samples' own gradients."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from datamodules.federated.losses import ClientBatch
from datamodules.federated.protocols.base import ClientProtocol, Observation, check_choice, model_mode


class FedSGDClient(ClientProtocol):
    """A FedSGD client: one gradient step's gradient per update, computed the way a real client does.

    The model runs in `train()` mode (its dropout active) unless `mode="eval"` is chosen explicitly;
    most published numbers used eval mode by accident (Wang & Li). The update is the mean over the
    client's m samples (text: sequences, each with its mean next-token loss; images/tables: labelled
    samples) of each sample's gradient; the defense sees the m per-sample gradients (DP-SGD clips each).
    """

    name = "fedsgd"
    update_is_sample_mean = True

    def __init__(
        self,
        mode: Literal["train", "eval"] = "train",
        samples_per_update: int = 1,
        implementation: Literal["vmap", "loop"] = "vmap",
    ) -> None:
        """
        Args:
            mode: `train` (dropout on, the realistic default) or `eval` (dropout off).
            samples_per_update: Samples m (text: sequences) in one client's minibatch; the update is their mean gradient.
            implementation: `vmap` (fast, batched) or `loop` (reference, one sample at a time).
        """
        check_choice("mode", mode, ("train", "eval"))
        if samples_per_update < 1:
            raise ValueError(f"samples_per_update={samples_per_update} must be >= 1")
        check_choice("implementation", implementation, ("vmap", "loop"))
        self.mode = mode
        self.samples_per_update = samples_per_update
        self.implementation = implementation

    def single_sample(self) -> "FedSGDClient":
        return FedSGDClient(self.mode, 1, self.implementation)

    def per_example_gradients(self, batch: ClientBatch, observation: Observation) -> Tensor:
        """(U, m, D) per-sample gradients at the global weights."""
        self.check_batch(batch, observation.loss)
        target = observation.target
        with model_mode(target, self.mode), torch.enable_grad():
            return observation.loss.per_example_gradients(target, observation.names, batch, self.implementation)

    def observe(self, batch: ClientBatch, observation: Observation) -> Tensor:
        per_example = self.per_example_gradients(batch, observation)
        observation.check(per_example)
        with torch.no_grad():
            return observation.defense(per_example, observation.generator)

    def __repr__(self) -> str:
        return f"FedSGDClient(mode={self.mode!r}, samples_per_update={self.samples_per_update})"
