"""DAGER against a client in train mode: embedding dropout, undone coordinate by coordinate.

A client that trains in train mode drops a random p-fraction of the coordinates of each summed
embedding e = E[t] + P[p] (GPT-2's `embd_pdrop`, transformer3's `embedding_dropout`) before the first
attention layer's normalisation. Its first-layer inputs are then x = norm(m * e / (1 - p)) with a
random 0/1 mask m, not the norm(e) that the span test of the eval-mode attack checks, so nothing
passes (the relaxed path ranks tokens instead and loses most sequences at B = 8). Three facts make
the attack exact again:

1. **Masked inputs can be found.** x lies in the span of the first-layer gradient. The mask enters
   linearly: norm(e - d) with d equal to e on the dropped coordinates and 0 elsewhere, and a
   normalisation that only centres (LayerNorm), scales (any) and adds a bias. So "some mask puts the
   candidate (t, p) in the span" is a sparse linear problem over the d coordinates: with N the
   complement of the span, find a support S (about p * d coordinates) with
   N^T(gamma * C e) = sum_{j in S} e_j N^T(gamma * C u_j) + sigma N^T beta (C: centring). Orthogonal
   matching pursuit solves it in about p * d steps for the true candidates (down to the float32
   gradient's floor, ~1e-7), while a wrong (token, position) pair stays far off the span with that
   many atoms (it would need about d - rank). The mask found is verified on the explicit input
   norm(m * e / (1 - p)) against `l1_threshold`, as the eval-mode test verifies norm(e).
2. **Dropout makes the inputs independent.** In eval mode the first-layer inputs of a batch are
   linearly dependent (token part + position part); with random masks they are not, so the
   numerical rank of the first-layer gradient equals the number of inputs, and the recovered inputs
   X (n, d) determine each input's query gradient: G_q = X^T dQ, solved by least squares. Two inputs
   with the same token at the same position have different masks: when fewer inputs than the rank
   are found, the pursuit is rerun for the found pairs with their known masks held back for its
   first steps; a position-0 input still missing is recovered from its successor's query gradient
   (fact 3, `first_input_plane`).
3. **The query gradient names its own prefix.** In causal attention the gradient of query i is a
   combination of the keys of positions <= i of its own sequence, head by head (softmax and
   attention dropout change the coefficients, not the span). The keys follow from the recovered
   inputs (k = x W_k + b_k). So each input at position p is linked to the prefix, among those ending
   at p - 1, whose keys explain its query gradient (a one-to-one assignment per position; residuals
   ~1e-7 when right). Sequences end where no input continues them; their last token (a label, never
   an input) comes from the final normalisation's gradient as in eval mode.

Nothing here reads the client's data: the dropout rate and the head count come from the server's own
model, the number of inputs from the gradient's rank. Dropout inside the blocks (attention, residual)
does not matter for (1)-(3); it only makes the second-layer test, and the last tokens, inexact.
Bidirectional models (transformer3) get (1) and (2) but no chain (a query sees its whole sequence):
not implemented here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from exact.dager.options import SpanTests
from exact.dager.span import _TINY, SpanBasis, span_basis, token_distances
from exact.layers import DagerLayers, FirstLayerInput


@dataclass
class MaskedInput:
    """One first-layer input recovered with its dropout mask."""

    token: int
    position: int
    dropped: Tensor  #: (d,) bool: the coordinates the client's dropout zeroed
    vector: Tensor  #: (d,) the first-layer input norm(m * e / (1 - p)) (float64)
    distance: float  #: its distance to the first-layer span


def max_dropped(dim: int, rate: float) -> int:
    """The pursuit's budget: the most coordinates a Bernoulli(rate) mask drops, six standard deviations
    up, plus room for a few atoms the greedy pursuit picks wrongly first (GPT-2 B = 8: true inputs
    need 60-113 atoms, the budget is 135; benchmarks/investigations/dager/dropout_dager_diagnostics.py)."""
    mean = rate * dim
    return min(dim - 1, int(math.ceil(mean + 6 * math.sqrt(dim * rate * (1 - rate)) + 8)))


def masked_vectors(inputs: FirstLayerInput, pre_norm: Tensor, dropped: Tensor, rate: float) -> Tensor:
    """The explicit first-layer inputs norm(m * e / (1 - rate)) of pre-norm vectors e (n, d) and masks (n, d)."""
    return inputs.normalise(pre_norm.masked_fill(dropped, 0.0) / (1.0 - rate))


class MaskPursuit:
    """Orthogonal matching pursuit for dropout masks against one first-layer span (fact 1 above).

    `run(e)` takes pre-norm vectors e (n, d) and returns, per vector, the coordinates it dropped (the
    support whose pursuit coefficient is about 1) and the relative residual of the linear problem.
    Vectors are processed together (batched Gram-Schmidt), so a position's candidates cost one pursuit.
    """

    def __init__(self, basis: SpanBasis, inputs: FirstLayerInput, max_atoms: int) -> None:
        dtype = basis.u.dtype
        self.n = basis.complement.to(dtype)  # (d, m)
        d = self.n.shape[0]
        self.centred = inputs.norm == "layernorm"
        norm_on = inputs.norm != "none"
        self.gamma = (inputs.norm_weight.detach().to(self.n) if norm_on and inputs.norm_weight is not None
                      else torch.ones(d, dtype=dtype, device=self.n.device))
        beta = inputs.norm_bias.detach().to(self.n) if self.centred and inputs.norm_bias is not None else None
        self.g = self.gamma @ self.n  # (m,)  N^T gamma: the centring term of every column
        # Columns that are always in (the bias, times the unknown normalisation scale), orthonormalised.
        dense = [] if beta is None or float(beta.norm()) == 0.0 else [beta @ self.n]
        self.dense = torch.linalg.qr(torch.stack(dense, 1)).Q if dense else self.n.new_zeros(self.n.shape[1], 0)
        # ||column j|| / |e_j|: gamma_j N_j - g / d (centred) or gamma_j N_j.
        rows = self.gamma[:, None] * self.n - (self.g[None] / d if self.centred else 0.0)
        self.unit_norms = rows.norm(dim=1).clamp_min(_TINY)
        self.max_atoms = max(1, min(max_atoms, self.n.shape[1] - self.dense.shape[1] - 1))
        self.give_up = 0.05  #: pursuits left above this relative residual report no mask

    def _column(self, e: Tensor, j: Tensor) -> Tensor:
        """(k, m) the columns e_j N^T(gamma * C u_j) of coordinates j (k,) of vectors e (k, d)."""
        col = (e.gather(1, j[:, None]) * self.gamma[j][:, None]) * self.n[j]
        if self.centred:
            col = col - e.gather(1, j[:, None]) * self.g[None] / self.n.shape[0]
        return col

    def run(self, e: Tensor, forbid: Tensor | None = None, forbid_steps: int = 0,
            tol: float = 1e-10, trace: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """e (k, d) pre-norm vectors -> (dropped (k, d) bool, relative residual (k,)).

        `forbid` (k, d) bool: coordinates a vector's pursuit may not choose in its first `forbid_steps`
        steps (to find a second mask: the known masks' coordinates are held back until the pursuit has
        committed to the other mask, then released for the few coordinates both masks drop).
        `trace`: if a list, each step's relative residuals (k,) are appended (diagnostics).
        """
        e = e.to(self.n)
        k, d = e.shape
        target = (self.gamma * (e - e.mean(1, keepdim=True) if self.centred else e)) @ self.n  # (k, m)
        scale = target.norm(dim=1).clamp_min(_TINY)
        q = self.dense[None].expand(k, -1, -1)
        residual = target - (target @ self.dense) @ self.dense.T
        chosen = torch.zeros(k, d, dtype=torch.bool, device=e.device)
        if forbid is not None:
            chosen |= forbid.to(e.device)
        blocked = chosen.clone()
        basis = torch.empty(k, self.n.shape[1], 0, dtype=e.dtype, device=e.device)
        active = torch.ones(k, dtype=torch.bool, device=e.device)
        ar = torch.arange(k, device=e.device)
        for step in range(self.max_atoms):
            if forbid is not None and step == forbid_steps:
                chosen &= ~blocked
                blocked.zero_()
            # <column j, r> = e_j (gamma_j (N r)_j - (g . r) / d) for every coordinate j at once
            nr = residual @ self.n.T  # (k, d)
            corr = self.gamma * nr
            if self.centred:
                corr = corr - (residual @ self.g)[:, None] / d
            score = (e * corr).abs() / (e.abs() * self.unit_norms).clamp_min(_TINY)
            score = score.masked_fill(chosen, -1.0)
            j = score.argmax(1)
            col = self._column(e, j)
            for _ in range(2):  # Gram-Schmidt twice: the basis stays orthonormal to ~1e-15
                col = col - torch.einsum("kmi,ki->km", q, torch.einsum("kmi,km->ki", q, col))
                if basis.shape[2]:
                    col = col - torch.einsum("kmi,ki->km", basis, torch.einsum("kmi,km->ki", basis, col))
            norm = col.norm(dim=1, keepdim=True)
            col = torch.where(norm > 1e-12 * scale[:, None], col / norm.clamp_min(_TINY), torch.zeros_like(col))
            col = col * active[:, None]
            chosen[ar[active], j[active]] = True
            basis = torch.cat([basis, col[:, :, None]], dim=2)
            residual = residual - (residual * col).sum(1, keepdim=True) * col
            if trace is not None:
                trace.append(residual.norm(dim=1) / scale)
            active = active & (residual.norm(dim=1) / scale > tol)
            if not bool(active.any()):
                break
        support = chosen & ~blocked
        relative = residual.norm(dim=1) / scale
        # Only near-solutions can pass the explicit check (its distance is about a third of this
        # residual), so the least-squares read-out of the mask is skipped for the rest.
        support[relative > self.give_up] = False
        return self._dropped(e, target, support), relative

    def _dropped(self, e: Tensor, target: Tensor, support: Tensor) -> Tensor:
        """The coordinates of each support whose least-squares coefficient is about 1 (truly dropped)."""
        dropped = torch.zeros_like(support)
        for i in range(e.shape[0]):
            j = torch.nonzero(support[i]).flatten()
            if j.numel() == 0:
                continue
            cols = self._column(e[i].expand(j.numel(), -1), j).T  # (m, s)
            design = torch.cat([cols, self.dense], dim=1)
            coef = torch.linalg.lstsq(design, target[i][:, None]).solution[: j.numel(), 0]
            dropped[i, j[coef > 0.5]] = True
        return dropped


def find_masked_inputs(
    basis: SpanBasis, inputs: FirstLayerInput, tokens: Tensor, positions: list[int], rate: float,
    threshold: float, expected: int | None = None, chunk: int = 256, pursuit: MaskPursuit | None = None,
) -> tuple[list[MaskedInput], dict]:
    """Every (token, position) pair among `tokens` x `positions` that some dropout mask puts in the span.

    `expected`: the number of inputs (the span's rank); when the distinct pairs found fall short, a
    second mask is sought for each found pair (two sequences sharing a token at a position).
    `pursuit`: one built for `basis` and `rate` already (a caller testing position by position).
    Returns the inputs (sorted by position) and counts for the diagnostics.
    """
    pursuit = pursuit or MaskPursuit(basis, inputs, max_dropped(basis.dim, rate))
    dtype = basis.u.dtype
    found: list[MaskedInput] = []
    tried = 0
    for position in positions:
        pre = inputs.pre_norm(tokens, position, dtype).to(basis.u.device)
        for start in range(0, len(tokens), chunk):
            part = pre[start : start + chunk]
            dropped, _ = pursuit.run(part)
            tried += part.shape[0]
            found += _verified(basis, inputs, part, dropped, tokens[start : start + chunk], position, rate, threshold)
    duplicates = 0
    if expected is not None and len(found) < expected:
        duplicates = _second_masks(basis, inputs, pursuit, found, expected, rate, threshold)
    found.sort(key=lambda m: (m.position, m.token))
    return found, {"pairs_tested": tried, "inputs_found": len(found), "second_masks": duplicates,
                   "max_dropped": pursuit.max_atoms}


def _verified(basis, inputs, pre, dropped, tokens, position, rate, threshold) -> list[MaskedInput]:
    vectors = masked_vectors(inputs, pre, dropped, rate)
    distance = basis.distance(vectors)
    keep = torch.nonzero((distance < threshold) & dropped.any(1)).flatten().tolist()
    return [MaskedInput(int(tokens[i]), position, dropped[i].cpu(), vectors[i], float(distance[i])) for i in keep]


def short_positions(found: list[MaskedInput]) -> set[int]:
    """Positions with fewer inputs than the next one: every sequence that reaches p + 1 has an input at p,
    so an input is missing there (a second copy of a pair, or a token the screen ranked low)."""
    counts: dict[int, int] = {}
    for m in found:
        counts[m.position] = counts.get(m.position, 0) + 1
    return {p for p in counts if counts.get(p + 1, 0) > counts[p]} | ({0} if found and 0 not in counts else set())


def _second_masks(basis, inputs, pursuit: MaskPursuit, found: list[MaskedInput], expected: int, rate: float,
                  threshold: float, tries: int = 3, hold: float = 0.8, apart: float = 0.05) -> int:
    """Further inputs of already found (token, position) pairs (sequences sharing a token at a
    position), until `expected` inputs are found in all. Returns how many were added.

    Pairs are tried where a second copy must be first: positions with fewer inputs than the next one
    (every sequence reaching p + 1 has an input at p), then by how much of the pair's clean input lies
    in the part of the span the found inputs leave unexplained. Each try runs the pursuit with every
    coordinate of the pair's known masks held back for its first `hold` * (1, 2, 3) / `tries` of a
    mask's expected size, so that it commits to another mask before they are released (two masks share
    about rate^2 * d coordinates); after `tries` failures only a random half is held back (a new mask
    may share many of them). A short position gets four times the tries. A new input counts only if
    it lies more than `apart` outside the span of the pair's known inputs (not the same input again
    with a near-zero coordinate changed).
    """
    dtype, device = basis.u.dtype, basis.u.device
    short = short_positions(found)
    known = torch.linalg.qr(torch.stack([m.vector for m in found], 1).to(device)).Q  # (d, n)
    left = basis.range - known @ (known.T @ basis.range)
    left = torch.linalg.svd(left, full_matrices=False).U[:, : max(1, basis.rank - len(found))]
    pairs = sorted({(m.token, m.position) for m in found})
    clean = torch.stack([inputs(torch.tensor([t], device=inputs.embedding.device), p, dtype)[0] for t, p in pairs]).to(device)
    score = (clean @ left).norm(dim=1) / clean.norm(dim=1)
    order = sorted(range(len(pairs)), key=lambda i: (pairs[i][1] not in short, -float(score[i])))
    generator = torch.Generator().manual_seed(0)
    added = 0
    for index in order:
        token, position = pairs[index]
        pre = inputs.pre_norm(torch.tensor([token], device=inputs.embedding.device), position, dtype).to(device)
        copies = [m for m in found if m.token == token and m.position == position]
        failures, budget = 0, tries * (4 if position in short else 1)  # a short position surely has copies
        while len(found) < expected and failures < budget:
            forbid = torch.zeros(1, basis.dim, dtype=torch.bool, device=device)
            for m in copies:
                forbid[0] |= m.dropped.to(device)
            if failures >= tries:  # later tries hold back a random half: the new mask may share many of them
                forbid &= torch.rand(forbid.shape, generator=generator).to(device) < 0.5
            steps = max(1, int(hold * (1 + failures % tries) / tries * rate * basis.dim))
            dropped, _ = pursuit.run(pre, forbid=forbid, forbid_steps=steps)
            new = _verified(basis, inputs, pre, dropped, torch.tensor([token]), position, rate, threshold)
            if new:
                span = torch.linalg.qr(torch.stack([m.vector for m in copies], 1)).Q
                v = new[0].vector
                if float((v - span @ (span.T @ v)).norm() / v.norm()) > apart:
                    found.append(new[0])
                    copies.append(new[0])
                    added += 1
                    failures = 0
                    continue
            failures += 1
        if len(found) >= expected:
            break
    return added


def first_input_plane(dq_child: Tensor, key_child: Tensor, basis: SpanBasis, key_weight: Tensor,
                      key_bias: Tensor | None, heads: int) -> Tensor:
    """Where the missing position-0 input of a sequence lies, given its position-1 input (the child).

    Causal attention: the child's query gradient lies, head by head, in span{k_0, k_1}; so the parent's
    key k_0 = x_0 W_k + b_k lies in span{dq_1, k_1} for every head, with x_0 in the first-layer span.
    That is linear in x_0 (and the bias's factor); its solutions are the child's own input (k_1 is in
    the plane trivially) and the parent's. Returns an orthonormal (d, 2) basis of their plane.
    """
    width = key_weight.shape[1]
    size = width // heads
    rows, rhs = [], []
    span = basis.range  # (d, r)
    for h in range(heads):
        sl = slice(h * size, (h + 1) * size)
        plane = torch.linalg.qr(torch.stack([dq_child[sl], key_child[sl]], 1)).Q  # (size, 2)
        away = torch.eye(size, dtype=span.dtype, device=span.device) - plane @ plane.T
        rows.append(away @ key_weight[:, sl].T @ span)  # (size, r)
        rhs.append(away @ (key_bias[sl] if key_bias is not None else torch.zeros(size, dtype=span.dtype)))
    system, bias = torch.cat(rows), torch.cat(rhs)
    if float(bias.norm()) > 0:  # [system, bias] [a; s] = 0: the parent and the child, each with s = 1
        system = torch.cat([system, bias[:, None]], 1)
    null = torch.linalg.svd(system, full_matrices=False).Vh[-2:, : span.shape[1]].T  # (r, 2)
    return torch.linalg.qr(span @ null).Q


def query_gradients(vectors: Tensor, query_block: Tensor) -> tuple[Tensor, float]:
    """Each input's query gradient from G_q = X^T dQ (fact 2): (n, width) and the relative fit residual."""
    x = vectors.T  # (d, n)
    solution = torch.linalg.lstsq(x, query_block.to(x)).solution  # (n, width)
    fit = float((x @ solution - query_block.to(x)).norm() / query_block.norm().clamp_min(_TINY))
    return solution, fit


def span_residual(query: Tensor, keys: Tensor, heads: int) -> Tensor:
    """Per head, the relative residual of a query gradient (width,) in the span of keys (k, width): (heads,)."""
    width = query.shape[0]
    size = width // heads
    q = query.view(heads, size)  # (h, s)
    k = keys.view(keys.shape[0], heads, size).permute(1, 2, 0)  # (h, s, k)
    coef = torch.linalg.lstsq(k, q[:, :, None]).solution
    residual = (k @ coef)[:, :, 0] - q
    return residual.norm(dim=1) / q.norm(dim=1).clamp_min(_TINY)


def chain(found: list[MaskedInput], dq: Tensor, keys: Tensor, heads: int,
          orphans: list[int] | None = None) -> tuple[list[list[int]], list[float], list[str]]:
    """Fact 3: link the inputs into sequences, position by position (one-to-one assignment).

    Returns the sequences of input tokens (without their last token), each sequence's worst link score
    (the median over heads of the relative residual, ~1e-7 when exact) and notes on what went wrong.
    `orphans`, if a list, receives the indices (into `found`) of inputs left without a predecessor.
    """
    from scipy.optimize import linear_sum_assignment

    notes: list[str] = []
    size = keys.shape[1] // heads
    by_position: dict[int, list[int]] = {}
    for i, item in enumerate(found):
        by_position.setdefault(item.position, []).append(i)
    if not by_position or min(by_position) != 0:
        return [], [], ["no input at position 0"]
    members: list[list[int]] = [[i] for i in by_position[0]]  # indices into `found`, one list per sequence
    worst = [0.0] * len(members)
    open_ = list(range(len(members)))  # sequences still being extended
    for position in range(1, max(by_position) + 1):
        children = by_position.get(position, [])
        if not children:
            break
        if len(children) > len(open_):
            notes.append(f"position {position}: {len(children)} inputs for {len(open_)} open sequences")
        if position + 1 > size:
            notes.append(f"position {position}: {position + 1} keys fill a head of {size}; linked without a test")
        cost = torch.ones(len(children), len(open_), dtype=dq.dtype)
        for a, child in enumerate(children):
            for b, s in enumerate(open_):
                if position + 1 > size:
                    cost[a, b] = float(b != a)
                    continue
                rows = members[s] + [child]
                cost[a, b] = span_residual(dq[child], keys[rows], heads).median()
        rows_, cols_ = linear_sum_assignment(cost.numpy())
        extended = []
        for a, b in zip(rows_.tolist(), cols_.tolist()):
            s = open_[b]
            members[s].append(children[a])
            worst[s] = max(worst[s], float(cost[a, b]))
            extended.append(s)
        for a in set(range(len(children))) - set(rows_.tolist()):  # more inputs than sequences: start new ones
            members.append([children[a]])
            if orphans is not None:
                orphans.append(children[a])
            worst.append(1.0)
            extended.append(len(members) - 1)
        open_ = extended
    sequences = [[found[i].token for i in m] for m in members]
    return sequences, worst, notes


def batch_tokens(basis: SpanBasis, inputs: FirstLayerInput, positions: list[int], limit: int,
                 chunk: int = 8192) -> tuple[Tensor, int]:
    """The tokens worth a mask pursuit, most promising first, and how many of them to try first.

    A masked input is about sqrt(rate) away from its clean self; other vocabulary tokens are further
    (GPT-2 B = 8, rate 0.1: the batch's tokens at most 0.32, every other token at least 0.55). The
    tokens are ranked by their least clean distance over `positions`; the first cut is at the largest
    gap among the first `limit` + 1 (a batch has at most `limit` = rank distinct input tokens). The
    caller tries the rest of the list (4 * (`limit` + 1) tokens) when the inputs found fall short: in a
    narrow model a masked input's clean distance is no longer far below a random token's.
    """
    least = token_distances(basis, inputs, positions, chunk, basis.u.dtype).min(dim=0).values
    values, order = torch.sort(least)
    head = values[: limit + 1]
    cut = int((head[1:] - head[:-1]).argmax()) + 1 if head.numel() > 1 else head.numel()
    return order[: 4 * (limit + 1)].cpu(), cut


def _identify(basis: SpanBasis, inputs: FirstLayerInput, plane: Tensor, child: Tensor, tokens: Tensor, rate: float,
              threshold: float) -> MaskedInput | None:
    """The (token, mask) at position 0 whose input lies in `plane` (from `first_input_plane`) and is not
    the child's input: the token whose clean input is most aligned with the plane's direction away
    from the child, its mask by the pursuit against the plane, verified against the first-layer span."""
    c = plane.T @ child.to(plane)
    away = plane @ torch.stack([-c[1], c[0]])  # the plane's direction orthogonal to the child
    clean = inputs(tokens.to(inputs.embedding.device), 0, plane.dtype).to(plane.device)
    cosine = (clean @ away).abs() / (clean.norm(dim=1) * away.norm()).clamp_min(_TINY)
    best = int(cosine.argmax())
    pre = inputs.pre_norm(tokens[best : best + 1].to(inputs.embedding.device), 0, plane.dtype).to(plane.device)
    dropped, _ = MaskPursuit(span_basis(plane, dtype=plane.dtype), inputs, max_dropped(basis.dim, rate)).run(pre)
    found = _verified(basis, inputs, pre, dropped, tokens[best : best + 1], 0, rate, threshold)
    return found[0] if found else None


@dataclass
class DropoutChains:
    """The sequences chained from the masked inputs (without their last token, a label)."""

    sequences: list[list[int]]
    #: Per sequence, its worst link's score.
    link_scores: list[float]
    #: Why the chains cannot be certified (empty when the inputs and links are).
    flags: list[str]


def dropout_attack(
    target: nn.Module, layers: DagerLayers, update: Mapping[str, Tensor], basis1: SpanBasis, steps: int,
    batch_size: int | None, span: SpanTests, vocab_chunk: int, diag: dict[str, Any],
) -> DropoutChains | None:
    """Sequences of a train-mode client with embedding dropout (module docstring), or None.

    Reads `update` and the first-layer span `basis1` of `target` (its `layers`) at the `steps` input
    positions, with the thresholds of `span`, `vocab_chunk` vocabulary tokens at a time; records
    what it found in `diag`. Returns the chained sequences when the inputs were found and chained,
    None when the premises do not hold (then the relaxed best effort runs as before).
    """
    inputs, rate, heads = layers.inputs, layers.embedding_dropout, layers.first_heads
    key_block = layers.first.key_value[0] if layers.first.key_value else None
    if (heads is None or key_block is None or key_block.param_name not in dict(target.named_parameters())
            or layers.first.query.param_name not in update):  # e.g. a LoRA client: no query-weight gradient to solve
        return None
    expected = basis1.rank
    ranked, cut = batch_tokens(basis1, inputs, list(range(steps)), expected, vocab_chunk)
    pursuit = MaskPursuit(basis1, inputs, max_dropped(basis1.dim, rate))
    info: dict = {"pairs_tested": 0, "second_masks": 0, "max_dropped": pursuit.max_atoms}
    found: list[MaskedInput] = []
    tried = 0
    tested: dict[int, set[int]] = {}  # position -> tokens already pursued there
    for end in (cut, expected + 1, ranked.numel()):  # the likely batch tokens first, more while inputs are missing
        if tried and len(found) >= expected:
            break
        tried = min(end, ranked.numel())
        short = short_positions(found)
        for position in (sorted(short) if short else range(steps)):  # contiguous from 0: stop at an empty position
            done = tested.setdefault(position, set())
            new = torch.tensor([t for t in ranked[:end].tolist() if t not in done], dtype=torch.long)
            if new.numel():
                here, part = find_masked_inputs(basis1, inputs, new, [position], rate, span.l1_threshold,
                                                  pursuit=pursuit)
                info["pairs_tested"] += part["pairs_tested"]
                found += here
                done.update(new.tolist())
            if not any(m.position == position for m in found):
                break
        if found and len(found) < expected:
            info["second_masks"] += _second_masks(basis1, inputs, pursuit, found, expected, rate, span.l1_threshold)
    found.sort(key=lambda m: (m.position, m.token))
    diag.update(dropout_inputs=len(found), dropout_inputs_expected=expected)
    if len(found) < expected / 2:  # the premises do not hold (another kind of noise): leave it to the best effort
        return None
    vectors = torch.stack([m.vector for m in found])
    query = layers.first.query.input_space(update[layers.first.query.param_name])
    dq, fit = query_gradients(vectors, query)
    params = dict(target.named_parameters())
    weight = key_block.input_space(params[key_block.param_name].detach().to(vectors))
    bias_name = key_block.param_name.rsplit(".", 1)[0] + (".in_proj_bias" if key_block.param_name.endswith("in_proj_weight") else ".bias")
    bias = params[bias_name].detach().to(vectors)[key_block.start : key_block.stop] if bias_name in params else None
    keys = vectors @ weight + (bias if bias is not None else 0)
    orphans: list[int] = []
    seqs, worst, notes = chain(found, dq, keys, heads, orphans)
    repaired = 0
    for child in [i for i in orphans if found[i].position == 1]:
        plane = first_input_plane(dq[child], keys[child], basis1, weight, bias, heads)
        item = _identify(basis1, inputs, plane, vectors[child], ranked, rate, span.l1_threshold)
        if item is not None and all(float((m.vector - item.vector).norm() / item.vector.norm()) > 1e-3
                                    for m in found if m.position == 0):
            found.append(item)
            repaired += 1
    if repaired:
        found.sort(key=lambda m: (m.position, m.token))
        vectors = torch.stack([m.vector for m in found])
        dq, fit = query_gradients(vectors, query)
        keys = vectors @ weight + (bias if bias is not None else 0)
        seqs, worst, notes = chain(found, dq, keys, heads)
        diag["dropout_inputs"] = len(found)
    diag["dropout_repaired_first_inputs"] = repaired
    diag.update(
        mode="dropout", dropout_rate=rate, dropout_tokens_tried=tried,
        dropout_fit=fit,
        dropout_link_scores=[float(w) for w in worst], **{f"dropout_{k}": v for k, v in info.items()},
    )
    if not seqs:
        return None
    flags: list[str] = []  # the strict attempt's flags describe a test that cannot pass under dropout
    flags += notes
    if len(found) != expected:
        flags.append(f"found {len(found)} masked inputs for a first-layer rank of {expected}")
    if fit > span.coverage_tol:
        flags.append(f"the recovered inputs leave {fit:.1e} of the query gradient unexplained")
    loose = [w for w in worst if w > span.l2_threshold]
    if loose:
        flags.append(f"{len(loose)} sequences have a link above {span.l2_threshold:.0e} (worst {max(loose):.1e})")
    if batch_size is not None and len(seqs) != batch_size:
        flags.append(f"chained {len(seqs)} sequences for a batch of {batch_size}")
    diag["dropout_inputs_certified"] = not flags
    return DropoutChains(seqs, worst, flags)
