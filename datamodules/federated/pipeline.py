"""Token batch -> client update -> defense -> hashed features: everything the server sees, in one place."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from datamodules.federated.client import ClientProtocol, FedSGDClient
from datamodules.federated.defenses import Defense, NoDefense
from datamodules.federated.hashing import FeatureHasher, HashSpec
from datamodules.federated.observed import ParameterSelection
from datamodules.targets.base import TargetLM


def target_fingerprint(target: nn.Module) -> str:
    """A short digest of the global model's weights (server and checkpoint must agree on them)."""
    digest = hashlib.sha256()
    for name, tensor in target.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().float().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class ObservedUpdates:
    """What the server observes for U client updates."""

    features: Tensor  # (U, k) hashed defended updates: the inverter's input
    update: Tensor | None  # (U, D) defended updates: what exact attacks read (kept on evaluation only)


class HashedObservation(nn.Module):
    """What every update pipeline shares (text and vision): the observed parameters `names` of the
    fixed global model `target`, their hash spec and hasher, and splitting flat updates by parameter."""

    target: nn.Module
    names: list[str]

    def _bind_hashing(
        self, target: nn.Module, hash_fraction: float | None, hash_bins: int | None, hash_seed: int, hash_signed: bool
    ) -> None:
        params = dict(target.named_parameters())
        shapes = tuple((name, tuple(params[name].shape)) for name in self.names)
        dim = sum(math.prod(shape) for _, shape in shapes)
        if hash_bins is None:
            if hash_fraction is None or not 0.0 < hash_fraction <= 1.0:
                raise ValueError(f"hash_fraction={hash_fraction} must be in (0, 1] (or give hash_bins)")
            hash_bins = max(1, round(hash_fraction * dim))
        if hash_bins < 1:
            raise ValueError(f"hash_bins={hash_bins} must be >= 1")
        for p in target.parameters():
            p.requires_grad_(False)  # the global model is fixed; only copies get gradients
        self.spec = HashSpec(
            num_bins=int(hash_bins), seed=int(hash_seed), signed=bool(hash_signed), parameters=shapes,
            target_fingerprint=target_fingerprint(target),
        )
        self.hasher = FeatureHasher(self.spec)

    @property
    def observed_dim(self) -> int:
        return self.spec.input_dim

    def split(self, update: Tensor) -> dict[str, Tensor]:
        """(U, D) flat updates -> {parameter name: (U, *shape)}, for attacks that need the layers."""
        out, start = {}, 0
        for name, shape in self.spec.parameters:
            size = math.prod(shape)
            out[name] = update[:, start : start + size].view(update.shape[0], *shape)
            start += size
        return out

    def _check_finite(self, values: Tensor) -> None:
        """Raise on nan/inf in raw client gradients (..., D) before the defense hides them."""
        # A sum is ~20x cheaper than an element-wise scan and is non-finite whenever an element
        # is; only then (or on overflow of the sum) is the slow scan run to name the parameter.
        if not torch.isfinite(values.sum()) and not torch.isfinite(values).all():
            bad = self.names[self._first_nonfinite_parameter(values)]
            raise FloatingPointError(f"non-finite client update (nan/inf) in parameter {bad!r}; check the target model and data")

    def _first_nonfinite_parameter(self, per_example: Tensor) -> int:
        start = 0
        for i, (_, shape) in enumerate(self.spec.parameters):
            size = math.prod(shape)
            if not torch.isfinite(per_example[..., start : start + size]).all():
                return i
            start += size
        return 0


class UpdatePipeline(HashedObservation):
    def __init__(
        self,
        target: TargetLM,
        client: ClientProtocol | None = None,
        defense: Defense | None = None,
        observed: ParameterSelection | None = None,
        hash_fraction: float | None = 0.1,
        hash_bins: int | None = None,
        hash_seed: int = 0,
        hash_signed: bool = False,
    ) -> None:
        super().__init__()
        self.client = client or FedSGDClient()
        # The protocol may change the global model the clients train (LoRA injects adapters, in
        # place) and which parameters are observed (LoRA: only the adapters).
        target = self.client.prepare(target)
        self.target = target
        self.defense = defense or NoDefense()
        self.observed = observed or ParameterSelection()
        self.names = self.client.observed_names(target, self.observed)
        self._bind_hashing(target, hash_fraction, hash_bins, hash_seed, hash_signed)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        keep_update: bool = False,
        generator: torch.Generator | None = None,
    ) -> ObservedUpdates:
        """(U, m, L) token ids of U client updates -> what the server observes."""
        if input_ids.dim() != 3:
            raise ValueError(f"input_ids must be (updates, sequences, length), got {tuple(input_ids.shape)}")
        # Gradients are needed even when called under Lightning's inference mode (validation):
        # leave it, and copy the batch so it is not an inference tensor.
        with torch.inference_mode(False), torch.enable_grad():
            input_ids = input_ids.clone()
            attention_mask = None if attention_mask is None else attention_mask.clone()
            update = self.client.observe(
                self.target, self.names, input_ids, attention_mask, self.defense, generator, self._check_finite
            )
            with torch.no_grad():
                features = self.hasher(update)
        return ObservedUpdates(features=features, update=update if keep_update else None)
