"""SPEAR steps 3-4: sample kernel directions of L, filter and refine the sparse ones, merge duplicates.

Where sample j's neuron i is inactive, (dL/dZ)_ij = L_i q_j = 0: if b - 1 rows of L all lie in
column j's zero set, q_j spans the kernel of that (b-1) x b submatrix. `SearchState.absorb` keeps a
direction when L q is sparse enough, refines it (`refine`) and merges duplicates; "pivotal"
directions (`pivotal`, usually mixtures of two columns) go to a bounded fallback pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from exact.spear.options import Sampling, SearchBudget
from exact.spear.selection import TINY, Candidate


@dataclass
class SearchState:
    """What one attack's search has found so far (shared by the sampled and the prior-guided phase)."""

    #: Live rows of L, normalised (rows, b).
    unit: Tensor
    b: int
    #: Zeros a candidate needs: max(tau * live rows, b).
    need: int
    zero_tol: float
    screen_tol: float
    max_pivotal: int
    diag: dict
    candidates: list = field(default_factory=list)
    #: Directions seen (sampled and refined), to skip repeats cheaply.
    known: Tensor | None = None
    #: Pivotal candidates (see `pivotal`): usually mixtures of two columns, occasionally a true column
    #: whose zero set is almost contained in another's. Kept, unrefined, as a bounded fallback.
    pool: dict = field(default_factory=dict)
    #: A regular candidate arrived since the last selection.
    added: bool = False
    pool_changed: bool = False

    def __post_init__(self) -> None:
        if not self.pool:
            self.pool = {"dirs": self.unit.new_zeros(0, self.b), "zeros": torch.zeros(0, dtype=torch.long)}

    def all_candidates(self) -> list[Candidate]:
        """The regular candidates, then the pivotal ones (pool order: sparsest first)."""
        return self.candidates + [(d, int(c), True) for d, c in zip(self.pool["dirs"], self.pool["zeros"].tolist())]

    def absorb(self, q: Tensor, ok: Tensor) -> None:
        """Screen unit kernel directions q (H, b) (rows where `ok`), refine the sparse ones, keep the new ones."""
        unit, need, zero_tol, screen_tol = self.unit, self.need, self.zero_tol, self.screen_tol
        hits = ok.nonzero().flatten()
        if hits.numel() == 0:
            return
        zeros = ((unit @ q[hits].T).abs() <= screen_tol).sum(dim=0)
        hits = hits[zeros >= need]
        if hits.numel() and self.known is not None:  # skip directions found before (cheap, batched)
            hits = hits[(q[hits] @ self.known.T).abs().amax(dim=1) < 1 - 1e-6]
        if hits.numel():
            is_pivotal = pivotal(unit, q[hits], screen_tol)
            if is_pivotal.any():
                piv = q[hits[is_pivotal]]
                piv_zeros = ((unit @ piv.T).abs() <= screen_tol).sum(dim=0).cpu()
                self.pool_changed |= self.pool_add(piv, piv_zeros)
                self.diag["pivotal_seen"] += int(is_pivotal.sum())
            hits = hits[~is_pivotal]
        for h in hits.tolist():
            known = self.known
            if known is not None and float((known @ q[h]).abs().max()) >= 1 - 1e-6:
                continue  # found earlier in this same batch
            refined = refine(unit, q[h], zero_tol, screen_tol)
            if refined is None:
                continue
            direction, zero_count, is_pivotal = refined
            if zero_count < need:
                continue
            if is_pivotal:
                self.pool_changed |= self.pool_add(direction[None], torch.tensor([zero_count]))
                continue
            repeat = known is not None and float((known @ direction).abs().max()) >= 1 - 1e-6
            # Remember both the sampled and the refined direction, so that repeats are skipped early.
            self.known = torch.stack([q[h], direction]) if known is None else torch.cat([known, q[h][None], direction[None]])
            if repeat:
                continue
            self.candidates.append((direction, zero_count, is_pivotal))
            self.added = True

    def pool_add(self, directions: Tensor, zeros: Tensor) -> bool:
        """Merge pivotal directions into the pool (distinct, the `max_pivotal` sparsest). True if it changed."""
        pool, unit, zero_tol = self.pool, self.unit, self.zero_tol
        keep = zeros >= self.need
        directions, zeros = directions[keep], zeros[keep]
        if directions.shape[0] == 0 or self.max_pivotal == 0:
            return False
        before = pool["zeros"].numel()
        dirs = torch.cat([pool["dirs"], directions])
        counts = torch.cat([pool["zeros"], zeros])
        order = torch.argsort(counts, descending=True, stable=True)
        dirs, counts = dirs[order], counts[order]
        similar = (dirs @ dirs.T).abs() >= 1 - 1e-6
        first = ~torch.tril(similar, diagonal=-1).any(dim=1)  # no earlier (sparser) duplicate
        dirs, counts = dirs[first][: self.max_pivotal], counts[first][: self.max_pivotal]
        # Refine the newcomers (the least-squares kernel of their zero rows), as for other candidates.
        old = pool["dirs"]
        for i in range(dirs.shape[0]):
            if old.shape[0] and float((old @ dirs[i]).abs().max()) >= 1 - 1e-12:
                continue
            refined = refine(unit, dirs[i], zero_tol, self.screen_tol)
            if refined is not None:
                dirs[i], counts[i] = refined[0], refined[1]
        changed = counts.numel() != before or not torch.equal(counts, pool["zeros"])
        pool["dirs"], pool["zeros"] = dirs, counts
        return changed


def sample_randomly(
    state: SearchState, sampling: Sampling, budget: SearchBudget, generator: torch.Generator, device: torch.device,
    out_of_time: Callable[[], bool], certified_now: Callable[[bool], bool],
) -> tuple[bool, int]:
    """The paper's sampler: random (b-1)-row submatrices (or b-2 rows with `line_search`), `batch_samples`
    at a time, until the selection certifies or the budget is spent. Returns (certified, submatrices drawn).

    The directions feed `state`; `out_of_time()` ends the search; `certified_now(force)` re-selects and
    says whether the selection certifies.
    """
    unit, b, diag = state.unit, state.b, state.diag
    rows = unit.shape[0]
    pre_rows = min(sampling.prefilter_rows, rows) if sampling.prefilter_rows > 0 else rows
    # Expected zeros on the pre-filter rows of a true direction: >= tau * pre_rows; accept at a
    # quarter of that so that true directions are hardly ever lost (a lost one is only a lost sample).
    pre_need = max(1, int(0.25 * sampling.tau * pre_rows)) if pre_rows < rows else state.need
    drawn = 0
    done = False
    while not done and drawn < budget.max_samples:
        if out_of_time():
            break
        count = min(budget.batch_samples, budget.max_samples - drawn)
        drawn += count
        diag["iterations"] += 1
        if sampling.line_search and b >= 3:
            q, ok = line_kernels(unit, b, count, generator, state.screen_tol, device)
        else:
            q, ok = row_kernels(unit, b, count, generator, device)
        q = q / q.norm(dim=1, keepdim=True).clamp_min(TINY)
        if pre_rows < rows:
            probe = torch.randint(0, rows, (pre_rows,), generator=generator, device=device)
            pre_zero = ((unit[probe] @ q.T).abs() <= state.screen_tol).sum(dim=0)
            ok &= pre_zero >= pre_need
        state.absorb(q, ok)
        # Re-select when a regular candidate arrived, or every 8th iteration when only the pool changed.
        done = certified_now(state.pool_changed and diag["iterations"] % 8 == 0)
        if state.pool_changed and diag["iterations"] % 8 == 0:
            state.pool_changed = False
    return done, drawn


def row_kernels(unit: Tensor, b: int, count: int, generator, device) -> tuple[Tensor, Tensor]:
    """Kernels of `count` random (b-1) x b submatrices of `unit` (unnormalised), and which are valid."""
    index = torch.randint(0, unit.shape[0], (count, b - 1), generator=generator, device=device)
    sub = unit[index]  # (count, b-1, b)
    # Kernel of each (b-1) x b submatrix: q = [A^-1 a; -1] with A its first b-1 columns.
    sol, info = torch.linalg.solve_ex(sub[:, :, : b - 1], sub[:, :, b - 1 :])
    q = torch.cat([sol[:, :, 0], -torch.ones_like(sol[:, :1, 0])], dim=1)
    return q, (info == 0) & torch.isfinite(q).all(dim=1)


def line_kernels(unit: Tensor, b: int, count: int, generator, screen_tol: float, device) -> tuple[Tensor, Tensor]:
    """b-2 sampled rows leave a 2-D kernel K; if they lie in column j's zero set, q_j = K c and every
    other zero row i of column j satisfies (L_i K) c = 0: the rows of L K in that set are collinear.
    The densest line (rows of L K sorted by angle, the longest run of equal angles) gives c.
    One row fewer to draw than the paper's (b-1)-row kernels, and robust to sampled rows that lie
    in the intersection of two columns' zero sets (a degenerate (b-1)-row kernel)."""
    rows = unit.shape[0]
    index = torch.randint(0, rows, (count, b - 2), generator=generator, device=device)
    sub = unit[index]  # (count, b-2, b)
    basis = torch.linalg.qr(sub.transpose(1, 2), mode="complete").Q[:, :, b - 2 :]  # (count, b, 2)
    proj = unit[None] @ basis  # (count, rows, 2)
    size = proj.norm(dim=2)
    angle = torch.atan2(proj[..., 1], proj[..., 0]).remainder(math.pi)
    # Rows (nearly) in the kernel carry no direction: park them far apart so they never chain.
    parked = size < 1e-3
    angle = torch.where(parked, 10.0 + torch.arange(rows, device=unit.device, dtype=unit.dtype)[None], angle)
    ordered, _ = angle.sort(dim=1)
    close = (ordered[:, 1:] - ordered[:, :-1]) <= 10 * screen_tol
    segment = torch.cat([torch.zeros(count, 1, dtype=torch.long, device=unit.device),
                         torch.cumsum(~close, dim=1)], dim=1)
    lengths = torch.zeros(count, rows, dtype=torch.long, device=unit.device).scatter_add_(
        1, segment, torch.ones_like(segment))
    best = lengths.argmax(dim=1)
    first = (segment == best[:, None]).to(torch.int8).argmax(dim=1)
    theta = ordered.gather(1, first[:, None])[:, 0]
    coeff = torch.stack([-torch.sin(theta), torch.cos(theta)], dim=1)  # orthogonal to the line
    q = (basis @ coeff[:, :, None])[:, :, 0]
    ok = (lengths.amax(dim=1) >= 2) & (theta < 4) & torch.isfinite(q).all(dim=1)
    return q, ok


def refine(unit: Tensor, q: Tensor, zero_tol: float, start_tol: float | None = None) -> tuple[Tensor, int, bool] | None:
    """Least-squares kernel of all rows on which q is zero; a few rounds until the zero set is stable.

    The first zero set uses `start_tol` (the screening tolerance), the later ones `zero_tol`.
    Returns (unit direction, zero count, pivotal), or None when the zero rows do not fix a direction.
    """
    zero = (unit @ q).abs() <= (zero_tol if start_tol is None else start_tol)
    for _ in range(3):
        if int(zero.sum()) < unit.shape[1] - 1:
            return None
        us, sv, vh = torch.linalg.svd(unit[zero], full_matrices=False)
        if float(sv[-2]) <= 100 * zero_tol:
            return None  # the zero rows leave a kernel of dimension > 1: an intersection, not a column
        direction = vh[-1]
        new_zero = (unit @ direction).abs() <= zero_tol
        if torch.equal(new_zero, zero):
            break
        zero = new_zero
    # A row with leverage ~1 is needed for the rank: typical of a lower-dimensional intersection
    # (rows zero in two or more columns) plus a few arbitrary rows rather than a column. Such
    # candidates are kept but ranked after the others.
    is_pivotal = float((us[:, :-1] ** 2).sum(dim=1).max()) > 1 - 1e-4
    # Fix the sign convention (largest |entry| positive) so that runs are reproducible.
    direction = direction * torch.sign(direction[direction.abs().argmax()])
    return direction, int(zero.sum()), is_pivotal


def pivotal(unit: Tensor, q: Tensor, zero_tol: float, tol: float = 1e-4) -> Tensor:
    """(H,) True where the zero set of direction q_h needs one particular row for its rank b-1.

    Such a zero set is a lower-dimensional intersection (rows that are zero in two or more columns of
    dL/dZ) plus an arbitrary row: the kernel then mixes two columns. A true column's zero set (about
    half the live rows) has no such row. The leverage of row i in zero set Z is a_i^T (A_Z^T A_Z + q q^T)^-1 a_i
    (A_Z^T A_Z has kernel q); a pivotal row has leverage 1. Also True when the zero rows leave a
    kernel of dimension > 1 (a singular Gram matrix). Batched over H directions.
    """
    zero = ((unit @ q.T).abs() <= zero_tol).to(unit.dtype)  # (rows, H)
    gram = torch.einsum("rh,rb,rc->hbc", zero, unit, unit) + q[:, :, None] * q[:, None, :]
    inverse, info = torch.linalg.inv_ex(gram)
    leverage = ((unit[None] @ inverse) * unit[None]).sum(-1) * zero.T  # (H, rows)
    return (info != 0) | ~torch.isfinite(leverage).all(dim=1) | (leverage.amax(dim=1) > 1 - tol)
