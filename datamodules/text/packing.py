"""Tokenise a corpus with `datasets.map` (cached) and pack it into fixed-length samples.

* `pack_blocks`: running text concatenated and cut into L-token blocks (the LTI paper's WikiText setup).
* `pack_lines`: one sample per row (sentences), truncated to L and right-padded, with a mask.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tokenize_splits(dataset_dict, tokenizer, end_of_row: str = "\n"):
    """Add `input_ids` to every split; rows end with `end_of_row` so concatenated rows stay apart."""

    def encode(batch):
        return {"input_ids": tokenizer([t + end_of_row for t in batch["text"]])["input_ids"]}

    return dataset_dict.map(encode, batched=True, remove_columns=["text"], desc="tokenizing")


def pack_blocks(tokenized, length: int) -> Tensor:
    """(N, length) int64 blocks of consecutive tokens; the ragged tail is dropped."""
    if length < 2:
        raise ValueError(f"sequence length {length} must be >= 2 (the loss predicts the next token)")

    def group(batch):
        flat = [t for row in batch["input_ids"] for t in row]
        usable = len(flat) // length * length
        return {"block": [flat[i : i + length] for i in range(0, usable, length)]}

    # Grouping within large batches of rows keeps it streaming and cached; only the ragged tail of each
    # map batch is lost (< 1 block per 10,000 rows).
    blocks = tokenized.map(group, batched=True, batch_size=10_000, remove_columns=tokenized.column_names, desc="packing")
    if len(blocks) == 0:
        return torch.empty(0, length, dtype=torch.long)
    return torch.from_numpy(blocks.with_format("numpy")[:]["block"]).long()


def pack_lines(tokenized, length: int, pad_token_id: int, min_tokens: int = 2) -> tuple[Tensor, Tensor]:
    """One sample per row: (N, length) ids right-padded with `pad_token_id` and the (N, length) mask."""
    rows = [row[:length] for row in tokenized["input_ids"] if len(row) >= min_tokens]
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask
