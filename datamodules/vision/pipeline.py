"""Image/table batch -> client update -> defense -> hashed features, for vision targets. No Lightning.

The client's update is the FedSGD gradient of the cross-entropy classification loss on its own m
labelled samples (the mean of the m per-sample gradients). Per-sample gradients come from
`torch.func.vmap(grad(...))` over the batch (`per_sample_gradients`) and are tested against a plain
autograd loop (`per_sample_gradients_loop`). Defenses (`DEFENSES`) and mmh3 hashing
(`FeatureHasher`/`HashSpec`) are the text path's, unchanged; `VisionUpdatePipeline` composes them
with the same interface as the text `UpdatePipeline` (`.target`, `.spec`, `.names`, `.split(update)`,
`forward(...) -> ObservedUpdates`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from datamodules.federated.defenses import Defense, NoDefense
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.pipeline import HashedObservation, ObservedUpdates
from lti.targets.vision import VisionTarget


def classification_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of a (B, classes) batch against (B,) labels."""
    return nn.functional.cross_entropy(logits, labels)


def per_sample_gradients_loop(target: nn.Module, names: Sequence[str], inputs: Tensor, labels: Tensor) -> Tensor:
    """Reference: one forward/backward per sample. (N, ...) inputs, (N,) labels -> (N, D)."""
    params = {name: p.detach().requires_grad_(name in names) for name, p in target.named_parameters()}
    buffers = dict(target.named_buffers())
    observed = [params[name] for name in names]
    rows = []
    for n in range(inputs.shape[0]):
        logits = functional_call(target, {**params, **buffers}, (inputs[n : n + 1],))
        grads = torch.autograd.grad(classification_loss(logits, labels[n : n + 1]), observed, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, observed)]))
    return torch.stack(rows)


def per_sample_gradients(target: nn.Module, names: Sequence[str], inputs: Tensor, labels: Tensor) -> Tensor:
    """Fast path: `vmap(grad(loss))` over the samples. (N, ...) inputs, (N,) labels -> (N, D)."""
    frozen = {name: p.detach() for name, p in target.named_parameters() if name not in names}
    frozen.update(dict(target.named_buffers()))
    observed = {name: dict(target.named_parameters())[name].detach() for name in names}

    def loss_one(own: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(target, {**frozen, **own}, (x.unsqueeze(0),))
        return classification_loss(logits, y.unsqueeze(0))

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="different")(observed, inputs, labels)
    return torch.cat([grads[name].reshape(inputs.shape[0], -1) for name in names], dim=1)


class VisionClient:
    """A FedSGD client of an image/table classifier: the update is its mean cross-entropy gradient over m samples."""

    def __init__(
        self,
        samples_per_update: int = 1,
        mode: Literal["train", "eval"] = "train",
        implementation: Literal["vmap", "loop"] = "vmap",
    ) -> None:
        """
        Args:
            samples_per_update: Labelled samples m in one client's minibatch; the update is their mean gradient.
            mode: `train` or `eval` mode of the target while computing (FCNN and LeNet behave the same).
            implementation: `vmap` (batched) or `loop` (reference, one sample at a time).
        """
        if samples_per_update < 1:
            raise ValueError(f"samples_per_update={samples_per_update} must be >= 1")
        if mode not in ("train", "eval"):
            raise ValueError(f"client mode {mode!r} is not allowed; use 'train' or 'eval'")
        if implementation not in ("vmap", "loop"):
            raise ValueError(f"client implementation {implementation!r} is not allowed; use 'vmap' or 'loop'")
        self.samples_per_update, self.mode, self.implementation = samples_per_update, mode, implementation

    @property
    def sequences_per_update(self) -> int:  # the text client's name, for code that reads either
        return self.samples_per_update

    def per_example_gradients(self, target: nn.Module, names: Sequence[str], inputs: Tensor, labels: Tensor) -> Tensor:
        """(U, m, *input_shape) inputs and (U, m) labels -> (U, m, D) per-sample gradients."""
        updates, per_update = inputs.shape[:2]
        if per_update != self.samples_per_update:
            raise ValueError(f"batch has {per_update} samples per update, client expects {self.samples_per_update}")
        if tuple(labels.shape) != (updates, per_update):
            raise ValueError(f"labels must be (updates, samples) = {(updates, per_update)}, got {tuple(labels.shape)}")
        flat = inputs.reshape(updates * per_update, *inputs.shape[2:])
        was_training = target.training
        target.train(self.mode == "train")
        try:
            with torch.enable_grad():
                fn = per_sample_gradients if self.implementation == "vmap" else per_sample_gradients_loop
                grads = fn(target, names, flat, labels.reshape(-1))
        finally:
            target.train(was_training)
        return grads.view(updates, per_update, -1)

    def __repr__(self) -> str:
        return f"VisionClient(samples_per_update={self.samples_per_update}, mode={self.mode!r})"


class VisionUpdatePipeline(HashedObservation):
    """(U, m, *input_shape) inputs + (U, m) labels -> defended updates -> hashed features (`ObservedUpdates`).

    The same interface as the text `UpdatePipeline` (`.target`, `.names`, `.spec`, `.hasher`,
    `.defense`, `.observed_dim`, `.split(update)`), composed from the same pieces: `ParameterSelection`
    by name, a `Defense` from `DEFENSES` on the per-sample gradients, `FeatureHasher`/`HashSpec` (mmh3).
    """

    def __init__(
        self,
        target: VisionTarget,
        client: VisionClient | None = None,
        defense: Defense | None = None,
        observed: ParameterSelection | None = None,
        hash_fraction: float | None = 0.1,
        hash_bins: int | None = None,
        hash_seed: int = 0,
        hash_signed: bool = False,
    ) -> None:
        super().__init__()
        self.target = target
        self.client = client or VisionClient()
        self.defense = defense or NoDefense()
        self.observed = observed or ParameterSelection()
        self.names = self.observed.resolve(target)
        self._bind_hashing(target, hash_fraction, hash_bins, hash_seed, hash_signed)

    def forward(
        self,
        inputs: Tensor,
        labels: Tensor,
        keep_update: bool = False,
        generator: torch.Generator | None = None,
    ) -> ObservedUpdates:
        """(U, m, *input_shape) inputs with (U, m) labels of U client updates -> what the server observes."""
        shape = tuple(getattr(self.target, "input_shape", inputs.shape[2:]))
        if inputs.dim() != 2 + len(shape) or tuple(inputs.shape[2:]) != shape:
            raise ValueError(f"inputs must be (updates, samples, {', '.join(map(str, shape))}), got {tuple(inputs.shape)}")
        # Gradients are needed even under Lightning's inference mode (validation): leave it, and
        # copy the batch so it is not an inference tensor.
        with torch.inference_mode(False), torch.enable_grad():
            inputs, labels = inputs.clone(), labels.clone()
            per_example = self.client.per_example_gradients(self.target, self.names, inputs, labels)
            if not torch.isfinite(per_example.sum()) and not torch.isfinite(per_example).all():
                bad = self._first_nonfinite_parameter(per_example)
                raise FloatingPointError(f"non-finite client update (nan/inf) in parameter {bad!r}; check the target model and data")
            with torch.no_grad():
                update = self.defense(per_example, generator)
                features = self.hasher(update)
        return ObservedUpdates(features=features, update=update if keep_update else None)

    def _first_nonfinite_parameter(self, per_example: Tensor) -> str:
        for name, values in self.split(per_example.flatten(0, 1)).items():
            if not torch.isfinite(values).all():
                return name
        return self.names[0]


__all__ = [
    "VisionClient", "VisionUpdatePipeline", "per_sample_gradients", "per_sample_gradients_loop", "classification_loss",
]
