"""Scoring of every attack, learned or exact, text or images: one module both attack packages read.

Text: position-wise token accuracy over the reference's real tokens and ROUGE-1/2/L F-measure with
`rouge_score` (Porter stemmer on), as in the LTI paper. An exact attack recovers an unordered set of
sequences (a gradient has no batch order), so its predictions are first matched one-to-one to the
references (Hungarian assignment on position-wise token agreement, ties broken by unigram overlap);
learned reconstructions of m > 1 images are matched per update on the per-sample MSE, of m > 1
sequences on position-wise agreement (`match_sequences`). Images: PSNR
(dB) and SSIM (torchmetrics); tables: one-hot argmax accuracy of the discrete columns.
torchmetrics `Metric`s keep summed states, so DDP reduction is exact. No Lightning.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor
from torchmetrics import Metric

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    # As in the LTI paper: F-measure with Porter stemming. (rouge_score is 3x faster than
    # torchmetrics' ROUGEScore and needs no nltk data.)
    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge_f(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measure of one pair, in [0, 1]."""
    scores = _scorer().score(reference, prediction)
    return {name: scores[name].fmeasure for name in ROUGE_TYPES}


def token_accuracy(preds: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-row position-wise accuracy (rows, positions) -> (rows,)."""
    correct = (preds == target).float()
    if mask is None:
        return correct.mean(dim=-1)
    m = mask.float()
    return (correct * m).sum(dim=-1) / m.sum(dim=-1).clamp_min(1.0)


class TokenAccuracy(Metric):
    """Fraction of (unmasked) positions whose token is recovered exactly."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor, mask: Tensor | None = None) -> None:
        if preds.shape != target.shape:
            raise ValueError(f"preds {tuple(preds.shape)} and target {tuple(target.shape)} differ in shape")
        hit = preds == target
        if mask is not None:
            hit = hit & mask.bool()
            self.total += mask.bool().sum()
        else:
            self.total += target.numel()
        self.correct += hit.sum()

    def compute(self) -> Tensor:
        return (self.correct / self.total.clamp_min(1.0)).float()


class RougeScores(Metric):
    """Mean ROUGE-1/2/L F-measure over pairs of decoded texts; `compute()` returns a dict."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ROUGE_TYPES:
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        predictions: list[str] | None = None,
        references: list[str] | None = None,
        scores: list[dict[str, float]] | None = None,
    ) -> None:
        """Score text pairs, or add already computed per-pair `scores` (from `rouge_f`)."""
        if scores is None:
            if predictions is None or references is None or len(predictions) != len(references):
                raise ValueError("give equally long predictions and references, or scores")
            scores = [rouge_f(p, r) for p, r in zip(predictions, references)]
        for pair in scores:
            for name in ROUGE_TYPES:
                setattr(self, name, getattr(self, name) + pair[name])
        self.count += len(scores)

    def compute(self) -> dict[str, Tensor]:
        count = self.count.clamp_min(1.0)
        return {name: (getattr(self, name) / count).float() for name in ROUGE_TYPES}


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
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    exact = tokens = correct = 0
    pairs = []
    for ref, idx in zip(refs, assignment):
        pred = list(predictions[idx]) if idx is not None else []
        tokens += len(ref)
        correct += sum(1 for a, b in zip(pred, ref) if a == b)
        exact += int(pred == ref)
        if decode is not None:
            pred_text, ref_text = decode(pred), decode(ref)
            for k, v in rouge_f(pred_text, ref_text).items():
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


@dataclass
class ScoreTotals:
    """`score_batch` results summed over updates: micro token accuracy (correct / tokens) and per-sequence
    means of ROUGE and exact matches: what the DAGER callback and the audit report."""

    sequences: int = 0
    tokens: int = 0
    correct: int = 0
    exact: int = 0
    rouge: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROUGE_TYPES, 0.0))

    def add(self, scores: dict) -> None:
        count = scores["count"]
        self.sequences += count
        self.tokens += scores["tokens"]
        self.correct += scores["correct"]
        self.exact += round(scores["exact_fraction"] * count)
        for key in ROUGE_TYPES:
            self.rouge[key] += scores[key] * count

    def means(self) -> dict:
        n = max(1, self.sequences)
        return {"token_acc": self.correct / max(1, self.tokens), **{k: v / n for k, v in self.rouge.items()},
                "exact_fraction": self.exact / n, "sequences": self.sequences}


def psnr(mse: Tensor, data_range: float = 1.0, min_mse: float = 1e-10) -> Tensor:
    """Peak signal-to-noise ratio (dB) of per-sample mean squared errors (values in [0, data_range])."""
    return 10 * torch.log10(data_range**2 / mse.clamp_min(min_mse))


def ssim(preds: Tensor, targets: Tensor) -> Tensor:
    """Per-image SSIM of (N, C, H, W) pairs in [0, 1] (torchmetrics; window shrunk for small images)."""
    from torchmetrics.image import StructuralSimilarityIndexMeasure

    size = min(11, *(s if s % 2 else s - 1 for s in targets.shape[-2:]))
    metric = StructuralSimilarityIndexMeasure(data_range=1.0, kernel_size=size, reduction="none").to(targets.device)
    return metric(preds.float(), targets.float()).view(-1)


def discrete_accuracy(preds: Tensor, targets: Tensor, columns: Sequence[slice]) -> Tensor:
    """Per row (N, F): the fraction of one-hot column blocks `columns` whose argmax is recovered."""
    if not columns:
        return torch.ones(preds.shape[0], device=preds.device)
    hits = torch.stack([preds[:, s].argmax(dim=1) == targets[:, s].argmax(dim=1) for s in columns], dim=1)
    return hits.float().mean(dim=1)


def assign(cost: Tensor) -> Tensor:
    """(U, m, m) costs of prediction i against reference j -> (U, m) order: order[u, i] is the
    reference matched to prediction i, one-to-one, minimising each update's total cost (Hungarian)."""
    from scipy.optimize import linear_sum_assignment

    cost = cost.detach().float().cpu().numpy()
    order = torch.empty(cost.shape[:2], dtype=torch.long)
    for u in range(cost.shape[0]):
        rows, cols = linear_sum_assignment(cost[u])  # prediction rows[i] -> reference cols[i]
        order[u, torch.as_tensor(rows)] = torch.as_tensor(cols)
    return order


def reorder(values: Tensor, order: Tensor) -> Tensor:
    """values (U, m, ...) -> values[u, order[u, i]] at (u, i)."""
    index = order.to(values.device).view(*order.shape, *[1] * (values.dim() - 2)).expand_as(values)
    return values.gather(1, index)


def reorder_sequences(order: Tensor, *flat: Tensor) -> tuple[Tensor, ...]:
    """Each (U, m*L) tensor with every update's m sequences put in `order` (U, m): `reorder` on the
    (U, m, L) view, flattened back."""
    updates, sequences = order.shape
    return tuple(reorder(values.view(updates, sequences, -1), order).reshape(updates, -1) for values in flat)


def match_samples(preds: Tensor, targets: Tensor) -> Tensor:
    """Reorder each update's m reconstructions to best match its references (Hungarian on per-sample MSE)."""
    if preds.shape[1] == 1:
        return preds
    cost = torch.cdist(preds.detach().flatten(2).float(), targets.flatten(2).float()).pow(2)
    # assign() gives each prediction its reference; here each reference needs its prediction.
    return reorder(preds, assign(cost.transpose(1, 2)))


def match_sequences(preds: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """(U, m, L) predicted and true token ids (+ mask) -> the reference order (U, m) that pairs each
    predicted sequence with one true sequence, maximising the update's position-wise agreement (ties:
    lower reference index). A gradient of m sequences has no order, so learned reconstructions are
    scored as the exact attacks' are (`match`)."""
    agree = ((preds.unsqueeze(2) == targets.unsqueeze(1)) & mask.bool().unsqueeze(1)).sum(-1)  # (U, m_pred, m_ref)
    return assign(-agree.float())
