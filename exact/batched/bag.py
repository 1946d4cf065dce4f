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
