"""CandidatePointer: L position queries attend over an update's K candidate tokens and point at one each.

Plain PyTorch. Each candidate enters as its (frozen) token embedding, projected, plus what the span
says of it: its score and its span coefficients (`exact.span_evidence.Candidates`). A transformer
encoder reads the candidates and the position queries together, so it can learn both what the
coefficients say of positions and the language's word order; position p's logits are dot products
of its query with the candidates, plus a "none of them" logit for a true token outside the K.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class CandidatePointer(nn.Module):
    def __init__(self, embedding: Tensor, coefficient_width: int, positions: int, hidden: int = 256,
                 layers: int = 4, heads: int = 4, dropout: float = 0.1) -> None:
        """
        Args:
            embedding: (V, d) the target's token embedding (fixed and known to the server; not saved).
            coefficient_width: Span rows per update (the width of `Candidates.coefficients`).
            positions: Tokens per sequence (L).
            hidden, layers, heads, dropout: The transformer encoder's sizes.
        """
        super().__init__()
        self.sizes = {"hidden": hidden, "layers": layers, "heads": heads, "dropout": dropout}
        if hidden % heads:
            raise ValueError(f"hidden {hidden} must be a multiple of heads {heads}")
        self.register_buffer("embedding", embedding.detach().float().clone(), persistent=False)
        self.coefficient_width, self.positions = coefficient_width, positions
        self.token = nn.Linear(embedding.shape[1], hidden)
        self.evidence = nn.Sequential(nn.Linear(2 * coefficient_width + 2, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.queries = nn.Parameter(torch.randn(positions, hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.key, self.query, self.none = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)

    def features(self, scores: Tensor, coefficients: Tensor) -> Tensor:
        """(U, K, 2 width + 2): the coefficients (scaled to unit RMS per update), their log-magnitudes,
        the candidate's log coefficient norm and its span score."""
        count = coefficients.shape[1]
        unit = coefficients * (count * self.coefficient_width) ** 0.5  # unit RMS: the stored ones have unit norm
        norm = coefficients.norm(dim=-1, keepdim=True) * count**0.5
        return torch.cat([unit, torch.log1p(unit.abs()), torch.log(norm + 1e-4), scores[..., None] / 10], dim=-1)

    def forward(self, ids: Tensor, scores: Tensor, coefficients: Tensor) -> Tensor:
        """(U, K) candidates -> (U, L, K + 1) logits; the last column: the true token is none of them."""
        if coefficients.shape[-1] != self.coefficient_width:
            raise ValueError(f"coefficients of width {coefficients.shape[-1]}; this pointer reads {self.coefficient_width}")
        candidates = self.token(self.embedding[ids]) + self.evidence(self.features(scores, coefficients.float()))
        queries = self.queries.expand(ids.shape[0], -1, -1)
        out = self.norm(self.encoder(torch.cat([candidates, queries], dim=1)))
        keys, slots = out[:, : ids.shape[1]], out[:, ids.shape[1] :]
        logits = torch.einsum("upd,ukd->upk", self.query(slots), self.key(keys)) / keys.shape[-1] ** 0.5
        return torch.cat([logits, self.none(slots)], dim=-1)


def pointer_targets(ids: Tensor, truth: Tensor) -> Tensor:
    """(U, L) column of each true token among the (U, K) distinct candidates, K where it is not one."""
    hit = truth[:, :, None] == ids[:, None, :]  # (U, L, K)
    return torch.where(hit.any(-1), hit.float().argmax(-1), ids.shape[1])


def predict_tokens(ids: Tensor, logits: Tensor) -> Tensor:
    """(U, L) token ids: each position's highest-scoring candidate (never "none")."""
    return ids.gather(1, logits[..., :-1].argmax(-1))

