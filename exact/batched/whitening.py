"""Whitening of each site's input space: the inverse square root of the second moment of its inputs.

A LoRA update's lora_A rows hold only 2r directions per site. The inputs of a transformer are strongly
anisotropic (a random SmolLM2 token keeps most of its layer-0 input energy in those few directions), so an
unwhitened span test ranks every token alike. Mapping the input space by W = M^{-1/2}, M = E[x x^T],
makes the inputs roughly isotropic; a linear map keeps every span relation (x in span(X) iff Wx in
span(WX)), so nothing is lost and the graded scores become informative.

Two statistics: the *vocabulary* moment of the first site (every token's first-layer input, uniform; the
dictionary bag recovery searches; none for a model with a position table, whose bag comes from the first
layer's span), and the *text* moment of every site (inputs the global model computes
on the server's auxiliary text; the order search scores hidden states with it). Both are the server's to
compute: global weights and its own text. `SiteWhitening.load_or_fit` caches them in one safetensors file
keyed by the model's fingerprint, written atomically. Plain PyTorch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from datamodules.atomic_files import atomic_writer
from datamodules.federated.protocols.base import model_mode
from exact.batched.sites import Site, capture_site_inputs

#: Eigenvalues below this fraction of the largest are raised to it before the inverse square root: the
#: directions the inputs never take are not amplified beyond float resolution.
EIGEN_FLOOR = 1e-6

#: The cache's format. Version 2 reads the text moments in eval mode (no dropout), as the attack's forward
#: passes do; a version-1 cache of a model with dropout holds train-mode statistics, so it is refused, not reused.
FORMAT = "lti-site-whitening/2"


def inverse_sqrt(moment: Tensor, floor: float = EIGEN_FLOOR) -> Tensor:
    """(..., d, d) symmetric M -> M^{-1/2} (float64), eigenvalues floored at `floor` times the largest."""
    values, vectors = torch.linalg.eigh(moment.double())
    values = values.clamp_min(values.amax(-1, keepdim=True) * floor)
    return vectors @ torch.diag_embed(values.rsqrt()) @ vectors.transpose(-1, -2)


def vocabulary_inputs(target: nn.Module) -> Tensor:
    """(V, d) float64: every token's input to the first site (RoPE models: position-free)."""
    from exact.layers import find_layers

    inputs = find_layers(target).inputs
    if inputs.positions is not None:
        raise ValueError("bag recovery needs first-layer inputs without a position table (a RoPE model); "
                         "this target adds absolute positions")
    return inputs(torch.arange(inputs.vocab_size, device=inputs.embedding.device), None, torch.float64)


def _lm(target: nn.Module) -> nn.Module:
    return getattr(target, "model", target)


@torch.no_grad()
def text_moments(target: nn.Module, sites: list[Site], ids: Tensor, chunk: int = 64) -> Tensor:
    """(S, d, d) float64 second moments of every site's inputs over the token blocks `ids` (N, L)."""
    total, count = None, 0
    lm = _lm(target)
    with model_mode(target, "eval"):  # the inputs the attack's eval-mode forward passes see: no dropout
        for part in ids.split(chunk):
            captured = capture_site_inputs(target, sites, lambda part=part: lm(part))
            h = torch.stack([x.reshape(-1, x.shape[-1]).double() for x in captured])  # (S, n, d)
            moment = h.transpose(1, 2) @ h
            total = moment if total is None else total + moment
            count += h.shape[1]
    if total is None:
        raise ValueError("no auxiliary text to compute the whitening from")
    return total / count


def has_position_table(target: nn.Module) -> bool:
    """Whether the model adds absolute positions to its first-layer inputs (GPT-2), so a token's first-layer input
    depends on its position and bag recovery reads the first layer's span instead (`exact.batched.bag.span_bag`)."""
    from exact.layers import find_layers

    return find_layers(target).inputs.positions is not None


class SiteWhitening:
    """`vocabulary` (d, d): the first site's whitening for bag recovery by pursuit (None for a model with a position
    table, whose bag comes from the first layer's span); `sites` (S, d, d): each site's."""

    def __init__(self, vocabulary: Tensor | None, sites: Tensor) -> None:
        self.vocabulary, self.sites = vocabulary, sites

    @classmethod
    def fit(cls, target: nn.Module, sites: list[Site], auxiliary_ids: Tensor) -> "SiteWhitening":
        vocabulary = None
        if not has_position_table(target):
            x0 = vocabulary_inputs(target)
            vocabulary = inverse_sqrt(x0.T @ x0 / x0.shape[0])
        return cls(vocabulary, inverse_sqrt(text_moments(target, sites, auxiliary_ids)))

    @staticmethod
    def key(fingerprint: str, sites: list[Site], auxiliary_ids: Tensor) -> str:
        digest = hashlib.sha256()
        digest.update(fingerprint.encode())
        digest.update(json.dumps([s.weights for s in sites]).encode())
        digest.update(auxiliary_ids.cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()[:24]

    @classmethod
    def load_or_fit(cls, path: str | os.PathLike | None, target: nn.Module, sites: list[Site], auxiliary_ids: Tensor,
                    fingerprint: str, say=print) -> "SiteWhitening":
        """The cached whitening at `path` if it was built for this model, these sites and this text; else
        fit it and write it there (atomically). A file built for another model is refused in one line."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file, save

        key = cls.key(fingerprint, sites, auxiliary_ids)
        if path is not None and Path(path).exists():
            try:
                from safetensors import safe_open

                with safe_open(str(path), "pt") as handle:
                    meta = handle.metadata() or {}
                tensors = load_file(str(path))
            except (SafetensorError, OSError, ValueError) as error:
                raise ValueError(f"whitening cache {path} is unreadable ({type(error).__name__}: {error}); "
                                 "delete it to rebuild it") from None
            if meta.get("format") != FORMAT:
                raise ValueError(f"whitening cache {path} has format {meta.get('format', 'lti-site-whitening/1')!r}, "
                                 f"not {FORMAT!r} (an older version's statistics); delete it to rebuild it")
            if meta.get("key") != key:
                raise ValueError(f"whitening cache {path} was built for another model, adapters or auxiliary text "
                                 f"(key {meta.get('key')}, this threat model's {key}); delete it or choose another path")
            if set(tensors) - {"vocabulary"} != {"sites"} or tensors["sites"].shape[0] != len(sites):
                raise ValueError(f"whitening cache {path} does not hold the whitening of {len(sites)} sites; delete it")
            if ("vocabulary" in tensors) == has_position_table(target):
                raise ValueError(f"whitening cache {path} was built for a model {'without' if 'vocabulary' in tensors else 'with'}"
                                 " a position table; delete it or choose another path")
            return cls(tensors.get("vocabulary"), tensors["sites"])
        say(f"whitening the input spaces of {len(sites)} sites on {auxiliary_ids.shape[0]} auxiliary blocks")
        whitening = cls.fit(target, sites, auxiliary_ids)
        if path is not None:
            tensors = {"sites": whitening.sites.contiguous()}
            if whitening.vocabulary is not None:
                tensors["vocabulary"] = whitening.vocabulary.contiguous()
            with atomic_writer(path, "write the whitening cache") as file:
                file.write(save(tensors, metadata={"format": FORMAT, "key": key, "fingerprint": fingerprint}))
        return whitening
