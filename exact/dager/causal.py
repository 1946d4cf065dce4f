"""DAGER step 3 for causal (decoder) models: the prefix search.

Extend every surviving prefix by every candidate of the next position and keep the extensions whose
second-layer input (running block 1 only, with a key/value cache for Hugging Face decoders) lies in
the span of the second attention layer's gradient (`l2_threshold`). RoPE models have position-free
first-layer inputs: one unordered candidate set feeds every position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from exact.dager.options import CausalOptions
from exact.dager.probe import SecondLayerProbe, _PrefixCache


def causal_search(
    probe: SecondLayerProbe, candidates: list[Tensor], steps: int, options: CausalOptions, l2_threshold: float,
    flags: list[str], beam: int | None = None, prior: list[Tensor] | None = None,
) -> tuple[list[list[int]], list[float]]:
    """Prefix extension over at most `steps` positions. Returns (sequences, scores): the maximal
    prefixes that passed (strict, `beam` None), or the `beam` best prefixes of full length (relaxed,
    ranked by mean second-layer distance plus the candidates' first-layer distance `prior`).

    `probe` runs block 1 of the model (its `layers`); a sequence passes below `l2_threshold`. Bounds
    of `options` that cut the search are added to `flags` (reasons the result cannot be certified).
    """
    layers = probe.layers
    cached = None
    if options.use_cache and layers.hf_base_model is not None and not probe.trajectory:  # the cache is of one weight set
        cached = _PrefixCache(probe, layers.hf_base_model)
    dtype = probe.basis.u.dtype
    prefixes = torch.empty(1, 0, dtype=torch.long)
    scores = torch.zeros(1, dtype=dtype)
    finished: list[tuple[list[int], float]] = []
    for p in range(steps):
        cand = (candidates[0] if layers.rope else candidates[p]).cpu()
        first = None if prior is None else (prior[0] if layers.rope else prior[p]).cpu().to(dtype)
        k = cand.numel()
        if prefixes.shape[0] * k > options.max_pairs:  # bounded search: keep the best prefixes
            width = max(1, options.max_pairs // k)
            flags.append(f"position {p}: {prefixes.shape[0]} prefixes x {k} candidates, kept {width} prefixes")
            best = torch.argsort(scores)[:width]
            prefixes, scores = prefixes[best], scores[best]
        n = prefixes.shape[0]
        parents = torch.arange(n).repeat_interleave(k)
        tokens = cand.repeat(n)
        extra = None if first is None else first.repeat(n)

        def pair_scores(start: int, dist: Tensor) -> Tensor:
            sl = slice(start, start + dist.numel())
            if beam is None:
                return torch.maximum(scores[parents[sl]], dist)
            step = dist if extra is None else dist + extra[sl]
            return (scores[parents[sl]] * p + step) / (p + 1)

        def retain(start: int, dist: Tensor) -> Tensor:
            if beam is None:
                return torch.nonzero(dist < l2_threshold).flatten()
            return torch.argsort(pair_scores(start, dist))[:beam].sort().values

        dist = None
        if cached is not None:
            try:
                dist = cached.step(parents if p > 0 else None, tokens, p, retain)
            except Exception as error:  # noqa: BLE001 - an unsupported cache API: re-run prefixes instead
                flags.append(f"key/value cache unavailable ({type(error).__name__}: {error}); re-running prefixes")
                cached = None
        if dist is None:
            dist = probe.full(torch.cat([prefixes[parents], tokens[:, None]], dim=1))[:, -1]
        dist = dist.cpu().to(dtype)
        total = pair_scores(0, dist)
        if beam is None:
            keep = torch.nonzero(dist < l2_threshold).flatten()
            if keep.numel() > options.max_prefixes:
                flags.append(f"position {p}: {keep.numel()} prefixes, kept the closest {options.max_prefixes}")
                keep = keep[torch.argsort(total[keep])[: options.max_prefixes]].sort().values
        else:
            keep = torch.argsort(total)[:beam].sort().values
        extended = torch.zeros(n, dtype=torch.bool)
        extended[parents[keep]] = True
        if beam is None and p > 0:
            for i in torch.nonzero(~extended).flatten().tolist():
                finished.append((prefixes[i].tolist(), float(scores[i])))
        if keep.numel() == 0:
            prefixes = prefixes[:0]
            break
        prefixes = torch.cat([prefixes[parents[keep]], tokens[keep, None]], dim=1)
        scores = total[keep]
        if cached is not None:
            cached.keep(keep)
    finished += [(prefixes[i].tolist(), float(scores[i])) for i in range(prefixes.shape[0]) if prefixes.shape[1]]
    return [f[0] for f in finished], [f[1] for f in finished]
