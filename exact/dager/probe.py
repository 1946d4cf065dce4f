"""The second-layer probe of DAGER's sequence search: runs block 1 only.

A candidate sequence passes the second-layer test when the input of the second attention layer at
every position (computed by running the model's first block on the sequence) lies in the span of
that layer's gradient (`l2_threshold`). `SecondLayerProbe` computes those inputs in batches and their
distances; `_ResidualSpan` is the part of the span that some sequences do not explain (the
encoder search's "peeling"); `_PrefixCache` runs the causal prefix search one token per step with
a Hugging Face key/value cache of layer 0.

Multi-step clients (FedAvg) compute their local gradients at weights that drift away from the
global ones, so the second-layer inputs that went into the update are not the ones block 1 gives
at the global weights (1-1.4e-2 off the span in docs/matrix.md, where wrong sequences sit at
3e-2). With a `trajectory` of step offsets s_t, `full` also runs block 1 at w - s_t * g (g: the
update, the mean of the local gradients; s_t = t * lr puts the weights where a straight-line path
puts them before local step t) and keeps, per position, the least distance over the points.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from datamodules.targets.hf import cache_keyword
from exact.dager.span import _TINY, SpanBasis, _orthonormal_complement
from exact.layers import DagerLayers, capture_input


def parameters_before(target: nn.Module, layers: DagerLayers, run) -> list[tuple[str, nn.Parameter]]:
    """The parameters of the modules a forward pass calls before it reaches the second layer's input
    (the only ones the second-layer inputs depend on), found by running `run()` once with hooks."""
    called: list[nn.Module] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: called.append(mod)) for m in target.modules()]
    try:
        capture_input(layers.second_input_module, run)
    finally:
        for hook in hooks:
            hook.remove()
    seen = {id(m) for m in called} | {id(target)}  # the root's own parameters (e.g. positions) are used by `body`
    seen -= {id(m) for m in layers.second_input_module.modules()}  # its pre-hook ran too, before the capture
    return [(f"{prefix}.{name}" if prefix else name, p) for prefix, m in target.named_modules() if id(m) in seen
            for name, p in m.named_parameters(recurse=False)]


@contextmanager
def shifted(pairs: Sequence[tuple[nn.Parameter, Tensor]], step: float) -> Iterator[None]:
    """Parameters moved to p - step * g for the block, then restored bit for bit (from a copy)."""
    saved = [p.detach().clone() for p, _ in pairs]
    try:
        with torch.no_grad():
            for p, g in pairs:
                p.sub_(step * g.to(device=p.device, dtype=p.dtype))
        yield
    finally:
        with torch.no_grad():
            for (p, _), original in zip(pairs, saved):
                p.copy_(original)


class SecondLayerProbe:
    """Second-layer inputs of candidate sequences, and their distances to the second span."""

    def __init__(self, target: nn.Module, layers: DagerLayers, basis: SpanBasis, token_budget: int,
                 update: Mapping[str, Tensor] | None = None, trajectory: Sequence[float] = ()) -> None:
        self.target = target
        self.layers = layers
        self.basis = basis
        self.token_budget = max(1, token_budget)
        self.device = layers.inputs.embedding.device
        self.evaluations = 0  # sequences (or cached steps) run through block 1
        #: step offsets other than 0 at which `full` also runs block 1 (multi-step clients)
        self.trajectory = [float(s) for s in trajectory if s != 0]
        self._moved: list[tuple[nn.Parameter, Tensor]] = []
        if self.trajectory and update is not None:
            probe = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            before = parameters_before(target, layers, lambda: self._forward(probe))
            self._moved = [(p, update[name]) for name, p in before
                           if name in update and tuple(update[name].shape) == tuple(p.shape)]
        if not self._moved:
            self.trajectory = []

    def _forward(self, ids: Tensor) -> None:
        target = self.target
        if hasattr(target, "body"):
            target.body(ids, None)
        else:
            target(input_ids=ids)

    def _run(self, ids: Tensor) -> Tensor:
        return capture_input(self.layers.second_input_module, lambda: self._forward(ids))

    def inputs(self, ids: Tensor) -> Tensor:
        """(N, T) token ids -> (N, T, d) second-layer inputs (float32 as the model computes them)."""
        n, length = ids.shape
        rows = max(1, self.token_budget // max(1, length))
        out = []
        for start in range(0, n, rows):
            part = ids[start : start + rows].to(self.device)
            out.append(self._run(part))
            self.evaluations += part.shape[0]
        return torch.cat(out)

    def full(self, ids: Tensor) -> Tensor:
        """(N, T) token ids -> (N, T) distances of every position's second-layer input (the least over
        the trajectory's points, if any)."""
        distances = self._full(ids)
        for step in self.trajectory:
            with shifted(self._moved, step):
                distances = torch.minimum(distances, self._full(ids))
        return distances

    def _full(self, ids: Tensor) -> Tensor:
        n, length = ids.shape
        rows = max(1, self.token_budget // max(1, length))
        out = []
        for start in range(0, n, rows):
            hidden = self.inputs(ids[start : start + rows])
            out.append(self.basis.distance(hidden.reshape(-1, hidden.shape[-1])).view(hidden.shape[0], length))
        return torch.cat(out).cpu() if out else torch.empty(0, length, dtype=self.basis.u.dtype)

    def second_inputs(self, seqs: list[list[int]]) -> list[Tensor]:
        """Each sequence's second-layer inputs as the columns of a (d, T_s) matrix (the basis's dtype)."""
        out: list[Tensor | None] = [None] * len(seqs)
        by_length: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_length.setdefault(len(s), []).append(i)
        for members in by_length.values():
            ids = torch.tensor([seqs[i] for i in members], dtype=torch.long)
            hidden = self.inputs(ids).to(self.basis.u.dtype)
            for j, i in enumerate(members):
                out[i] = hidden[j].T  # (d, T)
        return out


class _ResidualSpan:
    """The part of the second-layer span not explained by some sequences' second-layer inputs.

    `distance(v)` is the distance of v with those inputs projected out, relative to what is left of
    v, to the projected span; inputs of the known sequences themselves score 1 (nothing new).
    """

    def __init__(self, probe: SecondLayerProbe, sequences: list[list[int]]) -> None:
        basis = probe.basis
        self.u = basis.u  # dtype/device, as SpanBasis
        dtype = basis.u.dtype
        by_length: dict[int, list[list[int]]] = {}
        for s in sequences:
            by_length.setdefault(len(s), []).append(s)
        rows = [probe.inputs(torch.tensor(group, dtype=torch.long)).to(dtype).reshape(-1, basis.dim)
                for group in by_length.values()]
        known = _orthonormal_complement(torch.cat(rows).T.to(basis.u.device), basis.u[:, :0])
        energy = basis.range * basis.singular_values[: basis.rank].to(dtype)
        residual = energy - known @ (known.T @ energy)
        u, s, _ = torch.linalg.svd(residual, full_matrices=False)
        keep = s > 1e-6 * float(s[0]) if s.numel() and float(s[0]) > 0 else torch.zeros(0, dtype=torch.bool)
        self.known, self.span = known, u[:, keep]
        self.rank = int(self.span.shape[1])

    def distance(self, vectors: Tensor) -> Tensor:
        v = vectors.to(self.u.dtype)
        norm = v.norm(dim=-1).clamp_min(_TINY)
        v = v - (v @ self.known) @ self.known.T
        left = v.norm(dim=-1)
        off = (v - (v @ self.span) @ self.span.T).norm(dim=-1)
        return torch.where(left > 1e-6 * norm, off / left.clamp_min(_TINY), torch.ones_like(left))


class _PrefixCache:
    """Causal prefix search with a Hugging Face key/value cache of layer 0 (one new token per step).

    Block 0's keys/values at a position depend only on the prefix, so a surviving prefix's cache is
    reused by all its extensions; a step runs one token per candidate instead of the whole prefix.
    """

    def __init__(self, probe: SecondLayerProbe, base_model: nn.Module) -> None:
        from transformers import DynamicCache

        self.probe = probe
        self.base = base_model
        self.cache_cls = DynamicCache
        self.keys: Tensor | None = None  # (n_prefixes, heads, p, head_dim)
        self.values: Tensor | None = None

    def step(self, parents: Tensor | None, tokens: Tensor, position: int, retain) -> Tensor:
        """Distances at `position` of prefixes[parents] + tokens (one distance per pair).

        Only the layer-0 cache rows of pairs that `retain(start, distances_of_chunk)` returns (local
        indices) are kept, so memory stays bounded by the survivors, not by the pairs tried.
        """
        n = tokens.shape[0]
        rows = max(1, self.probe.token_budget // max(1, position + 1))
        dists, kept, keys, values = [], [], [], []
        for start in range(0, n, rows):
            tok = tokens[start : start + rows].to(self.probe.device)
            if parents is None or self.keys is None:
                cache = self.cache_cls()
            else:
                idx = parents[start : start + rows].to(self.keys.device)
                cache = self.cache_cls(ddp_cache_data=[(self.keys[idx], self.values[idx])])
            pos = torch.full((tok.shape[0], 1), position, dtype=torch.long, device=tok.device)
            hidden = capture_input(
                self.probe.layers.second_input_module,
                lambda: self.base(input_ids=tok[:, None], use_cache=True, position_ids=pos, **{cache_keyword(self.base): cache}),
            )
            dist = self.probe.basis.distance(hidden[:, -1]).cpu()
            local = retain(start, dist)
            layer0 = cache.layers[0]
            keys.append(layer0.keys[local.to(layer0.keys.device)])
            values.append(layer0.values[local.to(layer0.values.device)])
            kept.append(local + start)
            dists.append(dist)
            self.probe.evaluations += tok.shape[0]
        self._retained = (torch.cat(kept), torch.cat(keys), torch.cat(values))
        return torch.cat(dists)

    def keep(self, index: Tensor) -> None:
        """Make the pairs `index` (all retained by the last step) the prefixes of the next step."""
        retained, keys, values = self._retained
        where = torch.searchsorted(retained, index)
        if where.numel() and (where.max() >= retained.numel() or not torch.equal(retained[where], index)):
            raise RuntimeError("a kept prefix was not retained by the cache")
        where = where.to(keys.device)
        self.keys, self.values = keys[where], values[where]
        self._retained = None
