"""Per-sequence gradients of the next-token loss, the raw material of every client update.

Implementations that must agree (tests compare them):

* `per_example_gradients_loop`: the obvious reference, one forward/backward per sequence.
* `per_example_gradients`: the fast path. For `Transformer3` it dispatches to the specialised engine
  in `datamodules.federated.transformer3_grads` (one batched forward/backward with the shared
  weights, per-sequence weight gradients from saved layer inputs and output gradients); every other
  target uses `per_example_gradients_vmap`.
* `per_example_gradients_vmap`: the generic fast path. The vocabulary projection (the head) dominates
  the cost and its weight is never observed by default, so it runs once, batched, with its weight detached;
  only the small body is differentiated per sequence, by `torch.func.vmap` over per-sequence copies of
  the observed parameters. One forward and one backward in total.

All return a flat (N, D) tensor: sequence n's gradient of its own mean loss, observed parameters
concatenated in the given order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from datamodules.federated.transformer3_grads import transformer3_per_example_gradients
from lti.targets.base import TargetLM, next_token_loss
from lti.targets.transformer3 import Transformer3


class _BodyThenHead(nn.Module):
    """Lets `functional_call` run `body` and `head` of a target with substituted parameters."""

    def __init__(self, target: TargetLM) -> None:
        super().__init__()
        self.target = target

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, part: str) -> Tensor:
        if part == "body":
            return self.target.body(input_ids, attention_mask)
        return self.target.head(input_ids)  # here `input_ids` carries hidden states


def per_example_gradients_loop(
    target: TargetLM, names: Sequence[str], input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """Reference: a plain autograd loop over sequences. Returns (N, D)."""
    # Fresh leaves that share storage with the model: independent of its requires_grad flags.
    params = {name: p.detach().requires_grad_(name in names) for name, p in target.named_parameters()}
    observed = [params[name] for name in names]
    rows = []
    for n in range(input_ids.shape[0]):
        mask = None if attention_mask is None else attention_mask[n : n + 1]
        logits = functional_call(target, params, (input_ids[n : n + 1], mask))
        loss = next_token_loss(logits, input_ids[n : n + 1], mask).sum()
        grads = torch.autograd.grad(loss, observed, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, observed)]))
    return torch.stack(rows)


def per_example_gradients(
    target: TargetLM, names: Sequence[str], input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """Fast path (see module docstring): the Transformer3 engine for Transformer3, else vmap."""
    if isinstance(target, Transformer3):
        return transformer3_per_example_gradients(target, names, input_ids, attention_mask)
    return per_example_gradients_vmap(target, names, input_ids, attention_mask)


def per_example_gradients_vmap(
    target: TargetLM, names: Sequence[str], input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """Generic fast path (see module docstring). Falls back to the loop when a head parameter is observed."""
    head_names = target.head_parameter_names
    if head_names & set(names):
        return per_example_gradients_loop(target, names, input_ids, attention_mask)
    wrapper = _BodyThenHead(target)
    num = input_ids.shape[0]
    # Every parameter and buffer detached: the body overrides the observed ones with per-sequence
    # copies; the batched head uses them as they are, so it computes no V x d weight gradient.
    detached = {f"target.{name}": p.detach() for name, p in target.named_parameters()}
    detached.update({f"target.{name}": b for name, b in target.named_buffers()})
    # One copy of every observed parameter per sequence: sequence n only touches copy n, so the
    # gradient of the summed loss w.r.t. copy n is sequence n's own gradient. The copies are
    # stride-0 expansions (no memory); their gradients come back full-size.
    copies = {
        f"target.{name}": detached[f"target.{name}"].expand(num, *detached[f"target.{name}"].shape).requires_grad_(True)
        for name in names
    }

    def body_one(own: dict[str, Tensor], ids: Tensor, mask: Tensor | None) -> Tensor:
        mask = None if mask is None else mask.unsqueeze(0)
        return functional_call(wrapper, {**detached, **own}, (ids.unsqueeze(0), mask, "body")).squeeze(0)

    mask_dim = None if attention_mask is None else 0
    hidden = vmap(body_one, in_dims=(0, 0, mask_dim), randomness="different")(copies, input_ids, attention_mask)
    # The last position predicts nothing: skip its (V-wide) head computation.
    logits = functional_call(wrapper, detached, (hidden[:, :-1], None, "head"))
    loss = next_token_loss(logits, input_ids, attention_mask).sum()
    grads = torch.autograd.grad(loss, list(copies.values()), allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(c) if g is None else g).reshape(num, -1) for g, c in zip(grads, copies.values())], dim=1
    )


class FedSGDClient:
    """A FedSGD client: one gradient step's gradient per update, computed the way a real client does.

    The model runs in `train()` mode (its dropout active) unless `mode="eval"` is chosen explicitly;
    most published numbers used eval mode by accident (Wang & Li).
    """

    def __init__(
        self,
        mode: Literal["train", "eval"] = "train",
        sequences_per_update: int = 1,
        implementation: Literal["vmap", "loop"] = "vmap",
    ) -> None:
        """
        Args:
            mode: `train` (dropout on, the realistic default) or `eval` (dropout off).
            sequences_per_update: Sequences in one client's minibatch; the update is their mean gradient.
            implementation: `vmap` (fast, batched head) or `loop` (reference, one sequence at a time).
        """
        if mode not in ("train", "eval"):
            raise ValueError(f"client mode {mode!r} is not allowed; use 'train' or 'eval'")
        if sequences_per_update < 1:
            raise ValueError(f"sequences_per_update={sequences_per_update} must be >= 1")
        if implementation not in ("vmap", "loop"):
            raise ValueError(f"client implementation {implementation!r} is not allowed; use 'vmap' or 'loop'")
        self.mode = mode
        self.sequences_per_update = sequences_per_update
        self.implementation = implementation

    def per_example_gradients(
        self, target: TargetLM, names: Sequence[str], input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        """(U, m, L) token ids -> (U, m, D) per-sequence gradients (m = sequences per update)."""
        updates, per_update, length = input_ids.shape
        if per_update != self.sequences_per_update:
            raise ValueError(f"batch has {per_update} sequences per update, client expects {self.sequences_per_update}")
        flat_ids = input_ids.reshape(-1, length)
        flat_mask = None if attention_mask is None else attention_mask.reshape(-1, length)
        was_training = target.training
        target.train(self.mode == "train")
        try:
            with torch.enable_grad():
                fn = per_example_gradients if self.implementation == "vmap" else per_example_gradients_loop
                grads = fn(target, names, flat_ids, flat_mask)
        finally:
            target.train(was_training)
        return grads.view(updates, per_update, -1)

    def __repr__(self) -> str:
        return f"FedSGDClient(mode={self.mode!r}, sequences_per_update={self.sequences_per_update})"
