"""The inverter's training loss. Plain PyTorch."""

from __future__ import annotations

import torch
from torch import Tensor


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


class InverterLoss:
    """The inverter's training loss: full softmax over the vocabulary, or sampled softmax in training.

    With `negatives = n` a training step scores only a candidate set: the tokens of the batch's
    targets plus `n` token ids drawn uniformly from the vocabulary (the same set for every
    position, so the head is one (U*P, w) x (w, |C|) product instead of x (w, V)). No
    log-probability correction is applied, so the estimate is biased: a batch's own tokens are
    always competitors, any other token only with probability about n / V, so rare tokens are
    pushed down less often than under the full softmax. Evaluation always scores every token, and
    the learning curves measure the net effect (docs/paper_reproduction.md). `negatives = None`
    (default) is the full softmax.
    """

    def __init__(self, negatives: int | None = None) -> None:
        if negatives is not None and negatives < 1:
            raise ValueError(f"negatives={negatives} must be >= 1 or null (full softmax)")
        self.negatives = negatives

    def __call__(self, inverter, features: Tensor, targets: Tensor, mask: Tensor, training: bool,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor | None]:
        """Returns (loss, full logits (U, P, V) or None when the loss was sampled)."""
        if not training or self.negatives is None:
            logits = inverter(features)
            return position_loss(logits, targets, mask), logits
        hidden = inverter.represent(features)
        vocab = inverter.spec.vocab_size
        drawn = torch.randint(vocab, (self.negatives,), generator=generator).to(targets.device)
        candidates = torch.unique(torch.cat([targets.reshape(-1), drawn]))  # sorted
        local = torch.searchsorted(candidates, targets)
        return position_loss(inverter.decode(hidden, candidates), local, mask), None
