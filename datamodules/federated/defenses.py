"""Client-side defenses, applied to what the client sends (DESIGN.md section 3).

A defense maps per-sequence gradients (U, m, D) of U updates with m sequences each to the U defended
updates (U, D). Sign and pruning act on the raw update (the mean gradient); Gaussian noise is
N(0, sigma^2) per raw coordinate; DP-SGD clips every sequence's gradient to L2 norm C, sums, adds
N(0, (sigma C)^2) and divides by m. The server knows the defense but not its noise draws, so training
the inverter on defended updates is just data augmentation.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from lti.registry import Registry

DEFENSES: Registry["Defense"] = Registry("defense")


class Defense(DEFENSES.base(), ABC):
    name: ClassVar[str]

    @classmethod
    def create(cls, name: str, **kwargs) -> "Defense":
        return DEFENSES.create(name, **kwargs)

    def __call__(self, per_example: Tensor, generator: torch.Generator | None = None) -> Tensor:
        if per_example.dim() != 3:
            raise ValueError(f"defense expects (updates, sequences, D) gradients, got shape {tuple(per_example.shape)}")
        return self.transform(mean_update(per_example), generator)

    @abstractmethod
    def transform(self, update: Tensor, generator: torch.Generator | None) -> Tensor:
        """Raw updates (U, D) -> defended updates (U, D)."""

    def describe(self) -> dict:
        return {"name": self.name, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "name")
        return f"{type(self).__name__}({args})"


def mean_update(per_example: Tensor) -> Tensor:
    """(U, m, D) -> (U, D) mean over the update's sequences; a free view when m = 1 (the default)."""
    return per_example[:, 0] if per_example.shape[1] == 1 else per_example.mean(dim=1)


def _noise_like(x: Tensor, generator: torch.Generator | None) -> Tensor:
    return torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)


class NoDefense(Defense):
    name = "none"

    def transform(self, update: Tensor, generator: torch.Generator | None) -> Tensor:
        return update


class Sign(Defense):
    """signSGD-style compression: only the sign of every coordinate is sent."""

    name = "sign"

    def transform(self, update: Tensor, generator: torch.Generator | None) -> Tensor:
        return torch.sign(update)


class TopKPruning(Defense):
    """Keep the largest (1 - fraction_removed) of |g| over the whole observed vector, zero the rest."""

    name = "prune"

    def __init__(self, fraction_removed: float = 0.99) -> None:
        """
        Args:
            fraction_removed: alpha in [0, 1); 0.99 keeps the top 1% of coordinates by magnitude.
        """
        if not 0.0 <= fraction_removed < 1.0:
            raise ValueError(f"pruning fraction_removed={fraction_removed} is outside [0, 1)")
        self.fraction_removed = float(fraction_removed)

    def transform(self, update: Tensor, generator: torch.Generator | None) -> Tensor:
        dim = update.shape[1]
        keep = max(1, math.ceil((1.0 - self.fraction_removed) * dim - 1e-9))
        if keep >= dim:
            return update
        index = update.abs().topk(keep, dim=1, sorted=False).indices
        return torch.zeros_like(update).scatter_(1, index, update.gather(1, index))


class GaussianNoise(Defense):
    """Additive N(0, sigma^2) noise on every observed coordinate."""

    name = "gaussian"

    def __init__(self, sigma: float = 0.01) -> None:
        """
        Args:
            sigma: Standard deviation of the noise per coordinate, >= 0.
        """
        if not (sigma >= 0.0 and math.isfinite(sigma)):
            raise ValueError(f"gaussian noise sigma={sigma} must be a finite number >= 0")
        self.sigma = float(sigma)

    def transform(self, update: Tensor, generator: torch.Generator | None) -> Tensor:
        return update + self.sigma * _noise_like(update, generator)


class DPSGD(Defense):
    """DP-SGD on the client: per-sequence clipping to `clip_norm`, Gaussian noise on the sum."""

    name = "dpsgd"

    def __init__(self, clip_norm: float = 1.0, noise_multiplier: float = 0.1) -> None:
        """
        Args:
            clip_norm: C > 0, the per-sequence L2 clipping bound.
            noise_multiplier: sigma >= 0; the noise on the summed gradient is N(0, (sigma C)^2).
        """
        if not (clip_norm > 0.0 and math.isfinite(clip_norm)):
            raise ValueError(f"DP-SGD clip_norm={clip_norm} must be a finite number > 0")
        if not (noise_multiplier >= 0.0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"DP-SGD noise_multiplier={noise_multiplier} must be a finite number >= 0")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)

    def __call__(self, per_example: Tensor, generator: torch.Generator | None = None) -> Tensor:
        if per_example.dim() != 3:
            raise ValueError(f"defense expects (updates, sequences, D) gradients, got shape {tuple(per_example.shape)}")
        norms = per_example.norm(dim=2, keepdim=True)
        clipped = per_example * (self.clip_norm / norms.clamp_min(1e-12)).clamp(max=1.0)
        total = clipped.sum(dim=1)
        total = total + self.noise_multiplier * self.clip_norm * _noise_like(total, generator)
        return total / per_example.shape[1]

    def transform(self, update: Tensor, generator: torch.Generator | None) -> Tensor:
        return self(update.unsqueeze(1), generator)


class Compose(Defense):
    """Several update transforms in order, e.g. pruning then noise. DP-SGD, if present, must come first."""

    name = "compose"

    def __init__(self, defenses: list[Defense]) -> None:
        """
        Args:
            defenses: Defenses applied one after the other.
        """
        if not defenses:
            raise ValueError("Compose needs at least one defense")
        if any(isinstance(d, DPSGD) for d in defenses[1:]):
            raise ValueError("DP-SGD clips per sequence, so it can only be the first defense in Compose")
        self.defenses = list(defenses)

    def __call__(self, per_example: Tensor, generator: torch.Generator | None = None) -> Tensor:
        update = self.defenses[0](per_example, generator)
        for defense in self.defenses[1:]:
            update = defense.transform(update, generator)
        return update

    def transform(self, update: Tensor, generator: torch.Generator | None) -> Tensor:
        return self(update.unsqueeze(1), generator)

    def describe(self) -> dict:
        return {"name": self.name, "defenses": [d.describe() for d in self.defenses]}
