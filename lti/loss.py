"""The inverter's training loss. Plain PyTorch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from datamodules.metrics import assign, reorder_sequences


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


def sequence_costs(logits: Tensor, targets: Tensor, mask: Tensor, sequences: int) -> Tensor:
    """(U, m, m): the summed cross-entropy of predicted sequence i against true sequence j, for logits
    (U, m*L, C) and target/mask (U, m*L)."""
    updates, positions, classes = logits.shape
    length = positions // sequences
    log_probs = logits.detach().float().log_softmax(-1).view(updates, sequences, 1, length, classes)
    index = targets.view(updates, 1, sequences, length, 1).expand(updates, sequences, sequences, length, 1)
    nll = -log_probs.expand(updates, sequences, sequences, length, classes).gather(-1, index).squeeze(-1)
    return (nll * mask.view(updates, 1, sequences, length)).sum(-1)


def matched_targets(logits: Tensor, targets: Tensor, mask: Tensor, sequences: int) -> tuple[Tensor, Tensor]:
    """Targets and mask (U, m*L) with each update's m true sequences reordered to the predicted
    sequences they fit best (least total cross-entropy, Hungarian). An update of m sequences is
    the same whatever their order, so an ordered target would ask the inverter to guess the order;
    matched, the loss is the least over the m! orders (tested against that loop), as in set
    prediction. The assignment is a choice, not a function the gradient flows through."""
    if sequences == 1:
        return targets, mask
    order = assign(sequence_costs(logits, targets, mask, sequences))
    return reorder_sequences(order, targets, mask)


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
                 generator: torch.Generator | None = None, sequences: int = 1,
                 bonus: Callable[[Tensor | None, Tensor | None], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        """Returns (loss, full logits (U, P, V) or None when the loss was sampled). With `sequences`
        m > 1 the positions are m sequences of P / m tokens, matched to the targets as a set. `bonus`
        (the hybrid's exact evidence) maps token ids (None: all) and the indices among them of the
        uniformly drawn ones to (U, P, len) additive logits."""
        if not training or self.negatives is None:
            logits = inverter(features)
            if bonus is not None:
                logits = logits + bonus(None, None)
            return position_loss(logits, *matched_targets(logits, targets, mask, sequences)), logits
        hidden = inverter.represent(features)
        vocab = inverter.spec.vocab_size
        drawn = torch.randint(vocab, (self.negatives,), generator=generator).to(targets.device)
        candidates = torch.unique(torch.cat([targets.reshape(-1), drawn]))  # sorted
        local = torch.searchsorted(candidates, targets)
        logits = inverter.decode(hidden, candidates)
        if bonus is not None:
            logits = logits + bonus(candidates, torch.searchsorted(candidates, drawn))
        return position_loss(logits, *matched_targets(logits, local, mask, sequences)), None
