"""Image/table batch -> client update -> defense -> hashed features, for vision targets. No Lightning.

The client's update is the FedSGD gradient of the cross-entropy classification loss on its own m
labelled samples (the mean of the m per-sample gradients), or with `VisionFedAvgClient` the weight
delta of E local epochs of minibatch SGD on them. Per-sample gradients come from
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

from datamodules.federated.client import FiniteCheck, model_mode
from datamodules.federated.defenses import Defense, NoDefense
from datamodules.federated.local_sgd import LocalSGD, SingleStep
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.pipeline import HashedObservation, ObservedUpdates
from datamodules.targets.vision import VisionTarget


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


class VisionClient(SingleStep):
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

    def _check_batch(self, inputs: Tensor, labels: Tensor) -> tuple[int, int]:
        """(U, m) of a batch of (U, m, ...) inputs with (U, m) labels; raises when m is not the client's."""
        updates, per_update = inputs.shape[:2]
        if per_update != self.samples_per_update:
            raise ValueError(f"batch has {per_update} samples per update, client expects {self.samples_per_update}")
        if tuple(labels.shape) != (updates, per_update):
            raise ValueError(f"labels must be (updates, samples) = {(updates, per_update)}, got {tuple(labels.shape)}")
        return updates, per_update

    def per_example_gradients(self, target: nn.Module, names: Sequence[str], inputs: Tensor, labels: Tensor) -> Tensor:
        """(U, m, *input_shape) inputs and (U, m) labels -> (U, m, D) per-sample gradients."""
        updates, per_update = self._check_batch(inputs, labels)
        flat = inputs.reshape(updates * per_update, *inputs.shape[2:])
        with model_mode(target, self.mode), torch.enable_grad():
            fn = per_sample_gradients if self.implementation == "vmap" else per_sample_gradients_loop
            grads = fn(target, names, flat, labels.reshape(-1))
        return grads.view(updates, per_update, -1)

    def observe(
        self,
        target: nn.Module,
        names: Sequence[str],
        inputs: Tensor,
        labels: Tensor,
        defense: Defense | None = None,
        generator: torch.Generator | None = None,
        check: FiniteCheck | None = None,
    ) -> Tensor:
        """(U, m, *input_shape) inputs, (U, m) labels -> (U, D) defended updates (the defense sees
        the m per-sample gradients; DP-SGD clips each)."""
        per_example = self.per_example_gradients(target, names, inputs, labels)
        if check is not None:
            check(per_example)
        with torch.no_grad():
            return (defense or NoDefense())(per_example, generator)

    def __repr__(self) -> str:
        return f"VisionClient(samples_per_update={self.samples_per_update}, mode={self.mode!r})"


class VisionFedAvgClient(LocalSGD, VisionClient):
    """FedAvg for image/table classifiers: E local epochs of minibatch SGD on the client's m samples;
    sends w_start - w_end of the observed parameters (`LocalSGD`, as the text `FedAvgClient`).

    Defenses as for text FedAvg: DP-SGD clips and noises every sample's gradient at every local step,
    the others act on the delta. All U clients step in lock-step, each with its own flat copy of the
    trained parameters: one `vmap` over clients of `grad` of the minibatch loss (per-sample gradients,
    a nested vmap, only when DP-SGD needs them).

    `dtype` sets the arithmetic of the local training. float32 is what clients run; its delta loses
    digits to cancellation (|w| is much larger than |lr x g|: with lr = 0.01 a float32 delta keeps
    only about 3 significant digits), which is enough to stop exact attacks that need exact zeros
    (SPEAR). float64 gives the delta of exact arithmetic (the attack's best case).
    """

    def __init__(
        self,
        samples_per_update: int = 4,
        local_epochs: int = 1,
        minibatch_size: int = 2,
        lr: float = 0.01,
        momentum: float = 0.0,
        shuffle: bool = True,
        trainable: list[str] | None = None,
        mode: Literal["train", "eval"] = "train",
        dtype: Literal["float32", "float64"] = "float32",
    ) -> None:
        """
        Args:
            samples_per_update: n, the client's labelled samples (one update = one client's round).
            local_epochs: E, passes over the n samples.
            minibatch_size: B, samples per local step (the last minibatch of an epoch may be smaller).
            lr: Local SGD learning rate eta.
            momentum: Heavy-ball momentum as `torch.optim.SGD` (0: plain SGD).
            shuffle: Reshuffle the n samples every epoch (per client); False keeps their order.
            trainable: fnmatch patterns of parameters trained locally besides the observed ones (None:
                exactly the observed parameters).
            mode: `train` or `eval` mode of the target while training locally.
            dtype: Arithmetic of the local training: `float32` (real clients) or `float64` (exact deltas).
        """
        super().__init__(samples_per_update, mode=mode)
        if dtype not in ("float32", "float64"):
            raise ValueError(f"client dtype {dtype!r} is not allowed; use 'float32' or 'float64'")
        self._init_local_sgd(("samples_per_update", samples_per_update), local_epochs, minibatch_size, lr, momentum, shuffle, trainable)
        self.dtype = dtype

    def observe(
        self,
        target: nn.Module,
        names: Sequence[str],
        inputs: Tensor,
        labels: Tensor,
        defense: Defense | None = None,
        generator: torch.Generator | None = None,
        check: FiniteCheck | None = None,
    ) -> Tensor:
        defense = defense or NoDefense()
        updates, _ = self._check_batch(inputs, labels)
        dtype = getattr(torch, self.dtype)
        params = {name: p.detach().to(dtype) for name, p in target.named_parameters()}
        trained = self.trained_names(target, names)
        frozen = {name: p for name, p in params.items() if name not in trained}
        frozen.update({name: b.to(dtype) if b.is_floating_point() else b for name, b in target.named_buffers()})
        shapes = [(name, params[name].shape) for name in trained]
        observed_dim = sum(params[name].numel() for name in names)
        start = torch.cat([params[name].reshape(-1) for name in trained]).expand(updates, -1)
        inputs = inputs.to(dtype)

        def unflatten(flat: Tensor) -> dict[str, Tensor]:  # (D,) -> {name: tensor}
            out, offset = {}, 0
            for name, shape in shapes:
                size = shape.numel()
                out[name] = flat[offset : offset + size].view(shape)
                offset += size
            return out

        def minibatch_loss(flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
            return classification_loss(functional_call(target, {**frozen, **unflatten(flat)}, (x,)), y)

        def sample_loss(flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
            return minibatch_loss(flat, x.unsqueeze(0), y.unsqueeze(0))

        per_sample = vmap(vmap(grad(sample_loss), in_dims=(None, 0, 0)), in_dims=(0, 0, 0), randomness="different")
        per_batch = vmap(grad(minibatch_loss), in_dims=(0, 0, 0), randomness="different")

        def step_gradient(index: Tensor, weights: Tensor | None) -> Tensor:
            weights = start if weights is None else weights
            x = inputs.gather(1, index.view(*index.shape, *[1] * (inputs.dim() - 2)).expand(-1, -1, *inputs.shape[2:]))
            y = labels.gather(1, index)
            if not defense.acts_per_step:
                gradient = per_batch(weights, x, y)
                if check is not None:
                    check(gradient)
                return gradient
            per_example = per_sample(weights, x, y)
            if check is not None:
                check(per_example)
            with torch.no_grad():
                return defense.local_step(per_example, generator)

        with model_mode(target, self.mode), torch.enable_grad():
            delta = self.train_locally(start, observed_dim, step_gradient, generator)
        with torch.no_grad():
            return defense.on_delta(delta.to(torch.get_default_dtype()), generator)

    def __repr__(self) -> str:
        return (f"VisionFedAvgClient(samples_per_update={self.samples_per_update}, local_epochs={self.local_epochs}, "
                f"minibatch_size={self.minibatch_size}, lr={self.lr}, momentum={self.momentum}, mode={self.mode!r}, "
                f"dtype={self.dtype!r})")


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
            update = self.client.observe(self.target, self.names, inputs, labels, self.defense, generator, self._check_finite)
            with torch.no_grad():
                features = self.hasher(update)
        return ObservedUpdates(features=features, update=update if keep_update else None)


__all__ = [
    "VisionClient", "VisionFedAvgClient", "VisionUpdatePipeline", "per_sample_gradients", "per_sample_gradients_loop", "classification_loss",
]
