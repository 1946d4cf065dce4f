"""Prior-guided sampling: plausible layer inputs (e.g. the server's auxiliary data) name zero sets.

Used by `Spear.attack(..., prior=...)` when the layer's weight and bias are given, before random
sampling (see `guided`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from exact.spear.options import PriorGuidance
from exact.spear.sampling import SearchState


def guided(
    prior: Tensor, state: SearchState, right: Tensor, weight: Tensor, bias: Tensor, live: Tensor,
    options: PriorGuidance, batch_samples: int, generator: torch.Generator, out_of_time: Callable[[], bool],
    certified_now: Callable[[bool], bool],
) -> bool:
    """Prior-guided directions: guesses of a sample's layer input say which neurons it left inactive.

    Sample j's input is x_j = R^T p_j (R: the gradient's right factor, orthonormal rows), so its
    pre-activations are A p_j + b with A = W R^T, and the neurons with the most negative
    pre-activation are in column j's zero set. A guess p (a prior input projected on the span of
    R) close to some p_j therefore names k rows that very likely all lie in that zero set, and
    their least-squares kernel is q_j: one guess succeeds with a probability that does not shrink
    like (zero fraction)^(b-1). Each round also deflates: P Q = I (P = Q^-1 holds the p_j as rows),
    so every p_j of a column not found yet is orthogonal to the directions already found, and the
    guesses are projected on that complement; with b-1 columns found the last p_j is known up to
    scale. Guesses only propose candidates: the filters, the selection and the certificate are the
    same as for sampled ones, so a poor prior costs time, never exactness.

    `right` is R (b, n) and `live` the live rows of L, `weight` and `bias` the layer's; the guesses
    feed `state` (the search so far, shared with the random sampler) `batch_samples` at a time.
    `out_of_time()` ends the search; `certified_now(force)` re-selects and says whether the
    selection certifies. Returns True once it does.
    """
    unit, b, diag = state.unit, state.b, state.diag
    device, dtype = right.device, right.dtype
    rows = unit.shape[0]
    x = prior.detach().to(device, dtype).reshape(prior.shape[0], -1)
    if x.shape[0] > options.max_inputs:
        x = x[torch.randperm(x.shape[0], generator=generator, device=device)[: options.max_inputs]]
    guesses = x @ right.T  # (G, b) coordinates in the inputs' span
    a = weight.detach().to(device, dtype)[live] @ right.T  # (rows, b)
    offset = bias.detach().to(device, dtype)[live]
    sizes = sorted({min(rows, max(b - 1, math.ceil(f * b))) for f in options.rows})
    diag["prior_guesses"] = 0
    scale = float(guesses.norm(dim=1).median())  # a typical |p|, for the sweeps below
    for _ in range(options.rounds):
        before = len(state.candidates)
        p = guesses
        regular = [c[0] for c in state.candidates if not c[2]]
        if regular:
            found = torch.linalg.qr(torch.stack(regular, dim=1)).Q  # (b, found)
            if found.shape[1] >= b:
                break
            p = p - (p @ found) @ found.T  # unfound p_j are orthogonal to found q's
            left_dims = b - found.shape[1]
            if left_dims <= options.sweep_dims and scale > 0:
                p = torch.cat([p, sweep(found, left_dims, scale, generator)])
        for chunk in p.split(batch_samples):
            margins = chunk @ a.T + offset  # (chunk, rows) pre-activations under each guess
            for k in sizes:
                if out_of_time():
                    return False
                index = margins.topk(k, dim=1, largest=False).indices  # most inactive rows
                sub = unit[index]  # (chunk, k, b)
                _, vecs = torch.linalg.eigh(sub.transpose(1, 2) @ sub)
                q = vecs[:, :, 0]  # least-squares kernel of the k rows
                diag["prior_guesses"] += q.shape[0]
                state.absorb(q, torch.isfinite(q).all(dim=1))
                if certified_now(state.pool_changed):
                    return True
                state.pool_changed = False
        diag["prior_rounds"] = diag.get("prior_rounds", 0) + 1
        if len(state.candidates) == before:
            break
    return False


def sweep(found: Tensor, left_dims: int, scale: float, generator) -> Tensor:
    """Guesses covering the complement of the found directions, where the unfound p_j lie: directions
    (both signs of a line, 47 angles of a plane, 256 per dimension at random beyond) times 32 scales
    over four decades around a typical |p|. For when no prior input points the right way."""
    b = found.shape[0]
    eye = torch.eye(b, dtype=found.dtype, device=found.device)
    complement = torch.linalg.qr(torch.cat([found, eye], dim=1)).Q[:, found.shape[1]: b]  # (b, left_dims)
    if left_dims == 1:
        coords = torch.tensor([[1.0], [-1.0]], dtype=found.dtype, device=found.device)
    elif left_dims == 2:
        angles = torch.linspace(0, 2 * math.pi, 48, dtype=found.dtype, device=found.device)[:47]
        coords = torch.stack([angles.cos(), angles.sin()], dim=1)
    else:
        coords = torch.randn(256 * left_dims, left_dims, generator=generator, device=found.device, dtype=found.dtype)
        coords = coords / coords.norm(dim=1, keepdim=True)
    directions = coords @ complement.T
    sizes = scale * torch.logspace(-2, 2, 32, dtype=found.dtype, device=found.device)
    return (directions[:, None, :] * sizes[None, :, None]).reshape(-1, b)
