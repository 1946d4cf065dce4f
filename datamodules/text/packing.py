"""Tokenise a corpus with `datasets.map` (cached) and pack it into fixed-length samples.

* `pack_blocks`: running text concatenated and cut into L-token blocks (the LTI paper's WikiText setup).
* `pack_lines`: one sample per row (sentences), truncated to L and right-padded, with a mask.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: Rows longer than this (characters) are tokenised in pieces of at most this length. A fast tokenizer
#: holds about 160 bytes per character of its input while it encodes it (offsets, token strings): a
#: 50 MB row needed 8.5 GB at once; in 1 MB pieces it needs about 160 MB at a time.
PIECE_CHARS = 1 << 20


def row_pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """`text` cut into consecutive pieces of at most `limit` characters, each cut made just before a space
    that a non-space follows (so the space stays with the word after it, as GPT-2's pre-tokenizer keeps it:
    byte-level BPE then gives the same tokens as for the whole row). A stretch of `limit` characters
    without such a space is cut where the limit falls."""
    pieces, start = [], 0
    while len(text) - start > limit:
        end = start + limit
        cut = end
        while cut > start:
            cut = text.rfind(" ", start + 1, cut)
            if cut <= start or not text[cut + 1 : cut + 2].isspace():
                break
        if cut <= start:
            cut = end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def encode_row(tokenizer, text: str, limit: int = PIECE_CHARS) -> list[int]:
    """The token ids of one row; a row longer than `limit` characters is encoded piece by piece
    (`row_pieces`), its special tokens (BOS/EOS, where the tokenizer adds them) added once around the whole."""
    pieces = row_pieces(text, limit)
    if len(pieces) == 1:
        return tokenizer(text)["input_ids"]
    ids: list[int] = []
    for piece in pieces:
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    before, after = _special_tokens(tokenizer)
    return before + ids + after


def _special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text's own (e.g. BOS; none for GPT-2)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


def tokenize_splits(dataset_dict, tokenizer, end_of_row: str = "\n", piece_chars: int = PIECE_CHARS):
    """Add `input_ids` to every split; rows end with `end_of_row` so concatenated rows stay apart. A row
    longer than `piece_chars` characters is tokenised in pieces cut at spaces (`encode_row`), said in a log
    line: for GPT-2's byte-level BPE the ids equal the whole row's; a tokenizer whose pre-tokenizer does
    not split before spaces (SentencePiece) may differ at the cuts."""

    def encode(batch):
        texts = [t + end_of_row for t in batch["text"]]
        if all(len(t) <= piece_chars for t in texts):
            return {"input_ids": tokenizer(texts)["input_ids"]}
        ids = []
        for text in texts:
            if len(text) > piece_chars:
                log.info("a row of %.1f MB (%d characters) is tokenised in %d pieces of at most %d characters, cut at "
                         "spaces (to bound memory)", len(text.encode()) / 1e6, len(text),
                         len(row_pieces(text, piece_chars)), piece_chars)
            ids.append(encode_row(tokenizer, text, piece_chars))
        return {"input_ids": ids}

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
