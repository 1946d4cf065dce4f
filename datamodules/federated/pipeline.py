"""Client batch -> client update -> defense -> hashed features: everything the server sees, in one place.

One pipeline for every modality: the client's loss (`NextTokenLoss` for text, `ClassificationLoss`
for images and tables) says which batch fields a client holds and how its gradients are computed;
the protocol (FedSGD, FedAvg, LoRA), the defense, the parameter selection and the hashing are the
same objects for all of them. No Lightning.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from datamodules.federated.defenses import Defense, NoDefense
from datamodules.federated.hashing import FeatureHasher, Hashing
from datamodules.federated.losses import ClientBatch, ClientLoss, NextTokenLoss
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.protocols import ClientProtocol, FedSGDClient, Observation
from datamodules.federated.protocols.base import default_check, model_mode


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


class UpdatePipeline(nn.Module):
    """The fixed global model `target`, the client protocol, the defense, the observed parameters
    (`names`) and their hash spec: `forward(batch)` turns U clients' batches into what the server sees.

    `.target`, `.client`, `.defense`, `.names`, `.spec`, `.hasher`, `.observed_dim` and
    `.split(update)` are what the datamodules and the exact attacks read.
    """

    def __init__(
        self,
        target: nn.Module,
        client: ClientProtocol | None = None,
        defense: Defense | None = None,
        observed: ParameterSelection | None = None,
        hashing: Hashing | None = None,
        loss: ClientLoss | None = None,
    ) -> None:
        """`loss`: the client's training loss (default: next-token, text clients); `hashing`: how
        updates are hashed (default: 10% of the observed dimension as bins)."""
        super().__init__()
        self.loss = loss or NextTokenLoss()
        self.client = client or FedSGDClient()
        # The protocol may change the global model the clients train (LoRA injects adapters, in
        # place) and which parameters are observed (LoRA: only the adapters).
        target = self.client.prepare(target)
        self.target = target
        self.defense = defense or NoDefense()
        self.observed = observed or ParameterSelection()
        self.names = self.client.observed_names(target, self.observed)
        params = dict(target.named_parameters())
        for p in target.parameters():
            p.requires_grad_(False)  # the global model is fixed; only copies get gradients
        shapes = tuple((name, tuple(params[name].shape)) for name in self.names)
        self.spec = (hashing or Hashing()).spec(shapes, target_fingerprint(target))
        self.hasher = FeatureHasher(self.spec)

    @property
    def observed_dim(self) -> int:
        return self.spec.input_dim

    @property
    def device(self) -> torch.device:
        """Where the global model (and so the server's simulations and attacks) runs."""
        return next(self.target.parameters()).device

    def with_client(self, client: ClientProtocol) -> "UpdatePipeline":
        """This pipeline (same global model, observed parameters, hash spec and defense) with another
        client protocol computing the updates: e.g. `client.single_sample()`. The client must observe the
        same parameters of the same, already prepared, model (not re-prepared: LoRA's adapters stay)."""
        other = copy.copy(self)  # shares the target, hasher and buffers
        other.client = client
        return other

    def split(self, update: Tensor) -> dict[str, Tensor]:
        """(U, D) flat updates -> {parameter name: (U, *shape)}, for attacks that need the layers."""
        out, start = {}, 0
        for name, shape in self.spec.parameters:
            size = math.prod(shape)
            out[name] = update[:, start : start + size].view(update.shape[0], *shape)
            start += size
        return out

    def forward(self, batch: ClientBatch, keep_update: bool = False, generator: torch.Generator | None = None,
                defense: Defense | None = None) -> ObservedUpdates:
        """A client batch (`loss.fields`, each (U, m, ...)) of U client updates -> what the server observes;
        under `defense` instead of the pipeline's own when given (the observation cache stores the
        deterministic part of a defense)."""
        if not isinstance(batch, dict):
            raise TypeError(f"the batch must be a dict of fields ({', '.join(self.loss.fields)}), got {type(batch).__name__}")
        unknown = set(batch) - set(self.loss.fields)
        if unknown:
            raise ValueError(f"batch fields {sorted(unknown)} are not {type(self.loss).__name__}'s ({', '.join(self.loss.fields)})")
        self.loss.validate(batch, self.target)
        # Gradients are needed even when called under Lightning's inference mode (validation):
        # leave it, and copy the batch so it is not an inference tensor.
        with torch.inference_mode(False), torch.enable_grad():
            batch = {name: value.clone() for name, value in batch.items() if value is not None}
            observation = Observation(self.target, self.names, self.loss, self.defense if defense is None else defense,
                                      generator, self._check_finite)
            update = self.client.observe(batch, observation)
            with torch.no_grad():
                features = self.hasher(update)
        return ObservedUpdates(features=features, update=update if keep_update else None)

    def sequence_update(self, input_ids: Sequence[int] | Tensor) -> dict[str, Tensor] | None:
        """The update one text sequence alone gives under this client and defense: {name: gradient}.

        What a server can simulate for a sequence it has recovered (exact.dager.peel subtracts it). Only
        where the client's update is the plain mean of its sequences' own updates at the global weights:
        a FedSGD client in eval mode (train mode draws dropout masks the server cannot repeat), the
        next-token loss and a linear defense (none: the defended mean is the mean of the defended
        updates); None otherwise.
        """
        if not (isinstance(self.client, FedSGDClient) and self.client.mode == "eval"
                and isinstance(self.loss, NextTokenLoss) and self.defense.linear):
            return None
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).view(1, 1, -1)
        with torch.inference_mode(False), torch.enable_grad(), model_mode(self.target, "eval"):
            per_example = self.loss.per_example_gradients(self.target, self.names, {"input_ids": ids},
                                                          self.client.implementation)
        update = self.defense.transform(per_example[:, 0].detach(), None)
        return {name: grads[0] for name, grads in self.split(update).items()}

    def _check_finite(self, values: Tensor) -> None:
        """Raise on nan/inf in raw client gradients (..., D) before the defense hides them."""
        try:
            default_check(values)
        except FloatingPointError:  # only then scan per parameter, to name the culprit
            bad = self.names[self._first_nonfinite_parameter(values)]
            raise FloatingPointError(f"non-finite client update (nan/inf) in parameter {bad!r}; check the target model and data") from None

    def _first_nonfinite_parameter(self, per_example: Tensor) -> int:
        start = 0
        for i, (_, shape) in enumerate(self.spec.parameters):
            size = math.prod(shape)
            if not torch.isfinite(per_example[..., start : start + size]).all():
                return i
            start += size
        return 0
