"""Client-side defenses, applied to what the client sends (docs/design.md §3).

A defense maps per-sequence gradients (U, m, D) of U updates with m sequences each to the U defended
updates (U, D). Sign and pruning act on the raw update (the mean gradient); Gaussian noise is
N(0, sigma^2) per raw coordinate; DP-SGD clips every sequence's gradient to L2 norm C, sums, adds
N(0, (sigma C)^2) and divides by m. The server knows the defense but not its noise draws, so training
the inverter on defended updates is just data augmentation.

Clients with several local steps (FedAvg) use two hooks instead of `__call__`:

* `local_step(per_example)` (U, b, D) -> (U, D): the minibatch gradient the local optimiser uses.
  The mean for every defense except DP-SGD, which clips every sequence and adds noise at every
  local step, as DP-SGD local training does (`acts_per_step = True`).
* `on_delta(delta)` (U, D) -> (U, D): the transform of the weight delta the client sends. Sign,
  pruning and Gaussian noise act here (`transform`); DP-SGD leaves the delta alone (its noise is
  already in every step).

For FedSGD (one step, the update is the gradient) `__call__` is used and nothing changes.

What a defense declares about itself, for those who reuse its output (the observation cache, a
server simulating a client): `deterministic` (no random draws), `linear` (commutes with sums and
means of updates) and `split_noise()` (a deterministic defense followed by independent Gaussian
noise per coordinate, or not).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch
from torch import Tensor

from datamodules.federated.accounting import ACCOUNTANTS, dp_epsilon
from datamodules.registry import Registry

DEFENSES: Registry["Defense"] = Registry("defense")


class Defense(DEFENSES.base(), ABC):
    name: ClassVar[str]
    #: True if the defense acts on every local step's per-sequence gradients (DP-SGD), False if it
    #: acts on what the client sends.
    acts_per_step: ClassVar[bool] = False
    #: The same input always gives the same output: no random draws (its output may be stored and reused).
    deterministic: ClassVar[bool] = True
    #: Deterministic and commutes with sums and scalings of updates, f(a x + b y) = a f(x) + b f(y): the
    #: defended mean of several updates is the mean of their defended updates.
    linear: ClassVar[bool] = False

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

    def local_step(self, per_example: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(U, b, D) per-sequence gradients of one local minibatch -> (U, D) gradient the optimiser uses."""
        return mean_update(per_example)

    def on_delta(self, delta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(U, D) weight deltas after local training -> (U, D) what the clients send."""
        return self.transform(delta, generator)

    def privacy(self, steps: int, sample_rate: float) -> dict | None:
        """DP guarantee of one client's `steps` noisy steps at `sample_rate`, or None (no DP)."""
        return None

    def split_noise(self) -> tuple[Defense, float] | None:
        """This defense as a deterministic defense followed by independent N(0, std^2) noise on every
        coordinate: (that deterministic defense, std). Such noise commutes with summing coordinates
        (hashing), so a sum of n coordinates gets N(0, n std^2). None when the defense is not of that
        form (DP-SGD: its noise comes before the per-sample mean, after per-sample clipping)."""
        return (self, 0.0) if self.deterministic else None

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
    linear = True

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
    deterministic = False  # a draw even at sigma = 0

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

    def split_noise(self) -> tuple[Defense, float]:
        return NoDefense(), self.sigma


class DPSGD(Defense):
    """DP-SGD on the client: per-sequence clipping to `clip_norm`, Gaussian noise on the sum."""

    name = "dpsgd"
    acts_per_step = True
    deterministic = False

    def __init__(
        self,
        clip_norm: float = 1.0,
        noise_multiplier: float = 0.1,
        target_delta: float = 1e-5,
        accountant: Literal["rdp", "prv", "gdp"] = "rdp",
    ) -> None:
        """
        Args:
            clip_norm: C > 0, the per-sequence L2 clipping bound.
            noise_multiplier: sigma >= 0; the noise on the summed gradient is N(0, (sigma C)^2).
            target_delta: delta of the reported (epsilon, delta)-DP guarantee (record level, one client).
            accountant: opacus accountant that converts the steps to epsilon: `rdp`, `prv` or `gdp`.
        """
        if not (clip_norm > 0.0 and math.isfinite(clip_norm)):
            raise ValueError(f"DP-SGD clip_norm={clip_norm} must be a finite number > 0")
        if not (noise_multiplier >= 0.0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"DP-SGD noise_multiplier={noise_multiplier} must be a finite number >= 0")
        if not 0.0 < target_delta < 1.0:
            raise ValueError(f"DP-SGD target_delta={target_delta} must be in (0, 1)")
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"DP-SGD accountant {accountant!r} is not allowed; use one of {', '.join(ACCOUNTANTS)}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.target_delta = float(target_delta)
        self.accountant = accountant

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

    def local_step(self, per_example: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return self(per_example, generator)  # clip each sequence, noise on the sum, / b

    def on_delta(self, delta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return delta  # every local step was already privatised

    def privacy(self, steps: int, sample_rate: float) -> dict | None:
        epsilon = dp_epsilon(self.noise_multiplier, sample_rate, steps, self.target_delta, self.accountant)
        # "inf" (no noise) as a string: strict JSON has no infinity.
        return {"epsilon": epsilon if math.isfinite(epsilon) else "inf", "delta": self.target_delta, "steps": int(steps), "sample_rate": float(sample_rate),
                "noise_multiplier": self.noise_multiplier, "accountant": self.accountant}


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

    @property
    def acts_per_step(self) -> bool:  # type: ignore[override]
        return self.defenses[0].acts_per_step

    @property
    def deterministic(self) -> bool:  # type: ignore[override]
        return all(d.deterministic for d in self.defenses)

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return all(d.linear for d in self.defenses)

    def split_noise(self) -> tuple[Defense, float] | None:
        """Deterministic parts in order, with Gaussian noise in the last part only (noise that a later
        defense transforms, by a sign or a pruning, is no longer additive Gaussian noise)."""
        parts = [d.split_noise() for d in self.defenses]
        if any(part is None for part in parts) or any(std > 0 for _, std in parts[:-1]):
            return None
        return Compose([deterministic for deterministic, _ in parts]), parts[-1][1]

    def local_step(self, per_example: Tensor, generator: torch.Generator | None = None) -> Tensor:
        # Only the first defense may see per-sequence gradients (DP-SGD); the rest act on the delta.
        return self.defenses[0].local_step(per_example, generator)

    def on_delta(self, delta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        delta = self.defenses[0].on_delta(delta, generator)
        for defense in self.defenses[1:]:
            delta = defense.transform(delta, generator)
        return delta

    def privacy(self, steps: int, sample_rate: float) -> dict | None:
        return self.defenses[0].privacy(steps, sample_rate)

    def describe(self) -> dict:
        return {"name": self.name, "defenses": [d.describe() for d in self.defenses]}
