"""Gradient engines of the next-token loss (text clients): the raw material of every text client update.

Implementations that must agree (tests compare them):

* `per_example_gradients_loop`: the obvious reference, one forward/backward per sequence.
* `per_example_gradients`: the fast path. For `Transformer3` it dispatches to the specialised engine
  in `datamodules.federated.engines.transformer3` (one batched forward/backward with the shared
  weights, per-sequence weight gradients from saved layer inputs and output gradients); every other
  target uses `per_example_gradients_vmap`.
* `per_example_gradients_vmap`: the generic fast path. The vocabulary projection (the head) dominates
  the cost and its weight is never observed by default, so it runs once, batched, with its weight detached;
  only the small body is differentiated per sequence, by `torch.func.vmap` over per-sequence copies of
  the observed parameters. One forward and one backward in total.

All return a flat (N, D) tensor: sequence n's gradient of its own mean loss, observed parameters
concatenated in the given order.

Multi-step clients (FedAvg) need gradients of G clients, each at its *own* local weights:
`group_gradients` (group means; reference `group_gradients_loop`, generic fast path
`group_gradients_vmap`, Transformer3 engine with per-group weights) and
`grouped_per_example_gradients` (per-sequence, for DP-SGD clipping at every local step).

The client protocols (`datamodules.federated.protocols`) reach these through `NextTokenLoss`
(`datamodules.federated.losses`), the same way they reach the image/table engines.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from datamodules.federated.engines.attention import vmap_safe_attention
from datamodules.federated.engines.transformer3 import engine_supports, transformer3_per_example_gradients
from datamodules.targets.base import TargetLM, next_token_loss
from datamodules.targets.transformer3 import Transformer3


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
    """Fast path (see module docstring): the Transformer3 engine for Transformer3, else vmap.

    A Transformer3 whose layers were changed (e.g. LoRA adapters injected by peft) is not what the
    engine re-implements, so it takes the generic path.
    """
    if isinstance(target, Transformer3) and engine_supports(target):
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
    with vmap_safe_attention(input_ids.device):  # the backward below replays the kernel chosen here
        hidden = vmap(body_one, in_dims=(0, 0, mask_dim), randomness="different")(copies, input_ids, attention_mask)
    # The last position predicts nothing: skip its (V-wide) head computation.
    logits = functional_call(wrapper, detached, (hidden[:, :-1], None, "head"))
    loss = next_token_loss(logits, input_ids, attention_mask).sum()
    grads = torch.autograd.grad(loss, list(copies.values()), allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(c) if g is None else g).reshape(num, -1) for g, c in zip(grads, copies.values())], dim=1
    )


def _group_params(
    target: TargetLM, names: Sequence[str], groups: int, weights: Tensor | None
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(every parameter and buffer detached, one leaf copy per group of every observed parameter).

    Without `weights` the copies are stride-0 expansions of the global values (no memory); with
    `weights` (G, D) group g's copy holds row g, laid out as the concatenation of `names`.
    """
    detached = {name: p.detach() for name, p in target.named_parameters()}
    detached.update(dict(target.named_buffers()))
    copies, start = {}, 0
    for name in names:
        shape = detached[name].shape
        if weights is None:
            copy = detached[name].expand(groups, *shape)
        else:
            size = detached[name].numel()
            copy = weights[:, start : start + size].reshape(groups, *shape)
            start += size
        copies[name] = copy.detach().requires_grad_(True)
    if weights is not None and start != weights.shape[1]:
        raise ValueError(f"weights have {weights.shape[1]} columns, the parameters {len(names)} names need {start}")
    return detached, copies


def group_gradients_loop(
    target: TargetLM,
    names: Sequence[str],
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Reference for `group_gradients`: one forward/backward per sequence. Returns (G, D)."""
    groups, size, _ = input_ids.shape
    rows = []
    for g in range(groups):
        detached, copies = _group_params(target, names, 1, None if weights is None else weights[g : g + 1])
        params = {**detached, **{name: c[0] for name, c in copies.items()}}
        total = 0.0
        for s in range(size):
            mask = None if attention_mask is None else attention_mask[g, s : s + 1]
            logits = functional_call(target, params, (input_ids[g, s : s + 1], mask))
            total = total + next_token_loss(logits, input_ids[g, s : s + 1], mask).sum()
        grads = torch.autograd.grad(total / size, list(copies.values()), allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(c) if d is None else d).reshape(-1) for d, c in zip(grads, copies.values())]))
    return torch.stack(rows)


def _engine_applies(target: TargetLM, names: Sequence[str]) -> bool:
    """The Transformer3 engine can compute these gradients (stock layers, no head parameter)."""
    return isinstance(target, Transformer3) and engine_supports(target) and not target.head_parameter_names & set(names)


def grouped_per_example_gradients(
    target: TargetLM,
    names: Sequence[str],
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """(G, g, L) groups -> (G, g, D): every sequence's own gradient at its group's weights.

    `weights` (G, D) as in `group_gradients` (None: the global values, the FedSGD fast path).
    What DP-SGD needs at every FedAvg step: per-sequence gradients of clients at their local weights.
    """
    groups, size, length = input_ids.shape
    flat_ids = input_ids.reshape(-1, length)
    flat_mask = None if attention_mask is None else attention_mask.reshape(-1, length)
    if weights is None:
        return per_example_gradients(target, names, flat_ids, flat_mask).view(groups, size, -1)
    if _engine_applies(target, names):
        return transformer3_per_example_gradients(target, names, flat_ids, flat_mask, weights=weights).view(groups, size, -1)
    # vmap: one parameter copy per sequence (its group's row, repeated).
    mask = None if flat_mask is None else flat_mask.unsqueeze(1)
    rows = weights.repeat_interleave(size, dim=0)
    return group_gradients_vmap(target, names, flat_ids.unsqueeze(1), mask, rows).view(groups, size, -1)


def group_gradients(
    target: TargetLM,
    names: Sequence[str],
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Gradients of G independent model copies, each on its own group of sequences. Returns (G, D).

    See `group_gradients_vmap` for the contract. A stock `Transformer3` takes its engine (per-group
    weights, per-sequence gradients, then the group mean), and so do the global weights (the FedSGD
    fast path); everything else the group vmap, which never materialises per-sequence gradients.
    """
    if weights is None or _engine_applies(target, names):
        per_seq = grouped_per_example_gradients(target, names, input_ids, attention_mask, weights)
        return per_seq[:, 0] if per_seq.shape[1] == 1 else per_seq.mean(dim=1)
    return group_gradients_vmap(target, names, input_ids, attention_mask, weights)


def group_gradients_vmap(
    target: TargetLM,
    names: Sequence[str],
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Gradients of G independent model copies, each on its own group of sequences. Returns (G, D).

    `input_ids` is (G, g, L). Row i is the gradient of the mean over group i's g sequences of their
    mean next-token losses, with respect to group i's own values of the parameters `names`
    (`weights[i]`, flat in the order of `names`; None = the global values). Every other parameter
    stays at its global value. This is what a FedAvg step needs: G clients, each at its own local
    weights, each on its own minibatch (g = 1 gives per-sequence gradients, e.g. for DP-SGD
    clipping). Same vmap scheme as `per_example_gradients_vmap` (batched head with detached
    weights, vmap over the body), with a group of sequences per copy instead of one.
    """
    if target.head_parameter_names & set(names):
        return group_gradients_loop(target, names, input_ids, attention_mask, weights)
    groups, size, length = input_ids.shape
    wrapper = _BodyThenHead(target)
    detached, copies = _group_params(target, names, groups, weights)
    detached = {f"target.{name}": t for name, t in detached.items()}
    own = {f"target.{name}": c for name, c in copies.items()}

    def body_group(own: dict[str, Tensor], ids: Tensor, mask: Tensor | None) -> Tensor:
        return functional_call(wrapper, {**detached, **own}, (ids, mask, "body"))

    mask_dim = None if attention_mask is None else 0
    with vmap_safe_attention(input_ids.device):
        hidden = vmap(body_group, in_dims=(0, 0, mask_dim), randomness="different")(own, input_ids, attention_mask)
    flat_ids = input_ids.reshape(groups * size, length)
    flat_mask = None if attention_mask is None else attention_mask.reshape(groups * size, length)
    logits = functional_call(wrapper, detached, (hidden[:, :, :-1].reshape(groups * size, length - 1, -1), None, "head"))
    loss = next_token_loss(logits, flat_ids, flat_mask).view(groups, size).mean(dim=1).sum()
    grads = torch.autograd.grad(loss, list(copies.values()), allow_unused=True)
    return torch.cat(
        [(torch.zeros_like(c) if d is None else d).reshape(groups, -1) for d, c in zip(grads, copies.values())], dim=1
    )
