"""Sequences from a batched LoRA update: a search that grows the B sequences together, position by
position, every extension scored by every site's whitened span test and the global model's prior.

In a causal model a prefix fixes the inputs of every site at its positions, so a candidate token at
position p of a sequence gives one input per site, and each site's lora_A rows Y_l (2r, d) are
combinations of the batch's inputs there. With more tokens than rows no single input lies in Y_l's row
space, but a true one keeps far more of its (whitened) energy in it than another. The test sharpens as
the search goes: the inputs of every sequence's positions before p are known (the search chose them), so
they are projected out of both Y_l and the candidate (*deflation*); what is left of Y_l is a combination
of the unknown inputs only, of which there are fewer and fewer. A candidate's score is the sum over sites
of log(energy in the deflated row space / deflated energy), plus `lm_weight` times the global model's
log-probability of it after the prefix.

The last token of a sequence is never an input (it has no position after it to receive a gradient):
it is the global model's most likely continuation. `exact.batched.check` then re-simulates the
sequences' gradients and fits the update. Plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from datamodules.targets.hf import cache_keyword
from exact.batched.sites import Site, capture_site_inputs

#: Singular values of a deflated row space below this fraction of the undeflated space's largest are
#: float32 noise of the returned weights, not directions of unknown inputs.
ROW_SPACE_TOLERANCE = 1e-5
#: Inputs whose whitened singular values fall below this fraction of the largest are duplicates of others.
KNOWN_TOLERANCE = 1e-6
LOG_FLOOR = 1e-12


def _basis(matrix: Tensor, tolerance: float, reference: float | None = None) -> Tensor:
    """(d, r) orthonormal basis of the column space of `matrix` (d, n), singular values below `tolerance`
    times `reference` (default: its largest) dropped."""
    if matrix.shape[1] == 0:
        return matrix
    left, values, _ = torch.linalg.svd(matrix, full_matrices=False)
    top = float(values[0]) if reference is None else reference
    return left[:, values > tolerance * top] if top > 0 else left[:, :0]


class SpanScorer:
    """Every site's whitened span test of one update: `bases(known)` deflates by the known inputs,
    `score(hidden, bases)` grades candidates' inputs against what is left."""

    def __init__(self, rows: list[Tensor], whitening: Tensor) -> None:
        self.whitening = whitening.double()  # (S, d, d)
        self.whitening32 = self.whitening.float()
        self.rows = [r.double() @ w for r, w in zip(rows, self.whitening)]  # whitened (k, d) per site
        self.tops = [float(torch.linalg.matrix_norm(r, ord=2)) if r.numel() else 0.0 for r in self.rows]

    def bases(self, known: list[Tensor] | None) -> list[tuple[Tensor, Tensor]]:
        """Per site (known basis (d, n'), deflated row-space basis (d, r')) for known inputs (n, d) per site."""
        out = []
        for site, rows in enumerate(self.rows):
            w = self.whitening[site]
            if known is None or known[site].shape[0] == 0:
                k = rows.new_zeros(rows.shape[1], 0)
            else:
                k = _basis((known[site].double() @ w).T, KNOWN_TOLERANCE)
            left = rows.T - k @ (k.T @ rows.T)
            out.append((k, _basis(left, ROW_SPACE_TOLERANCE, self.tops[site])))
        return out

    def score(self, hidden: list[Tensor], bases: list[tuple[Tensor, Tensor]],
              sites: list[int] | None = None) -> Tensor:
        """(K,) summed log-fractions of the candidates' inputs `hidden` (K, d) per site."""
        total = None
        for site in range(len(self.rows)) if sites is None else sites:
            k, rows = bases[site]
            # float32: a score needs a few digits, and V * d * d products per site dominate the search otherwise
            z = hidden[site].float() @ self.whitening32[site]
            if k.shape[1]:
                z = z - (z @ k.float()) @ k.float().T
            inside = (z @ rows.float()).pow(2).sum(1)
            fraction = inside / z.pow(2).sum(1).clamp_min(1e-300)
            term = torch.log(fraction.double() + LOG_FLOOR)
            total = term if total is None else total + term
        assert total is not None
        return total


def _step(lm: nn.Module, tokens: Tensor, cache) -> tuple[Tensor, object]:
    out = lm(input_ids=tokens, use_cache=True, **({cache_keyword(lm): cache} if cache is not None else {}))
    return out.logits[:, -1].float().log_softmax(-1), out["cache" if "cache" in out else "past_key_values"]


@torch.no_grad()
def grow_sequences(target: nn.Module, sites: list[Site], scorer: SpanScorer, bag: list[int], batch_size: int,
                   length: int, lm_weight: float = 0.0, deflate: bool = True, beam: int = 1,
                   progress: Callable[[int], None] | None = None, label_candidates: int = 1,
                   labels: list[list[int]] | None = None,
                   extra_known: list[Tensor] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """B sequences of `length` tokens grown over the bag (each token usable any number of times), and each
    chosen token's margin over the runner-up (a confidence; the last token's is its LM log-probability
    margin). `labels`, if given, receives each sequence's `label_candidates` likeliest last tokens.
    `extra_known`: inputs (n, d) per site known beforehand (other sequences' all positions, when refining)."""

    def with_extra(known: list[Tensor] | None) -> list[Tensor] | None:
        if extra_known is None:
            return known
        if known is None:
            return extra_known
        return [torch.cat([e.to(k), k]) for e, k in zip(extra_known, known)]

    labels = [] if labels is None else labels
    lm = getattr(target, "model", target)
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    base = getattr(base, "model", base)  # the decoder without its vocabulary projection: site inputs only
    device = next(lm.parameters()).device
    candidates = torch.tensor(bag, dtype=torch.long, device=device)
    sequences: list[list[int]] = [[] for _ in range(batch_size)]
    margins: list[list[float]] = [[] for _ in range(batch_size)]
    # Position 0: every sequence's first input is a bag token alone; no prefix, no prior.
    hidden = capture_site_inputs(target, sites, lambda: lm(candidates[:, None]))
    first = [h[:, 0] for h in hidden]
    chosen_rows: list[int] = []
    for _ in range(batch_size):
        # Greedy within the position: each first token picked is known when the next is scored.
        known = with_extra([f[chosen_rows] for f in first]) if deflate else None
        scores = scorer.score(first, scorer.bases(known))
        if chosen_rows and deflate:
            scores[chosen_rows] = -float("inf")
        order = scores.argsort(descending=True)
        best = int(order[0])
        chosen_rows.append(best)
    for i, row in enumerate(chosen_rows):
        sequences[i].append(bag[row])
        margins[i].append(0.0)
    beams = [[(list(s), 0.0)] for s in sequences]
    if progress is not None:
        progress(1)
    for p in range(1, length):
        prefix = torch.tensor(sequences, dtype=torch.long, device=device)  # (B, p)
        logp, cache = _step(lm, prefix, None)  # the prior of every sequence's next token
        if p == length - 1:  # the last token is a label only: the model's own guess (`labels` keeps its runners-up)
            top = logp.topk(max(2, label_candidates), dim=-1)
            for i in range(batch_size):
                sequences[i].append(int(top.indices[i, 0]))
                margins[i].append(float(top.values[i, 0] - top.values[i, 1]))
            labels[:] = top.indices[:, :label_candidates].tolist()
            break
        known: list[Tensor] | None = None
        if deflate:
            known_inputs = capture_site_inputs(target, sites, lambda: base(prefix))
            known = with_extra([h.reshape(-1, h.shape[-1]) for h in known_inputs])
        for i in range(batch_size):
            # Joint: the inputs the sequences before this one chose at p are known too, so two sequences do not
            # both take the direction one true input explains.
            bases = scorer.bases(known)
            # The sequence's beam: every kept prefix extended by every bag token, cumulative scores.
            prefixes = beams[i]
            rows = torch.arange(len(prefixes), device=device).repeat_interleave(len(bag))
            tokens = candidates.repeat(len(prefixes))
            ids = torch.tensor([b[0] for b in prefixes], dtype=torch.long, device=device)
            lp, cache_i = _step(lm, ids, None)
            expanded = _reorder(cache_i, rows)
            step_inputs = capture_site_inputs(
                target, sites, lambda expanded=expanded, tokens=tokens: base(input_ids=tokens[:, None], use_cache=True,
                                                                           **{cache_keyword(base): expanded}))
            step = scorer.score([h[:, -1] for h in step_inputs], bases) + lm_weight * lp[rows, tokens]
            total = torch.tensor([b[1] for b in prefixes], dtype=torch.float64, device=device)[rows] + step
            keep = total.topk(min(beam, total.numel())).indices
            beams[i] = [(prefixes[int(rows[k])][0] + [int(tokens[k])], float(total[k])) for k in keep]
            sequences[i] = list(beams[i][0][0])
            if known is not None:
                best = int(keep[0])
                known = [torch.cat([k, h[best : best + 1, -1].to(k)]) for k, h in zip(known, step_inputs)]
            margins[i].append(float(total[keep[0]] - total[keep[-1]]) if len(keep) > 1 else 0.0)
        if progress is not None:
            progress(1)
    return sequences, margins


def _reorder(cache, rows: Tensor):
    """A copy of the key/value cache holding rows `rows` (repeats allowed)."""
    import copy

    copied = copy.deepcopy(cache)
    copied.reorder_cache(rows)
    return copied


@torch.no_grad()
def refine_sequences(target: nn.Module, sites: list[Site], scorer: SpanScorer, bag: list[int],
                     sequences: list[list[int]], lm_weight: float = 0.0, beam: int = 1) -> list[list[int]]:
    """One pass of coordinate-wise refinement: each sequence grown again with every other sequence's inputs
    (all their positions) known. With the others right, the rows' unknown inputs are this sequence's own
    L - 1, fewer than a site's 2r rows at L <= 2r: the span test becomes a membership test."""
    lm = getattr(target, "model", target)
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    base = getattr(base, "model", base)
    device = next(lm.parameters()).device
    out = [list(s) for s in sequences]
    length = len(out[0])
    for i in range(len(out)):
        others = [s[:-1] for j, s in enumerate(out) if j != i]
        extra = None
        if others:
            ids = torch.tensor(others, dtype=torch.long, device=device)
            extra = [h.reshape(-1, h.shape[-1]) for h in capture_site_inputs(target, sites, lambda ids=ids: base(ids))]
        grown, _ = grow_sequences(target, sites, scorer, bag, 1, length, lm_weight, beam=beam, extra_known=extra)
        out[i] = grown[0][:-1] + [out[i][-1]]  # the last token stays the refit's to choose
    return out


@torch.no_grad()
def likeliest_labels(target: nn.Module, sequences: list[list[int]], count: int) -> list[list[int]]:
    """Each sequence's `count` likeliest last tokens under the global model, given all its other tokens."""
    lm = getattr(target, "model", target)
    device = next(lm.parameters()).device
    prefixes = torch.tensor([s[:-1] for s in sequences], dtype=torch.long, device=device)
    logp, _ = _step(lm, prefixes, None)
    return logp.topk(count, dim=-1).indices.tolist()
