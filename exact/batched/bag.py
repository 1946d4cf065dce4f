"""Bag recovery: which vocabulary tokens are inputs of a batched update, by simultaneous orthogonal
matching pursuit (SOMP) over the whitened first-site dictionary.

The first site's lora_A rows Y (2r, d) are combinations of the batch's first-layer inputs, and in a
RoPE model a token's first-layer input does not depend on its position: Y = C X_S with X_S the inputs
of the batch's distinct visible tokens S. With more tokens than rows (B * L > 2r) Y's row space no longer
contains each input, but a sparse representation over the vocabulary still exists and is unique while
|S| * 2r unknowns stay well below 2r * d equations. SOMP picks, one at a time, the (normalised, whitened)
atom most correlated with all rows of the residual, then refits Y on every atom picked (orthogonal
projection); it stops when the residual's energy falls below `tolerance` of Y's, or after `max_picks`.

Tried: plain (unwhitened) pursuit stalls near 74% of a B = 16 bag (the inputs' anisotropy); the
projection score of each atom alone (DAGER's test) ranks true tokens near the vocabulary's median at
B >= 4. Multiplicities are not estimated here: the order search may use a bag token any number of times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Bag:
    """The tokens picked, in pursuit order, and the relative residual energy after each pick."""

    tokens: list[int]
    residuals: list[float]


def pick_budget(batch_size: int, length: int, per_sequence: int | None = None) -> int:
    """Bag recovery's budget for B sequences of `length` tokens: `per_sequence` picks per sequence (None: `length`,
    one per token: a sequence has `length` - 1 visible tokens, so the budget covers every distinct one with room
    for a few wrong picks; a fixed budget leaves a long sequence's bag partly unfound)."""
    return batch_size * (length if per_sequence is None else per_sequence)


def somp(rows: Tensor, dictionary: Tensor, max_picks: int, tolerance: float = 1e-6) -> Bag:
    """Simultaneous OMP of `rows` (k, d) over the atoms `dictionary` (V, d), both already whitened.

    Incremental: the correlations of every atom with the residual are updated by one matrix-vector
    product per pick (V * d), not recomputed (V * d * k)."""
    y = rows.double()
    atoms = dictionary.double()
    norms = atoms.norm(dim=1).clamp_min(1e-300)
    correlation = (atoms @ y.T) / norms[:, None]  # (V, k): normalised atoms against the residual
    residual = y.clone()
    basis = torch.zeros(atoms.shape[1], 0, dtype=torch.float64, device=atoms.device)
    energy = float(y.pow(2).sum())
    picked: list[int] = []
    residuals: list[float] = []
    if energy == 0.0:
        return Bag(picked, residuals)
    taken = torch.zeros(atoms.shape[0], dtype=torch.bool, device=atoms.device)
    for _ in range(min(max_picks, atoms.shape[0])):
        score = correlation.pow(2).sum(1).masked_fill(taken, -1.0)
        token = int(score.argmax())
        direction = atoms[token] - basis @ (basis.T @ atoms[token])
        length = direction.norm()
        taken[token] = True
        if float(length) <= 1e-12 * float(norms[token]):
            continue  # already in the span of the atoms picked: adds nothing
        direction = direction / length
        basis = torch.cat([basis, direction[:, None]], dim=1)
        along = residual @ direction  # (k,)
        residual = residual - along[:, None] * direction[None]
        correlation = correlation - ((atoms @ direction) / norms)[:, None] * along[None]
        picked.append(token)
        residuals.append(float(residual.pow(2).sum()) / energy)
        if residuals[-1] < tolerance:
            break
    return Bag(picked, residuals)


#: A token whose first-layer input at some position lies this close (relative distance) to the first layer's span
#: is in the bag. True inputs sit at float32 rounding (about 1e-6), others far off (DAGER's first-layer test).
SPAN_BAG_THRESHOLD = 1e-3


def span_bag(first: Tensor, inputs, positions: int, threshold: float = SPAN_BAG_THRESHOLD, rank_tol: float = 1e-6,
             limit: int | None = None, chunk: int = 8192) -> Bag:
    """The bag of a model with a position table (GPT-2), from the first attention layer's gradient `first` (d, k):
    its first-layer inputs are norm(E[t] + P[p]), so a token's input depends on its position, but the span of the
    batch's inputs has dimension at most distinct tokens + positions + 1 (the norm's bias), below d for text such as
    B = 64 WikiText blocks of 16 tokens on GPT-2 (344 distinct tokens, d = 768); then every (token, position) pair of the bag's tokens and the positions lies in it, and the span test of
    every token at every position `0..positions - 1` (`inputs`: an `exact.layers.FirstLayerInput`) finds the
    bag. Tokens are ordered by their least distance, `residuals` holding it; `limit`: the closest this many at most
    (a span a little short of full lets far more tokens pass than a batch holds). A full span (rank d) says nothing:
    the bag is then empty, as a pursuit's would be that finds nothing."""
    from exact.dager.span import span_basis

    basis = span_basis(first.to(inputs.embedding.device), rank_tol)
    if basis.rank >= basis.dim or basis.rank == 0:
        return Bag([], [])
    complement = basis.complement
    vocabulary = torch.arange(inputs.vocab_size, device=complement.device)
    least = torch.full((inputs.vocab_size,), float("inf"), dtype=torch.float64, device=complement.device)
    for position in range(positions):
        for start in range(0, inputs.vocab_size, chunk):
            x = inputs(vocabulary[start : start + chunk], position, torch.float64).to(complement.device)
            distance = (x @ complement).norm(dim=1) / x.norm(dim=1).clamp_min(1e-300)
            least[start : start + chunk] = torch.minimum(least[start : start + chunk], distance)
    found = (least < threshold).nonzero()[:, 0]
    order = found[least[found].argsort()][:limit]
    return Bag(order.tolist(), least[order].tolist())


def brute_force_support(rows: Tensor, dictionary: Tensor, size: int, candidates: list[int]) -> tuple[int, ...]:
    """The reference: among all `size`-subsets of `candidates`, the one whose span leaves the least residual
    energy of `rows` (exhaustive; for tests on small dictionaries)."""
    from itertools import combinations

    y = rows.double()
    best, best_support = float("inf"), ()
    for support in combinations(candidates, size):
        q, _ = torch.linalg.qr(dictionary[list(support)].double().T)
        left = float((y - (y @ q) @ q.T).pow(2).sum())
        if left < best:
            best, best_support = left, support
    return best_support
