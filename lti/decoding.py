"""Decoding the inverter's logits into token ids. Plain PyTorch (and scipy's assignment solver).

An update of m sequences has m tokens at each position, and an inverter that is unsure which
sequence a token belongs to tends to put the same likely token into every one of its m slots.
`distinct_slots` decodes the m slots of a position jointly instead: the m distinct tokens with the
largest summed logits (an assignment problem over each slot's top-m tokens), so that each slot
names a different token. It costs the rare position where two sequences share a token.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

DECODINGS = ("argmax", "distinct")


def distinct_slots(logits: Tensor, sequences: int) -> Tensor:
    """(U, m*L, V) logits of m sequences of L positions -> (U, m*L) token ids, distinct across the m
    slots of every position, maximising the summed logits (exact over each slot's top m tokens: an
    optimal assignment never uses a token below a slot's m-th best, since one of its top m is free)."""
    if sequences == 1:
        return logits.argmax(-1)
    from scipy.optimize import linear_sum_assignment

    updates, positions, _ = logits.shape
    length = positions // sequences
    slots = logits.detach().float().view(updates, sequences, length, -1).transpose(1, 2)  # (U, L, m, V)
    candidates = slots.topk(sequences, dim=-1).indices.reshape(updates, length, -1)  # (U, L, m*m)
    scores = slots.gather(-1, candidates[:, :, None].expand(-1, -1, sequences, -1)).cpu().numpy()  # (U, L, m, m*m)
    candidates_np = candidates.cpu().numpy()
    out = np.empty((updates, length, sequences), dtype=np.int64)
    for u in range(updates):
        for p in range(length):
            tokens, first = np.unique(candidates_np[u, p], return_index=True)
            rows, cols = linear_sum_assignment(scores[u, p][:, first], maximize=True)
            out[u, p, rows] = tokens[cols]
    return torch.from_numpy(out).to(logits.device).permute(0, 2, 1).reshape(updates, positions)


def check_rule(rule: str) -> None:
    """One line for a decoding rule that does not exist."""
    if rule not in DECODINGS:
        raise ValueError(f"decoding {rule!r} is not allowed; use one of {', '.join(DECODINGS)}")


def decode(logits: Tensor, sequences: int, rule: str = "argmax") -> Tensor:
    """(U, m*L, V) logits -> (U, m*L) token ids by `rule` (`argmax`: each slot alone; `distinct`)."""
    check_rule(rule)
    return logits.argmax(-1) if rule == "argmax" else distinct_slots(logits, sequences)
