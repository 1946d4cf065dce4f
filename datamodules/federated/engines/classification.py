"""Gradient engines of the classification loss (image and table clients). No Lightning.

The same contracts as the next-token engines (`engines.next_token`), for a model that maps a batch
of inputs (B, *input_shape) to class logits:

* `per_sample_gradients_loop` (reference, one forward/backward per sample) and
  `per_sample_gradients` (fast path, `torch.func.vmap(grad(...))` over the samples): (N, D), sample
  n's gradient of its own cross-entropy.
* `group_gradients` (G, D): G independent model copies, copy i at its own flat weights `weights[i]`
  (None: the global weights), each on its own group of samples: the gradient of the group's mean
  loss. One `vmap` over the copies of `grad` of the minibatch loss: what a FedAvg step needs.
  Reference: `group_gradients_loop`.
* `grouped_per_example_gradients` (G, g, D): every sample's own gradient at its group's weights (a
  nested vmap), for DP-SGD clipping at every local step.

Parameters not in `names` stay at their global values; gradients are concatenated in the order of
`names`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from datamodules.federated.engines.attention import vmap_safe_attention


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

    with vmap_safe_attention(inputs.device):  # encoders attend; forward and backward both run inside
        grads = vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="different")(observed, inputs, labels)
    return torch.cat([grads[name].reshape(inputs.shape[0], -1) for name in names], dim=1)


class _FlatModel:
    """The target with the parameters `names` read from one flat vector (the layout FedAvg trains)."""

    def __init__(self, target: nn.Module, names: Sequence[str]) -> None:
        params = {name: p.detach() for name, p in target.named_parameters()}
        self.target = target
        self.shapes = [(name, params[name].shape) for name in names]
        self.frozen = {name: p for name, p in params.items() if name not in set(names)}
        self.frozen.update(dict(target.named_buffers()))
        self.params = params
        self.dim = sum(shape.numel() for _, shape in self.shapes)

    def weights(self, weights: Tensor | None, groups: int) -> Tensor:
        """(G, D) weights: the given rows, or the global weights (a stride-0 expansion; flattened
        only when asked for: FedAvg passes its own weights at every step but the first)."""
        if weights is None:
            return torch.cat([self.params[name].reshape(-1) for name, _ in self.shapes]).expand(groups, -1)
        if weights.shape[1] != self.dim:
            raise ValueError(f"weights have {weights.shape[1]} columns, the parameters need {self.dim}")
        return weights

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        out, offset = {}, 0
        for name, shape in self.shapes:
            size = shape.numel()
            out[name] = flat[offset : offset + size].view(shape)
            offset += size
        return out

    def loss(self, flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """Mean loss of a minibatch x (b, ...) with labels (b,) at flat weights (D,)."""
        return classification_loss(functional_call(self.target, {**self.frozen, **self.unflatten(flat)}, (x,)), y)

    def sample_loss(self, flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
        return self.loss(flat, x.unsqueeze(0), y.unsqueeze(0))


def group_gradients(
    target: nn.Module, names: Sequence[str], inputs: Tensor, labels: Tensor, weights: Tensor | None = None
) -> Tensor:
    """(G, g, ...) inputs and (G, g) labels -> (G, D): group i's mean-loss gradient at `weights[i]`."""
    model = _FlatModel(target, names)
    per_group = vmap(grad(model.loss), in_dims=(0, 0, 0), randomness="different")
    with vmap_safe_attention(inputs.device):
        return per_group(model.weights(weights, inputs.shape[0]), inputs, labels)


def grouped_per_example_gradients(
    target: nn.Module, names: Sequence[str], inputs: Tensor, labels: Tensor, weights: Tensor | None = None
) -> Tensor:
    """(G, g, ...) inputs and (G, g) labels -> (G, g, D): every sample's own gradient at its group's weights."""
    model = _FlatModel(target, names)
    per_sample = vmap(vmap(grad(model.sample_loss), in_dims=(None, 0, 0)), in_dims=(0, 0, 0), randomness="different")
    with vmap_safe_attention(inputs.device):
        return per_sample(model.weights(weights, inputs.shape[0]), inputs, labels)


def group_gradients_loop(
    target: nn.Module, names: Sequence[str], inputs: Tensor, labels: Tensor, weights: Tensor | None = None
) -> Tensor:
    """Reference for `group_gradients`: one forward/backward per sample. Returns (G, D)."""
    model = _FlatModel(target, names)
    groups, size = labels.shape
    rows = []
    for g, flat in enumerate(model.weights(weights, groups)):
        flat = flat.detach().requires_grad_(True)
        total = sum(model.sample_loss(flat, inputs[g, s], labels[g, s]) for s in range(size))
        rows.append(torch.autograd.grad(total / size, flat)[0])
    return torch.stack(rows)
