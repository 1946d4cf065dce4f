"""Scoring an exact attack's output against the client's true batch (metrics only: attacks never read it).

An attack recovers an unordered set of sequences (a gradient has no batch order), so predictions are
first matched one-to-one to the references (Hungarian assignment on position-wise token agreement,
ties broken by unigram overlap). Then, as in the LTI paper (DESIGN.md section 4): position-wise token
accuracy over the reference's real tokens, and ROUGE-1/2/L F-measure with `rouge_score` (stemmer on)
on the decoded text. Plain Python/PyTorch; no Lightning.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lti.metrics import ROUGE_TYPES as ROUGE_KEYS
from lti.metrics import rouge_f as rouge  # one ROUGE implementation for learned and exact attacks


def references(input_ids: Tensor, attention_mask: Tensor | None = None) -> list[list[int]]:
    """(m, L) ids (+ mask) -> the real tokens of every sequence."""
    if attention_mask is None:
        return [row.tolist() for row in input_ids]
    return [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask)]


def _similarity(pred: Sequence[int], ref: Sequence[int]) -> float:
    same = sum(1 for a, b in zip(pred, ref) if a == b)
    overlap = sum((Counter(pred) & Counter(ref)).values())
    return same + 1e-3 * overlap


def match(predictions: Sequence[Sequence[int]], refs: Sequence[Sequence[int]]) -> list[int | None]:
    """For every reference, the index of its matched prediction (None if there are fewer predictions)."""
    if not predictions or not refs:
        return [None] * len(refs)
    sim = [[_similarity(p, r) for p in predictions] for r in refs]
    try:
        from scipy.optimize import linear_sum_assignment

        rows, cols = linear_sum_assignment(torch.tensor(sim).numpy(), maximize=True)
        out: list[int | None] = [None] * len(refs)
        for r, c in zip(rows.tolist(), cols.tolist()):
            out[r] = c
        return out
    except ImportError:  # greedy fallback
        out, used = [None] * len(refs), set()
        pairs = sorted(((sim[r][p], r, p) for r in range(len(refs)) for p in range(len(predictions))), reverse=True)
        for _, r, p in pairs:
            if out[r] is None and p not in used:
                out[r], _ = p, used.add(p)
        return out


def score_batch(
    predictions: Sequence[Sequence[int]],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    decode: Callable[[list[int]], str] | None = None,
    certified: bool = False,
) -> dict:
    """Scores of one update's reconstruction against its m true sequences.

    Returns means over the m references (`rouge*`, `exact_fraction`), micro token accuracy, the
    counts needed to aggregate (`count`, `tokens`, `correct`) and the matched pairs (`pairs`).
    """
    refs = references(input_ids, attention_mask)
    assignment = match(predictions, refs)
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    exact = tokens = correct = 0
    pairs = []
    for ref, idx in zip(refs, assignment):
        pred = list(predictions[idx]) if idx is not None else []
        tokens += len(ref)
        correct += sum(1 for a, b in zip(pred, ref) if a == b)
        exact += int(pred == ref)
        if decode is not None:
            pred_text, ref_text = decode(pred), decode(ref)
            for k, v in rouge(pred_text, ref_text).items():
                totals[k] += v
            pairs.append((pred_text, ref_text))
        else:
            pairs.append((pred, ref))
    count = max(1, len(refs))
    return {
        **{k: v / count for k, v in totals.items()},
        "token_acc": correct / max(1, tokens),
        "exact_fraction": exact / count,
        "count": len(refs),
        "tokens": tokens,
        "correct": correct,
        "certified": bool(certified),
        "pairs": pairs,
    }
