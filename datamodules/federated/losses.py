"""The client's training loss: what tells a text client from an image/table client. No Lightning.

Every client protocol (FedSGD, FedAvg, LoRA) is written once, against a `ClientLoss`: it knows the
fields of a client batch (every field (U, m, ...): U clients of m samples), and it computes the
gradients a protocol asks for with its own engines:

| loss            | batch fields                               | engines                          |
|-----------------|--------------------------------------------|----------------------------------|
| `NextTokenLoss` | `input_ids`, optional `attention_mask`     | `engines.next_token` (+ Transformer3's) |
| `ClassificationLoss` | `inputs` (U, m, *input_shape), `labels` (U, m) | `engines.classification` |

`implementation` selects the fast path (`vmap`) or the obvious reference (`loop`) the tests compare
it with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor, nn

from datamodules.federated.engines import classification, next_token
from datamodules.registry import Registry

#: A client batch: named fields, each (U, m, ...).
ClientBatch = dict[str, Tensor]

CLIENT_LOSSES: Registry["ClientLoss"] = Registry("client loss")


class ClientLoss(CLIENT_LOSSES.base(), ABC):
    name: ClassVar[str]
    #: Batch fields (the first one is required and fixes U and m).
    fields: ClassVar[tuple[str, ...]]
    #: Floating fields that are not inputs (masks): never cast to the client's dtype.
    exact_fields: ClassVar[tuple[str, ...]] = ()

    def shape(self, batch: ClientBatch) -> tuple[int, int]:
        """(U clients, m samples per client) of a batch."""
        lead = batch[self.fields[0]]
        if lead.dim() < 2:
            raise ValueError(f"{self.fields[0]} must be (updates, samples, ...), got {tuple(lead.shape)}")
        return int(lead.shape[0]), int(lead.shape[1])

    def validate(self, batch: ClientBatch, target: nn.Module) -> None:
        """Raises a one-line error when the batch is not (U, m, ...) client data for `target`."""
        if batch.get(self.fields[0]) is None:
            raise ValueError(f"the batch has no {self.fields[0]!r}")
        self.shape(batch)

    def select(self, batch: ClientBatch, index: Tensor) -> ClientBatch:
        """Every client's minibatch: samples `index` (U, b) of each field."""
        out = {}
        for name, value in batch.items():
            where = index.view(*index.shape, *[1] * (value.dim() - 2)).expand(-1, -1, *value.shape[2:])
            out[name] = value.gather(1, where)
        return out

    def cast(self, batch: ClientBatch, dtype: torch.dtype) -> ClientBatch:
        """The batch as a client training in `dtype` reads it (floating inputs cast; ids and labels kept)."""
        return {k: v.to(dtype) if v.is_floating_point() and k not in self.exact_fields else v for k, v in batch.items()}

    def per_example_gradients(self, target: nn.Module, names, batch: ClientBatch, implementation: str) -> Tensor:
        """(U, m, D): every sample's own gradient at the global weights."""
        updates, per_update = self.shape(batch)
        flat = {k: v.reshape(updates * per_update, *v.shape[2:]) for k, v in batch.items()}
        return self._per_example(target, names, flat, implementation).view(updates, per_update, -1)

    @abstractmethod
    def _per_example(self, target: nn.Module, names, flat: ClientBatch, implementation: str) -> Tensor:
        """(N, D) per-sample gradients of a flat batch (fields (N, ...))."""

    @abstractmethod
    def group_gradients(self, target: nn.Module, names, batch: ClientBatch, weights: Tensor | None,
                        implementation: str) -> Tensor:
        """(G, D): group i's mean-loss gradient at its own flat weights `weights[i]` (None: global)."""

    def grouped_per_example_gradients(self, target: nn.Module, names, batch: ClientBatch, weights: Tensor | None,
                                      implementation: str) -> Tensor:
        """(G, g, D): every sample's own gradient at its group's weights (None: global)."""
        if implementation == "vmap":
            return self._grouped_per_example(target, names, batch, weights)
        # Reference: groups of one sample, each with its client's weights.
        groups, size = self.shape(batch)
        rows = None if weights is None else weights.repeat_interleave(size, dim=0)
        singles = {k: v.reshape(groups * size, 1, *v.shape[2:]) for k, v in batch.items()}
        return self.group_gradients(target, names, singles, rows, "loop").view(groups, size, -1)

    @abstractmethod
    def _grouped_per_example(self, target: nn.Module, names, batch: ClientBatch, weights: Tensor | None) -> Tensor:
        """The fast path of `grouped_per_example_gradients`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NextTokenLoss(ClientLoss):
    """Mean next-token cross-entropy of each sequence (text clients)."""

    name = "next_token"
    fields = ("input_ids", "attention_mask")
    exact_fields = ("attention_mask",)

    def validate(self, batch: ClientBatch, target: nn.Module) -> None:
        super().validate(batch, target)
        if batch["input_ids"].dim() != 3:
            raise ValueError(f"input_ids must be (updates, sequences, length), got {tuple(batch['input_ids'].shape)}")

    def _ids(self, batch: ClientBatch) -> tuple[Tensor, Tensor | None]:
        return batch["input_ids"], batch.get("attention_mask")

    def _per_example(self, target, names, flat, implementation):
        fn = next_token.per_example_gradients if implementation == "vmap" else next_token.per_example_gradients_loop
        return fn(target, names, *self._ids(flat))

    def group_gradients(self, target, names, batch, weights, implementation):
        fn = next_token.group_gradients if implementation == "vmap" else next_token.group_gradients_loop
        return fn(target, names, *self._ids(batch), weights)

    def _grouped_per_example(self, target, names, batch, weights):
        return next_token.grouped_per_example_gradients(target, names, *self._ids(batch), weights)


class ClassificationLoss(ClientLoss):
    """Mean cross-entropy of labelled samples (image and table clients)."""

    name = "classification"
    fields = ("inputs", "labels")

    def shape(self, batch: ClientBatch) -> tuple[int, int]:
        updates, per_update = super().shape(batch)
        labels = batch.get("labels")
        if labels is None or tuple(labels.shape) != (updates, per_update):
            got = None if labels is None else tuple(labels.shape)
            raise ValueError(f"labels must be (updates, samples) = {(updates, per_update)}, got {got}")
        return updates, per_update

    def validate(self, batch: ClientBatch, target: nn.Module) -> None:
        inputs = batch.get("inputs")
        if inputs is not None:
            shape = tuple(getattr(target, "input_shape", inputs.shape[2:]))
            if inputs.dim() != 2 + len(shape) or tuple(inputs.shape[2:]) != shape:
                raise ValueError(f"inputs must be (updates, samples, {', '.join(map(str, shape))}), got {tuple(inputs.shape)}")
        super().validate(batch, target)

    def _per_example(self, target, names, flat, implementation):
        fn = classification.per_sample_gradients if implementation == "vmap" else classification.per_sample_gradients_loop
        return fn(target, names, flat["inputs"], flat["labels"])

    def group_gradients(self, target, names, batch, weights, implementation):
        fn = classification.group_gradients if implementation == "vmap" else classification.group_gradients_loop
        return fn(target, names, batch["inputs"], batch["labels"], weights)

    def _grouped_per_example(self, target, names, batch, weights):
        return classification.grouped_per_example_gradients(target, names, batch["inputs"], batch["labels"], weights)
