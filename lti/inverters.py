"""Inverter networks: hashed update features (U, k) -> token logits (U, P, V). Plain PyTorch.

Layers are created in `bind(spec)`, once the data side knows the feature count, the number of
positions and the vocabulary (so configs only carry the architecture's own sizes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch
from torch import Tensor, nn

from datamodules.inversion_spec import InversionSpec


class Inverter(nn.Module, ABC):
    def __init__(self, input_norm: Literal["none", "rms"] = "rms") -> None:
        super().__init__()
        if input_norm not in ("none", "rms"):
            raise ValueError(f"input_norm {input_norm!r} is not allowed; use 'none' or 'rms'")
        self.input_norm = input_norm
        self.spec: InversionSpec | None = None

    @property
    def is_bound(self) -> bool:
        return self.spec is not None

    def bind(self, spec: InversionSpec) -> None:
        """Create the layers for this problem (idempotent for the same sizes)."""
        if self.spec is not None:
            if (self.spec.num_features, self.spec.num_positions, self.spec.vocab_size) != (
                spec.num_features, spec.num_positions, spec.vocab_size
            ):
                raise ValueError("inverter is already built for a different feature/position/vocabulary size")
            return
        self.spec = spec
        self.build(spec)

    @abstractmethod
    def build(self, spec: InversionSpec) -> None: ...

    @abstractmethod
    def decode(self, hidden: Tensor, tokens: Tensor | None = None) -> Tensor:
        """Trunk output (U, P, w) -> logits (U, P, V), or (U, P, len(tokens)) for the given token ids
        only (sampled softmax in training scores a few thousand tokens instead of all V)."""

    def normalize(self, features: Tensor) -> Tensor:
        # Updates differ in scale by orders of magnitude across defenses (raw gradients vs sign sums);
        # per-update RMS normalisation makes the first layer's input scale-free.
        if self.input_norm == "rms":
            return features * torch.rsqrt(features.pow(2).mean(dim=1, keepdim=True) + 1e-20)
        return features

    def represent(self, features: Tensor) -> Tensor:
        """(U, k) hashed features -> (U, P, w) per-position representations."""
        if self.spec is None:
            raise RuntimeError("inverter is not built yet: call bind(spec) first")
        hidden = self.trunk(self.normalize(features))
        return hidden.view(features.shape[0], self.spec.num_positions, -1)

    def forward(self, features: Tensor) -> Tensor:
        return self.decode(self.represent(features))


class MLPInverter(Inverter):
    """The LTI paper's inverter: k -> hidden -> P x width (ReLU) -> a Linear(width -> V) shared by positions."""

    def __init__(self, hidden: int = 600, position_width: int = 1000, input_norm: Literal["none", "rms"] = "rms") -> None:
        """
        Args:
            hidden: Width of the first hidden layer (paper: 600).
            position_width: Width of each position's representation (paper: 1000).
            input_norm: `rms` normalises each update's features to unit RMS; `none` feeds them raw.
        """
        super().__init__(input_norm)
        self.hidden, self.position_width = hidden, position_width

    def build(self, spec: InversionSpec) -> None:
        self.trunk = nn.Sequential(
            nn.Linear(spec.num_features, self.hidden), nn.ReLU(),
            nn.Linear(self.hidden, spec.num_positions * self.position_width), nn.ReLU(),
        )
        self.output = nn.Linear(self.position_width, spec.vocab_size)

    def decode(self, hidden: Tensor, tokens: Tensor | None = None) -> Tensor:
        if tokens is None:
            return self.output(hidden)
        return nn.functional.linear(hidden, self.output.weight[tokens], self.output.bias[tokens])


class EmbeddingInverter(Inverter):
    """Predicts a d-vector per position and scores tokens through the known embedding E (docs/design.md §9):
    logits = scale * h @ E^T + b, with b initialised to the log marginal of the server's data."""

    def __init__(self, hidden: int = 600, input_norm: Literal["none", "rms"] = "rms") -> None:
        """
        Args:
            hidden: Width of the hidden layer.
            input_norm: `rms` normalises each update's features to unit RMS; `none` feeds them raw.
        """
        super().__init__(input_norm)
        self.hidden = hidden

    def build(self, spec: InversionSpec) -> None:
        dim = spec.embedding.shape[1]
        self.trunk = nn.Sequential(
            nn.Linear(spec.num_features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, spec.num_positions * dim)
        )
        # E is fixed and known; it is rebuilt from the target at bind time, so it is not saved.
        self.register_buffer("embedding", spec.embedding.detach().float().clone(), persistent=False)
        self.scale = nn.Parameter(torch.tensor(1.0))  # larger starts above the uniform loss
        counts = spec.token_counts.double()
        # Smoothed so that tokens absent from the server's data stay predictable (finite loss).
        log_prior = torch.log((counts + 0.01) / (counts.sum() + 0.01 * counts.numel()))
        self.bias = nn.Parameter(log_prior.float())

    def decode(self, hidden: Tensor, tokens: Tensor | None = None) -> Tensor:
        if tokens is None:
            return self.scale * hidden @ self.embedding.T + self.bias
        return self.scale * hidden @ self.embedding[tokens].T + self.bias[tokens]


INVERTERS = {"mlp": MLPInverter, "embedding": EmbeddingInverter}


def build_inverter(name: str, **kwargs) -> Inverter:
    """An inverter by its short name (`mlp`, `embedding`), for scripts and benchmarks."""
    if name not in INVERTERS:
        raise ValueError(f"inverter {name!r} is not known; choose one of {', '.join(INVERTERS)}")
    return INVERTERS[name](**kwargs)
