"""One DAGER attack on one client update: the spans, the strict (exact) path and the relaxed one.

`Dager.attack` builds a `DagerRun` for each update; it holds everything that belongs to that call
(the options, the model, its layers, the update, the protocol's batch size and length, the
diagnostics and the flags that keep a result from being certified), so the configuration is never
written to. Each step (`causal`, `encoder`, `dropout`, `last_token`) is handed the groups of options
it reads, the layers and probe it uses and the flags it may add to, and returns what it found.

Degenerate inputs (rank 0, a span of full rank because B*L >= d, no candidate passing, missing
parameters) never raise: a best-effort result is returned with `exact=False` and the reason in the
diagnostics. When the strict test finds nothing (noise, sign, pruning, dropout) and `relaxed.enabled`,
a best-effort reconstruction ranks tokens by distance instead of thresholding them, against a span
truncated to the largest rank the protocol allows (B * L).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from exact.dager.causal import causal_search
from exact.dager.dropout import dropout_attack
from exact.dager.encoder import EncoderSearch
from exact.dager.feasibility import first_layer_blind
from exact.dager.last_token import recover_last_tokens
from exact.dager.options import DagerOptions
from exact.dager.position_split import PositionSplit, split_first_layer
from exact.dager.probe import SecondLayerProbe
from exact.dager.result import DagerResult, degenerate
from exact.dager.span import _TINY, SpanBasis, _orthonormal_complement, span_basis, token_distances
from exact.layers import DagerLayers


class DagerRun:
    """The state of one attack call: `execute()` returns its `DagerResult`."""

    def __init__(
        self, options: DagerOptions, target: nn.Module, layers: DagerLayers, update: Mapping[str, Tensor],
        batch_size: int | None, max_length: int | None, diag: dict[str, Any], trajectory: tuple[float, ...] = (),
    ) -> None:
        self.options = options
        self.target = target
        self.layers = layers
        self.update = update
        self.trajectory = trajectory  #: step offsets of a multi-step client's local gradients (`SecondLayerProbe`)
        self.batch_size = batch_size
        inputs = layers.inputs
        if max_length is None:
            max_length = inputs.num_positions or 64
        if inputs.num_positions is not None:
            max_length = min(max_length, inputs.num_positions)
        self.max_length = max_length  #: the protocol's length, within the model's positions
        self.diag = diag
        self.flags: list[str] = []  #: reasons the result cannot be certified
        self.split: PositionSplit | None = None  #: an encoder's first-layer split, where it was blind
        self.g1: Tensor | None = None  #: the first-layer gradient blocks (d, width), as read from the update

    def execute(self) -> DagerResult:
        options, layers, update, diag = self.options, self.layers, self.update, self.diag
        span = options.span
        batch_size, max_length = self.batch_size, self.max_length
        inputs = layers.inputs
        device = inputs.embedding.device
        d = inputs.dim
        g1 = layers.first.input_space(update, span.blocks)
        g2 = layers.second.input_space(update, span.blocks)
        if g1 is None or g2 is None:
            needed = [n for n in layers.first.names(span.blocks) + layers.second.names(span.blocks) if n not in update]
            return degenerate(diag, f"update lacks {needed}; observe the first two attention layers")
        g1, g2 = g1.to(device), g2.to(device)
        self.g1 = g1
        visible = max_length - 1 if layers.causal else max_length
        cap = None if batch_size is None else max(1, batch_size * max(1, visible))
        basis1 = span_basis(g1, span.rank_tol, None, span.torch_dtype)
        basis2 = span_basis(g2, span.rank_tol, None, span.torch_dtype)
        r1, r2 = basis1.numerical_rank, basis2.numerical_rank
        diag.update(
            rank1=r1, rank2=r2, dim=d, rank_cap=cap, rank_tol=span.rank_tol,
            l1_threshold=span.l1_threshold, l2_threshold=span.l2_threshold,
        )
        if r1 == 0 or r2 == 0:
            return degenerate(diag, "gradient of rank 0 (nothing observed, or pruned away)")
        if cap is not None and max(r1, r2) > cap:
            # More directions than the protocol's tokens: noise (or a too tight rank_tol). Keep the top ones.
            self.flags.append(f"numerical ranks ({r1}, {r2}) exceed B*L = {cap}: truncated, not certifiable")
        r1, r2 = min(r1, cap or d), min(r2, cap or d)
        basis1, basis2 = basis1.with_rank(r1), basis2.with_rank(r2)
        if r1 < d and r2 <= d - span.min_codimension:
            result = self._strict(basis1, basis2)
            if result is not None and self._short_encoder_result(result):
                strict_flags = list(diag.get("flags", []))  # the relaxed pass rewrites the shared diagnostics
                return self._completed(result, strict_flags, self._relaxed(basis1, basis2))
            if result is not None:
                return result
        else:
            diag["reason"] = (
                f"span (nearly) full: ranks {r1}, {r2} of d = {d} (B*L >= d, or noise); a random vector would "
                f"pass the second-layer test by chance"
            )
        masked = options.extensions.dropout_search and layers.embedding_dropout > 0
        if masked and layers.causal and not layers.rope and r1 < d:
            # A train-mode client masked its first-layer inputs: find the masks, chain by the keys.
            result = self._dropout(basis1)
            if result is not None:
                return result
        if not options.relaxed.enabled or min(r1, r2, d - 1) <= 0:
            return degenerate(diag, diag.get("reason", "no sequence passed the span tests"))
        # Best effort: the span truncated below d, tokens ranked by distance instead of thresholded.
        span2 = max(1, min(r2, d - 1, int(options.relaxed.span_fraction * d)))
        basis1, basis2 = basis1.with_rank(min(r1, d - 1)), basis2.with_rank(span2)
        diag.update(relaxed_rank1=basis1.rank, relaxed_rank2=basis2.rank)
        return self._relaxed(basis1, basis2)

    def _probe(self, basis2: SpanBasis) -> SecondLayerProbe:
        probe = SecondLayerProbe(self.target, self.layers, basis2, self.options.budgets.probe_tokens, self.update,
                                 self.trajectory)
        if self.trajectory:
            self.diag["trajectory_points"] = 1 + len(probe.trajectory)
        return probe

    def _last_tokens(self, seqs: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
        """Each causal sequence with its last token (`last_token`), and whether each is certified."""
        options = self.options
        seqs, certified, residual = recover_last_tokens(
            seqs, self.target, self.layers, self.update, self.batch_size, options.causal,
            options.span.torch_dtype, options.budgets.probe_tokens, self.flags,
        )
        if residual is not None:
            self.diag["last_token_residual"] = residual
        return seqs, certified

    def _dropout(self, basis1: SpanBasis) -> DagerResult | None:
        """The sequences of a train-mode client, from its masked first-layer inputs (`dropout`), or None."""
        options, diag = self.options, self.diag
        chains = dropout_attack(self.target, self.layers, self.update, basis1,
                                self.max_length - 1,  # a causal model's last position is never an input
                                self.batch_size, options.span, options.budgets.vocab_chunk, diag)
        if chains is None:
            return None
        flags = self.flags = chains.flags
        seqs, last_ok = self._last_tokens(chains.sequences)
        diag["flags"] = flags
        exact = bool(seqs) and all(last_ok) and not flags
        return DagerResult(seqs, exact, list(last_ok) if not flags else [False] * len(seqs), chains.link_scores, diag)

    # ------------------------------------------------------------------------------------------------------
    # Strict (exact) path

    def _strict(self, basis1: SpanBasis, basis2: SpanBasis) -> DagerResult | None:
        options, layers, diag, flags, batch_size = self.options, self.layers, self.diag, self.flags, self.batch_size
        span, dtype = options.span, options.span.torch_dtype
        inputs = layers.inputs
        # 1. first-layer candidates, position by position (one unordered set for RoPE models)
        candidates: list[Tensor] = []
        positions: list[int | None] = [None] if layers.rope else list(range(self.max_length))
        block = 32
        for start in range(0, len(positions), block):
            chunk = positions[start : start + block]
            dist = token_distances(basis1, inputs, chunk, options.budgets.vocab_chunk, dtype)
            stop = False
            for row, pos in zip(dist, chunk):
                ids = self._passing(row, basis1, pos)
                if ids.numel() == 0:
                    stop = True
                    break
                candidates.append(ids)
            if stop:
                break
        diag["candidates_per_position"] = [int(c.numel()) for c in candidates]  # the first layer's (the notes read them)
        blind = first_layer_blind(diag["candidates_per_position"], batch_size)
        if candidates and not layers.causal and options.encoder.split_positions and blind:
            # An encoder's first layer is blind to positions once the batch's (token, position) pairs
            # outnumber its tokens plus positions; the split of the gradient itself still places most tokens.
            split = split_first_layer(self.g1, inputs, torch.unique(torch.cat(candidates)), len(candidates), dtype)
            if split is not None:
                self.split = split
                diag["position_split"] = split.summary()
                candidates = split.candidates(candidates)
                split_width = options.encoder.split_width
                if split_width is not None and batch_size is not None:
                    width = max(1, math.ceil(split_width * batch_size))
                    candidates = split.focused(candidates, width)
                diag["candidates_after_split"] = [int(c.numel()) for c in candidates]
        diag["bidirectional"] = not layers.causal
        diag["mode"] = "strict"
        if not candidates:
            diag["reason"] = "no token passed the first-layer span test"
            return None
        probe = self._probe(basis2)
        exhausted = False  # the causal search has no token budget
        if layers.causal:
            steps = self.max_length - 1 if layers.rope else len(candidates)
            seqs, scores = causal_search(probe, candidates, steps, options.causal, span.l2_threshold, flags)
        else:
            search = EncoderSearch(options.encoder, span.l2_threshold)
            seqs, scores = search.search(probe, candidates, batch_size)
            exhausted = search.exhausted
        diag["second_layer_evaluations"] = probe.evaluations
        diag["search_budget_exhausted"] = exhausted
        if not seqs:
            diag["reason"] = "no sequence passed the second-layer span test"
            return None
        passing = [i for i, s in enumerate(scores) if s < span.l2_threshold]
        if not passing:
            diag["reason"] = "no sequence passed the second-layer span test"
            return None
        seqs, scores = [seqs[i] for i in passing], [scores[i] for i in passing]
        seqs, scores, coverage = self._select(probe, basis1, seqs, scores)
        diag["candidate_sequences"] = len(passing)
        diag.update(coverage)
        covered = max(coverage["unexplained1"], coverage["unexplained2"]) < span.coverage_tol
        if exhausted and (not covered or (batch_size is not None and len(seqs) != batch_size)):
            flags.append("bidirectional search stopped at its token budget")
        if not covered:
            flags.append(
                f"the recovered sequences leave {coverage['unexplained1']:.1e} / {coverage['unexplained2']:.1e} of "
                f"the layer-1 / layer-2 gradient unexplained (>= {span.coverage_tol:.0e})"
            )
        seq_exact = [True] * len(seqs)
        if layers.causal:
            seqs, last_ok = self._last_tokens(seqs)
            seq_exact = last_ok
        if batch_size is not None and len(seqs) != batch_size:
            flags.append(f"recovered {len(seqs)} distinct sequences for a batch of {batch_size}")
        diag["flags"] = flags
        exact = bool(seqs) and all(seq_exact) and not flags
        return DagerResult(seqs, exact, seq_exact, scores, diag)

    def _passing(self, row: Tensor, basis: SpanBasis, position: int | None) -> Tensor:
        """Tokens of one position that pass the first-layer test, re-checked with the explicit reference."""
        span, max_candidates = self.options.span, self.options.budgets.max_candidates
        screen = torch.nonzero(row < 2 * span.l1_threshold + 1e-6).flatten()
        if screen.numel() == 0:
            return screen
        exact = basis.distance(self.layers.inputs(screen, position, span.torch_dtype).to(basis.complement.device))
        order = torch.argsort(exact)
        screen, exact = screen[order], exact[order]
        keep = screen[exact < span.l1_threshold]
        if keep.numel() > max_candidates:
            self.flags.append(f"position {position}: {keep.numel()} candidates, kept the closest {max_candidates}")
            keep = keep[:max_candidates]
        return keep

    def _select(self, probe: SecondLayerProbe, basis1: SpanBasis, seqs: list[list[int]], scores: list[float]):
        """Choose, among sequences that passed both tests, the set that explains the gradients.

        Greedy on explained gradient energy: each step adds the sequence whose second-layer inputs
        remove the most of the layer-2 gradient (restricted to its numerical range) still outside the
        span of the chosen sequences' inputs. Sequences that pass only by accident (a causal RoPE
        prefix repeating its first token has the same second-layer input at every position) add
        nothing and are never chosen. Returns the chosen sequences, their scores, and the fractions
        of the layer-1 and layer-2 gradients left unexplained (near 1e-7 for an exact recovery).
        """
        basis2 = probe.basis
        dtype = basis2.u.dtype
        limit = self.batch_size or len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: scores[i])[: max(limit, self.options.causal.max_prefixes)]
        seqs, scores = [seqs[i] for i in order], [scores[i] for i in order]
        rows = probe.second_inputs(seqs)  # list of (d, T_s) matrices: each sequence's second-layer inputs
        energy = basis2.range * basis2.singular_values[: basis2.rank].to(dtype)  # (d, r): same span and energy
        total = float(energy.pow(2).sum())
        residual = energy.clone()
        chosen: list[int] = []
        basis = torch.zeros(energy.shape[0], 0, dtype=dtype, device=energy.device)
        while len(chosen) < limit:
            best, best_gain, best_dirs = None, 0.0, None
            for i, own in enumerate(rows):
                if i in chosen:
                    continue
                dirs = _orthonormal_complement(own, basis)
                gain = float((dirs.T @ residual).pow(2).sum()) if dirs.shape[1] else 0.0
                if best is None or gain > best_gain * (1 + 1e-9):
                    best, best_gain, best_dirs = i, gain, dirs
            if best is None or best_gain <= 1e-12 * total:
                break
            chosen.append(best)
            basis = torch.cat([basis, best_dirs], dim=1)
            residual = residual - basis @ (basis.T @ residual)
        unexplained2 = math.sqrt(max(float(residual.pow(2).sum()), 0.0) / max(total, _TINY))
        unexplained1 = self._unexplained_first(basis1, [seqs[i] for i in chosen])
        chosen_seqs = [list(seqs[i]) for i in chosen]
        return chosen_seqs, [float(scores[i]) for i in chosen], {
            "unexplained1": unexplained1, "unexplained2": unexplained2,
        }

    def _unexplained_first(self, basis1: SpanBasis, seqs: list[list[int]]) -> float:
        """Fraction of the layer-1 gradient (its numerical range) outside the span of the sequences' inputs."""
        layers = self.layers
        dtype = basis1.u.dtype
        energy = basis1.range * basis1.singular_values[: basis1.rank].to(dtype)
        total = float(energy.pow(2).sum())
        if not seqs:
            return 1.0
        device = basis1.u.device
        vectors = []
        for s in seqs:
            ids = torch.tensor(s, dtype=torch.long, device=device)
            if layers.rope:
                vectors.append(layers.inputs(ids, None, dtype))
            else:
                vectors.append(torch.cat([layers.inputs(ids[p : p + 1], p, dtype) for p in range(len(s))]))
        span = _orthonormal_complement(torch.cat(vectors).T.to(device), torch.zeros(energy.shape[0], 0, dtype=dtype, device=device))
        residual = energy - span @ (span.T @ energy)
        return math.sqrt(max(float(residual.pow(2).sum()), 0.0) / max(total, _TINY))

    # ------------------------------------------------------------------------------------------------------
    # Relaxed (best-effort) path

    def _short_encoder_result(self, result: DagerResult) -> bool:
        """A bidirectional search that found fewer sequences than the batch holds (bounded search)."""
        return (not self.layers.causal and self.options.relaxed.enabled and self.batch_size is not None
                and len(result.sequences) < self.batch_size)

    def _completed(self, found: DagerResult, strict_flags: list[str], best_effort: DagerResult) -> DagerResult:
        """The sequences the strict search found, then best-effort ones for the rest of the batch.

        The strict sequences keep their per-sequence certificates; the batch is never certified (it was
        not covered). The flags are the strict attempt's, plus how many sequences are best effort.
        """
        seqs, scores, certs = list(found.sequences), list(found.scores), list(found.sequence_exact)
        for seq, score in zip(best_effort.sequences, best_effort.scores):
            if len(seqs) >= (self.batch_size or 0):
                break
            if seq not in seqs:
                seqs.append(seq)
                scores.append(score)
                certs.append(False)
        diag = self.diag
        flags = list(strict_flags)
        flags.append(f"{len(seqs) - len(found.sequences)} of {len(seqs)} sequences are the relaxed best effort")
        diag["flags"] = flags
        diag["mode"] = "strict+relaxed"
        return DagerResult(seqs, False, certs, scores, diag)

    def _relaxed(self, basis1: SpanBasis, basis2: SpanBasis) -> DagerResult:
        options, layers, diag, batch_size = self.options, self.layers, self.diag, self.batch_size
        relaxed, dtype = options.relaxed, options.span.torch_dtype
        inputs = layers.inputs
        self.flags = []  # what made the strict attempt uncertifiable does not describe the best effort
        top_k = relaxed.top_k or max(2, batch_size or 1)
        # A causal model's last position is never an input that reaches the loss.
        steps = max(1, self.max_length - 1) if layers.causal else self.max_length
        positions: list[int | None] = [None] if layers.rope else list(range(steps))
        dist = token_distances(basis1, inputs, positions, options.budgets.vocab_chunk, dtype)
        if not layers.rope:
            # Positions past the longest sequence hold no token: their best distance is about the
            # vocabulary's median, while a real (noisy) token stands out. Keep up to the last one that does.
            ratio = dist.min(dim=1).values / dist.median(dim=1).values.clamp_min(_TINY)
            present = torch.nonzero(ratio < relaxed.presence).flatten()
            diag["relaxed_best_to_median"] = [round(float(r), 3) for r in ratio]
            if present.numel():
                steps = int(present.max()) + 1
                dist = dist[:steps]
        if layers.rope:
            k = min(dist.shape[1], top_k * steps)
            order = torch.argsort(dist[0])[:k]
            candidates, prior = [order.cpu()], [dist[0, order]]
        elif self.split is not None:
            # An encoder whose first layer is blind: every batch token is at distance ~0 everywhere, so the
            # split's order (pinned tokens, then the open ones by fit) ranks the candidates instead. Twice
            # the batch size by default: chosen on development sentences that no benchmark row uses
            # (benchmarks/investigations/dager/notes.md, "Encoders at B = 8: the first-layer split").
            width = relaxed.top_k or 2 * max(2, batch_size or 1)
            ranked = self.split.candidates([torch.arange(inputs.vocab_size)] * min(steps, self.split.used_positions))
            candidates = self.split.focused(ranked, width, echoes=False)
            prior = [torch.zeros(c.numel(), dtype=dtype) for c in candidates]
        else:
            orders = [torch.argsort(row)[:top_k] for row in dist]
            candidates = [o.cpu() for o in orders]
            prior = [row[o] for row, o in zip(dist, orders)]
        diag["mode"] = "relaxed"
        # The strict attempt's first-layer counts stay in candidates_per_position (the feasibility notes read them).
        diag["relaxed_candidates_per_position"] = [int(c.numel()) for c in candidates]
        probe = self._probe(basis2)
        beam = max(1, batch_size or 1) * 2
        if layers.causal:
            seqs, scores = causal_search(probe, candidates, steps, options.causal, options.span.l2_threshold,
                                         self.flags, beam, prior=prior)
        else:
            seqs, scores = EncoderSearch(options.encoder, options.span.l2_threshold).coordinate_descent(
                probe, candidates, batch_size, prior=prior, rounds=1)
        diag["second_layer_evaluations"] = probe.evaluations
        eos = options.encoder.eos_token_id
        if not layers.causal and eos is not None:  # an encoder's sequence ends at its end token
            seqs = [s[: s.index(eos) + 1] if eos in s else s for s in seqs]
        seqs, scores, _ = _choose(seqs, scores, [False] * len(seqs), batch_size)
        if layers.causal and seqs:
            seqs, _ = self._last_tokens(seqs)
        diag["flags"] = self.flags
        diag.setdefault("reason", "no exact reconstruction")
        return DagerResult(seqs, False, [False] * len(seqs), scores, diag)


def _choose(seqs, scores, passed, batch_size):
    """Distinct sequences, passing ones first, then by score; at most batch_size of them."""
    order = sorted(range(len(seqs)), key=lambda i: (not passed[i], scores[i]))
    seen, out = set(), []
    for i in order:
        key = tuple(seqs[i])
        if key not in seen:
            seen.add(key)
            out.append(i)
    if batch_size is not None:
        out = out[:batch_size]
    return [list(seqs[i]) for i in out], [float(scores[i]) for i in out], [bool(passed[i]) for i in out]
