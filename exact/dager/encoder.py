"""DAGER step 3 for bidirectional (encoder) models: a bounded search over per-position candidates.

Every position's candidates, one group of sequences per length (sequences end where the
end-of-sequence token passes), then a bounded search over combinations scored by the second-layer
distance: exhaustive when small, otherwise a left-to-right beam search that ranks prefixes by the
second-layer distance of the prefix run alone (a heuristic: only the exact score of complete
sequences decides what passes), then coordinate descent with restarts seeded by the beam, then
"peeling" of what was found.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from exact.dager.options import EncoderOptions
from exact.dager.probe import SecondLayerProbe, _ResidualSpan


class EncoderSearch:
    """One update's bidirectional search, with its token budget.

    A sequence passes below `l2_threshold`. `spent` counts the tokens run through block 1 by this
    search (bounded by `options.token_budget`); `exhausted` records that some part of the search
    stopped at its budget.
    """

    def __init__(self, options: EncoderOptions, l2_threshold: float) -> None:
        self.options = options
        self.l2_threshold = l2_threshold
        self.spent = 0
        self.exhausted = False

    def search(self, probe: SecondLayerProbe, candidates: list[Tensor], batch_size: int | None):
        """Sequences over per-position candidates, scored by their largest second-layer distance.

        Sequences end where the end-of-sequence token passes (one group per length; without an
        end-of-sequence token, one group of full length). Groups small enough are searched
        exhaustively. Otherwise, first pass: a prefix beam search (`prefix_beam`) of every group,
        cheap, within half of the search budget. Second pass, while fewer than `batch_size` sequences
        pass: restarted coordinate descent on the groups still without a passing sequence, seeded by
        the beam's best sequences, sharing the first three quarters of the budget. Third pass
        ("peeling"): the groups still without one are searched again against the part of the
        second-layer span that the sequences found so far do not explain, so that a search can no
        longer settle on copies of what was already found. Every pass stops once `batch_size`
        sequences pass (the certificate, `DagerRun._select`, then checks that they explain both gradients).
        """
        options = self.options
        eos, threshold, budget = options.eos_token_id, self.l2_threshold, options.token_budget
        lengths = [len(candidates)]
        if eos is not None:
            ends = [p + 1 for p, c in enumerate(candidates) if (c == eos).any()]
            lengths = ends or lengths
        groups = []
        for length in lengths:
            cands = [c.cpu() for c in candidates[:length]]
            if eos is not None and (cands[-1] == eos).any():
                cands[-1] = torch.tensor([eos])
            groups.append(cands)
        want = 1 if len(groups) > 1 else (batch_size or 1)
        found: dict[tuple[int, ...], float] = {}
        by_group: list[list[list[int]]] = [[] for _ in groups]
        satisfied = [False] * len(groups)

        def merge(i: int, seqs, scores) -> None:
            for s, sc in zip(seqs, scores):
                found[tuple(s)] = min(sc, found.get(tuple(s), math.inf))
            by_group[i] += [list(s) for s in seqs]
            satisfied[i] = satisfied[i] or sum(1 for sc in scores if sc < threshold) >= want

        def enough() -> bool:
            passing = sum(1 for sc in found.values() if sc < threshold)
            return batch_size is not None and passing >= batch_size

        small = [math.prod(c.numel() for c in cands) <= options.max_combinations for cands in groups]
        for i, cands in enumerate(groups):  # exhaustive where small
            if small[i]:
                merge(i, *self.search_length(probe, cands, want, budget))
        # Beam search of every other group: narrow first (cheap; usually enough), then full width.
        widths = sorted({max(1, options.beam // 4), options.beam}) if options.beam > 0 else []
        for w, width in enumerate(widths):
            beam_budget = budget * (w + 1) // (2 * len(widths))
            todo = [i for i in range(len(groups)) if not small[i] and not satisfied[i]]
            for n, i in enumerate(todo):
                if enough():
                    break
                share = (beam_budget - self.spent) // (len(todo) - n)
                merge(i, *self.prefix_beam(probe, groups[i], want, self.spent + max(0, share), width))
        first_pass = budget * 3 // 4
        todo = [i for i in range(len(groups)) if not small[i] and not satisfied[i]]
        best = [min((found[tuple(s)] for s in by_group[i]), default=math.inf) for i in range(len(groups))]
        todo.sort(key=lambda i: best[i])  # the groups whose beam came closest first
        for n, i in enumerate(todo):  # coordinate descent, seeded by the beam
            if enough():
                break
            share = (first_pass - self.spent) // (len(todo) - n)
            initial = sorted(by_group[i], key=lambda s: found[tuple(s)])
            merge(i, *self.search_length(probe, groups[i], want, self.spent + max(0, share), initial))
        for i, cands in enumerate(groups):
            passing = [list(s) for s, sc in found.items() if sc < threshold]
            if satisfied[i] or not passing or enough():
                continue
            residual = _ResidualSpan(probe, passing)
            if residual.rank == 0:
                continue
            peeled = SecondLayerProbe(probe.target, probe.layers, residual, probe.token_budget)
            remaining = [j for j in range(len(groups)) if not satisfied[j] and j >= i]
            share = (budget - self.spent) // max(1, len(remaining))
            seqs, _ = self.coordinate_descent(peeled, cands, want, limit=self.spent + share)
            probe.evaluations += peeled.evaluations
            if seqs:  # re-check against the full second-layer span
                check = probe.full(torch.tensor(seqs, dtype=torch.long)).max(dim=1).values
                for s, sc in zip(seqs, check.tolist()):
                    found[tuple(s)] = min(sc, found.get(tuple(s), math.inf))
                satisfied[i] = bool((check < threshold).sum() >= want)
        ranked = sorted(found.items(), key=lambda item: item[1])
        return [list(s) for s, _ in ranked], [sc for _, sc in ranked]

    def search_length(self, probe: SecondLayerProbe, cands: list[Tensor], want: int, limit: int, initial=None):
        """One length group: every combination when there are at most `options.max_combinations`,
        otherwise coordinate descent (seeded by the sequences `initial`)."""
        sizes = [c.numel() for c in cands]
        total = math.prod(sizes)
        if total <= self.options.max_combinations:
            grid = torch.tensor(list(itertools.product(*[range(k) for k in sizes])), dtype=torch.long)
            if grid.dim() == 1:
                grid = grid[:, None]
            seqs = torch.stack([cands[p][grid[:, p]] for p in range(len(cands))], dim=1)
            dist = probe.full(seqs)
            self.spent += seqs.numel()
            score = dist.max(dim=1).values
            order = torch.argsort(score)
            return [seqs[i].tolist() for i in order], [float(score[i]) for i in order]
        return self.coordinate_descent(probe, cands, want, limit=limit, initial=initial)

    def prefix_beam(self, probe: SecondLayerProbe, cands: list[Tensor], want: int, limit: int, width: int | None = None):
        """Left-to-right beam search over per-position candidates, for bidirectional models.

        A bidirectional model's second-layer input depends on the whole sequence, so a prefix cannot
        be checked exactly. But block 1 run on the prefix alone (closed by the end-of-sequence token
        when there is one) already puts the right token's second-layer input much closer to the span
        than a wrong one's (pretrained MiniLM: ~0.1 against 0.2-0.3): each prefix is extended by every
        candidate of the next position, the extensions are ranked by the mean second-layer distance
        over their positions, and the `width` (default `options.beam`) best are kept. The complete
        sequences are then scored exactly (largest second-layer distance of the full sequence); only
        these exact scores decide what passes, so the heuristic ranking can cost recall, never
        correctness.
        """
        length = len(cands)
        eos = self.options.eos_token_id
        closing = eos is not None and int(cands[-1].numel()) == 1 and int(cands[-1][0]) == eos
        # Tokens run per unit of width (every step runs width x candidates sequences of length p + 2):
        # the width shrinks to fit the budget, down to 2 * want; below that the beam is skipped.
        per_width = sum(int(c.numel()) * (p + 2) for p, c in enumerate(cands)) + length
        width = self.options.beam if width is None else width
        width = min(max(width, 2 * (want or 1)), max(0, limit - self.spent) // per_width)
        if width < 2 * (want or 1):
            self.exhausted = True
            return [], []
        prefixes = torch.empty(1, 0, dtype=torch.long)
        for p in range(length):
            cand = cands[p].cpu()
            k = cand.numel()
            n = prefixes.shape[0]
            ext = torch.cat([prefixes.repeat_interleave(k, dim=0), cand.repeat(n)[:, None]], dim=1)
            ids = ext
            if closing and p < length - 1:
                ids = torch.cat([ext, torch.full((ext.shape[0], 1), eos, dtype=torch.long)], dim=1)
            if self.spent + ids.numel() > limit:
                self.exhausted = True
                return [], []
            dist = probe.full(ids)[:, : p + 1]
            self.spent += ids.numel()
            score = dist.mean(dim=1)
            keep = torch.argsort(score)[:width]
            prefixes = ext[keep]
        exact = probe.full(prefixes).max(dim=1).values
        self.spent += prefixes.numel()
        order = torch.argsort(exact)
        return [prefixes[i].tolist() for i in order], [float(exact[i]) for i in order]

    def coordinate_descent(
        self, probe: SecondLayerProbe, cands: list[Tensor], want: int | None, prior: list[Tensor] | None = None,
        limit: int | None = None, rounds: int = 256, initial: list[list[int]] | None = None,
    ):
        """Bounded search: rounds of restarted coordinate descent on the mean second-layer distance
        (plus, in relaxed mode, the mean first-layer distance `prior` of the chosen candidates).

        Each sweep visits every position and, for every restart whose second-layer input there is not
        yet in the span, tries all candidates of that position with the other positions held fixed.
        Restarts begin from random candidates, avoiding the tokens of sequences already found. Rounds
        continue until `want` sequences pass or `limit` tokens (default: `options.token_budget`) have
        been run through block 1 by the search.
        """
        options = self.options
        gen = torch.Generator().manual_seed(options.seed)
        length = len(cands)
        sizes = torch.tensor([c.numel() for c in cands])
        want = want or 1
        limit = options.token_budget if limit is None else min(limit, options.token_budget)
        restarts = options.restarts or want + 3
        table = torch.full((length, int(sizes.max())), -1, dtype=torch.long)
        first = torch.zeros(length, int(sizes.max()), dtype=probe.basis.u.dtype)
        for p, c in enumerate(cands):
            table[p, : c.numel()] = c
            if prior is not None:
                first[p, : c.numel()] = prior[p].to(first.dtype).cpu()
        positions = torch.arange(length)
        found: dict[tuple[int, ...], float] = {}

        def evaluate(pk: Tensor) -> tuple[Tensor, Tensor]:
            """(objective, per-position distances) of the sequences given by candidate indices `pk`."""
            dist = probe.full(table[positions[None], pk]).to(first.dtype)
            self.spent += pk.shape[0] * length
            return dist.mean(dim=1) + first[positions[None], pk].mean(dim=1), dist

        exhausted = False

        def affordable(rows: int) -> bool:
            nonlocal exhausted
            if self.spent + rows * length > limit:
                exhausted = self.exhausted = True
                return False
            return True

        for _round in range(rounds):
            if not affordable(restarts):
                break
            used = torch.zeros(length, int(sizes.max()), dtype=torch.bool)  # tokens of found sequences
            for seq, worst in found.items():
                if worst < self.l2_threshold:
                    used[positions, [int((table[p] == t).nonzero()[0]) for p, t in enumerate(seq)]] = True
            weights = (~used[:, : int(sizes.max())]).float() * (torch.arange(int(sizes.max()))[None] < sizes[:, None])
            weights[weights.sum(1) == 0] = (torch.arange(int(sizes.max()))[None] < sizes[weights.sum(1) == 0, None]).float()
            picks = torch.multinomial(weights, restarts, replacement=True, generator=gen).T.contiguous()
            if _round == 0 and initial:  # seeded restarts: candidate indices of the given sequences
                seeds = [
                    [int((table[p] == t).nonzero()[0]) for p, t in enumerate(seq)]
                    for seq in initial[:restarts]
                    if len(seq) == length and all(bool((table[p] == t).any()) for p, t in enumerate(seq))
                ]
                if seeds:
                    picks[: len(seeds)] = torch.tensor(seeds, dtype=torch.long)
            current, per_position = evaluate(picks)
            for _ in range(options.max_sweeps):
                changed = False
                for p in range(length):
                    k = int(sizes[p])
                    active = torch.nonzero(per_position[:, p] >= self.l2_threshold).flatten()
                    if k == 1 or active.numel() == 0:
                        continue
                    if not affordable(active.numel() * k):
                        break
                    trial = picks[active].repeat_interleave(k, dim=0)
                    trial[:, p] = torch.arange(k).repeat(active.numel())
                    objective, dist = evaluate(trial)
                    objective = objective.view(active.numel(), k)
                    best = objective.argmin(dim=1)
                    rows = torch.arange(active.numel())
                    better = objective[rows, best] < current[active] - 1e-12
                    if better.any():
                        changed = True
                        who = active[better]
                        picks[who, p] = best[better]
                        current[who] = objective[rows, best][better]
                        per_position[who] = dist.view(active.numel(), k, length)[rows, best][better]
                if exhausted or not changed:
                    break
            worst = per_position.max(dim=1).values
            seqs = table[positions[None], picks]
            for seq, w in zip(seqs.tolist(), worst.tolist()):
                key = tuple(seq)
                found[key] = min(w, found.get(key, math.inf))
            passing = sum(1 for w in found.values() if w < self.l2_threshold)
            if passing >= want or exhausted or _round + 1 >= rounds:
                break
        ranked = sorted(found.items(), key=lambda item: item[1])
        return [list(s) for s, _ in ranked], [w for _, w in ranked]
