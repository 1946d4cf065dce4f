"""LTI-P pseudo-data: i.i.d. tokens from the marginal (unigram) distribution of the auxiliary corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


def token_counts(samples: Tensor, vocab_size: int, mask: Tensor | None = None) -> Tensor:
    """Unigram counts (V,) float64 of the (N, L) samples (masked positions ignored)."""
    ids = samples if mask is None else samples[mask.bool()]
    return torch.bincount(ids.reshape(-1), minlength=vocab_size).double()


def load_counts(path: str | Path, vocab_size: int) -> Tensor:
    """Counts from `.npy`, `.pt` (a tensor, loaded with weights_only) or `.json` (list or {id: count})."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"marginal file {str(path)!r} does not exist")
    if path.suffix == ".npy":
        counts = torch.from_numpy(np.load(path, allow_pickle=False))
    elif path.suffix == ".pt":
        counts = torch.load(path, weights_only=True)
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            counts = torch.zeros(vocab_size, dtype=torch.float64)
            for key, value in data.items():
                counts[int(key)] = float(value)
        else:
            counts = torch.tensor(data, dtype=torch.float64)
    else:
        raise ValueError(f"marginal file {str(path)!r}: use .npy, .pt or .json")
    counts = counts.double().reshape(-1)
    if counts.numel() != vocab_size:
        raise ValueError(f"marginal file {str(path)!r} has {counts.numel()} entries, the vocabulary has {vocab_size}")
    if (counts < 0).any() or not torch.isfinite(counts).all() or counts.sum() <= 0:
        raise ValueError(f"marginal file {str(path)!r} must hold finite non-negative counts with a positive sum")
    return counts


def save_counts(counts: Tensor, path: str | Path) -> None:
    np.save(Path(path), counts.double().cpu().numpy())


class MarginalSampler:
    """Draws (n, L) token ids i.i.d. from the given counts; a fresh draw on every call."""

    def __init__(self, counts: Tensor) -> None:
        if counts.dim() != 1 or counts.sum() <= 0:
            raise ValueError("marginal counts must be a 1-D tensor with a positive sum")
        self.probs = (counts / counts.sum()).float()

    def sample(self, n: int, length: int, generator: torch.Generator | None = None) -> Tensor:
        return torch.multinomial(self.probs, n * length, replacement=True, generator=generator).view(n, length)
