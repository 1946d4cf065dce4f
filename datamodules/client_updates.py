"""The map-style dataset both inversion datamodules serve: one item per client update."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset


class ClientUpdates(Dataset):
    """Items are client updates: row `index` of every field (text: `input_ids`, `attention_mask`;
    images/tables: `inputs`, `labels`; each (updates, m, ...)) and the update's index."""

    def __init__(self, **fields: Tensor) -> None:
        if not fields or len({value.shape[0] for value in fields.values()}) != 1:
            raise ValueError(f"fields must share their first (update) dimension, got {({k: tuple(v.shape) for k, v in fields.items()})}")
        self.fields = fields

    def __len__(self) -> int:
        return next(iter(self.fields.values())).shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {**{name: value[index] for name, value in self.fields.items()}, "index": torch.tensor(index)}
