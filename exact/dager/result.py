"""What DAGER returns for one client update."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class DagerResult:
    """What DAGER recovered from one client update."""

    #: Recovered token ids, one list per sequence (an unordered set: a gradient has no batch order).
    sequences: list[list[int]]
    #: True when every sequence passed both span tests and (for causal models) its last token was
    #: recovered with a negligible residual, and no degenerate condition was met.
    exact: bool
    #: Per-sequence certificate (same meaning as `exact`, for that sequence).
    sequence_exact: list[bool] = field(default_factory=list)
    #: Per-sequence score: the largest second-layer distance along the sequence (lower is better).
    scores: list[float] = field(default_factory=list)
    diagnostics: dict[str, Any] = field(default_factory=dict)

    def padded(self, length: int | None = None, pad_token_id: int = 0) -> Tensor:
        """Sequences as a right-padded LongTensor (n, length)."""
        length = length or max((len(s) for s in self.sequences), default=0)
        out = torch.full((len(self.sequences), length), pad_token_id, dtype=torch.long)
        for i, seq in enumerate(self.sequences):
            seq = seq[:length]
            out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        return out


def degenerate(diag: dict, reason: str) -> DagerResult:
    """The empty, uncertified result of an update DAGER cannot work on; `reason` goes into `diag`."""
    diag["mode"] = "degenerate"
    diag["reason"] = reason
    return DagerResult([], False, [], [], diag)
