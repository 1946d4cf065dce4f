"""Attack metrics as torchmetrics `Metric`s (summed states, so DDP reduction is exact). No Lightning."""

from __future__ import annotations

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


def position_loss(logits: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Mean cross-entropy over the unmasked positions: logits (U, P, V), target and mask (U, P).

    The logits are flattened to (U * P, V) rather than transposed to (U, V, P) for
    `cross_entropy`: with the class dimension contiguous the CPU kernel is about 4x faster on the
    (32, 64, 50257) logits of a FedAvg batch and 2x on a FedSGD batch's 16 positions
    (benchmarks/results/inverter_loss_cpu.md); same values up to float rounding (tested against a
    per-position loop).
    """
    per_position = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
    ).view(target.shape)
    return (per_position * mask).sum() / mask.sum().clamp_min(1)


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
