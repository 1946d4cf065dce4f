"""The hybrid inverter's use of exact evidence: a learned function of the span scores added to
the token logits. Plain PyTorch.

`exact.span_evidence.SpanEvidence` gives every token at every position of an update a score z (larger:
closer to the span of the first layer's inputs). The inverter's logits for the m sequences' slot at
position p get g(z[p, t]) with g piecewise linear in z, learned from zero (so training starts from the
inverter alone and learns how far to trust the evidence under the defense it is trained on).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: Knots of the piecewise-linear g, in units of the score (a token on the span scores about 8 without
#: a defense; the vocabulary's bulk scores about 0).
KNOTS = (-1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 6.0)


class EvidencePrior(nn.Module):
    """g(z) = a * z + sum_k b_k relu(z - knot_k), added to the logits of every sequence slot."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("knots", torch.tensor(KNOTS), persistent=False)
        self.slope = nn.Parameter(torch.zeros(()))
        self.hinges = nn.Parameter(torch.zeros(len(KNOTS)))

    def forward(self, scores: Tensor, sequences: int) -> Tensor:
        """scores (U, L, C) -> logit bonus (U, m * L, C): the same for each of the m sequence slots."""
        bonus = self.slope * scores
        for knot, weight in zip(self.knots, self.hinges):
            bonus = bonus + weight * torch.relu(scores - knot)
        updates, length, classes = bonus.shape
        return bonus.unsqueeze(1).expand(updates, sequences, length, classes).reshape(updates, sequences * length, classes)
