"""Where each token sits, from the first-layer gradient split into token and position parts.

A model with learned absolute positions feeds its first attention layer x = norm(w_a + p_i + t):
word a at position i, plus a constant t (BERT's token type 0). With LayerNorm,
x = gamma*(w_a + p_i + t - mu*1)/sigma + beta lies in the span of the vectors gamma*w_a, gamma*p_i,
gamma*t, gamma, beta. Once a batch's (token, position) pairs outnumber its distinct tokens plus its
positions, the first-layer span is that whole space, every batch token passes the span test at
every position, and DAGER's per-position candidates are blind (an encoder at B = 8:
95 of 102 tokens at every position).

The gradient itself says more than its span. It is G = sum over pairs of x_(a,i) dy_(a,i)^T, and the
vectors above are linearly independent while fewer than d, so G splits uniquely into rows
G = sum_a (gamma*w_a) c_a^T + sum_i (gamma*p_i) c_i^T + (the constants' rows), where
c_a = sum_i e_(a,i) over the positions of token a and c_i = sum_a e_(a,i) over the tokens at
position i, with e_(a,i) = dy_(a,i) / sigma_(a,i) one pair's (query, key, value) gradient. A token
that occurs once (or only at one position) has c_a = e_(a,i): its row appears whole in the row of
its position. Fitting each position's row by the token rows (least squares) gives such a token a
coefficient near 1 at its position and small ones elsewhere, while a token spread over several
positions splits its coefficient between them. Tokens whose coefficient concentrates at one
position are pinned there and their rows subtracted; the fit is repeated on what is left. What
stays unexplained at a position belongs to the tokens that are not pinned ("open" tokens).

The split reads only the update and the model. It ranks and prunes candidates; whether a sentence
is right is still decided by the second-layer test and the certificate. A wrong pin would remove a
token from its true position: a sentence using it there could no longer be found (never a false
claim). That happens to a token that occurs at two positions, one of which holds most of its row
(measured on MiniLM, B = 8: 66 tokens pinned, all at a true position, 2 true pairs lost this way;
`benchmarks/investigations/dager/encoder_dager_diagnostics.py --split`). A refit that unpins tokens whose rest shows
elsewhere did not separate them from right pins (coefficients of 0.1-0.2 either way) and was dropped.
What stays is milder: such a token's trace in what the split leaves unexplained (negative at its pin,
positive at its other position) makes it an extra candidate there ("echoes", `_echoes`), added after
the focus so that it never pushes a better-fitting token out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from exact.layers import FirstLayerInput

#: A token is pinned at a position where its coefficient is at least this and twice its next largest.
PIN_AT = 0.75
#: Relative size below which a fit residual (a token's row, a position's rest) counts as zero.
ZERO = 1e-4
#: A pinned token whose row, fitted to what the split leaves unexplained, takes at most this coefficient
#: at its own position was over-subtracted there: it also sits elsewhere (chosen on development updates).
OVERSUBTRACTED = -0.1


@dataclass
class PositionSplit:
    """Per-position tokens from the split of the first-layer gradient."""

    pinned: list[Tensor]  #: per position, the tokens pinned there (each token at one position only)
    echoes: list[Tensor]  #: per position, pinned tokens that probably also sit here (see `split_first_layer`)
    open_tokens: Tensor  #: tokens not pinned (they may sit at any open position)
    open_scores: Tensor  #: (L, n_open) fit coefficients of the open tokens at each position
    open_positions: Tensor  #: (L,) bool: the pinned tokens leave part of the position's row unexplained
    used_positions: int  #: positions whose row is not zero: the longest sequence's length
    absent: Tensor  #: candidate tokens whose row is zero: they are not in the batch
    fit_residual: float  #: relative residual of the split itself (~1e-7 when the input model holds)

    def candidates(self, passing: list[Tensor]) -> list[Tensor]:
        """Refined candidates: the pinned tokens, then the open tokens that pass there, best fit first.

        A position the split leaves empty (it cannot be: every used position holds a token) keeps its
        first-layer candidates.
        """
        out = []
        for i, ids in enumerate(passing[: self.used_positions]):
            keep = [self.pinned[i]]
            if bool(self.open_positions[i]):
                order = torch.argsort(self.open_scores[i], descending=True)
                ranked = self.open_tokens[order]
                keep.append(ranked[torch.isin(ranked, ids.cpu())])
            refined = torch.cat(keep)
            out.append(refined if refined.numel() else ids.cpu())
        return out

    def focused(self, candidates: list[Tensor], width: int, echoes: bool = True) -> list[Tensor]:
        """`candidates` (as `candidates()` returns them) cut to the pinned tokens plus the best-fitting
        others, `width` in all where fewer are pinned; then, with `echoes`, the position's echoes that
        the cut left out.

        The search then has fewer combinations per length group, and fewer groups: the end token ranks
        among a position's best fits mainly where a sentence ends (MiniLM, B = 8: 11-12 length groups
        instead of about 30, so each gets more of the budget). A true token ranked past `width` is lost
        to the strict search; that is never a false claim, since what passes is still certified by both
        span tests. Tried and not kept: keeping the end token only at the batch size's number of
        positions where its fit is largest. On MiniLM it picked 5 of 7 true ends, but on a planted
        batch it dropped the two longest sentences' ends.
        """
        out = []
        for ids, pinned, echo in zip(candidates, self.pinned, self.echoes):
            cut = ids[: max(width, int(pinned.numel()))]
            if echoes:
                cut = torch.cat([cut, echo[torch.isin(echo, ids) & ~torch.isin(echo, cut)]])
            out.append(cut)
        return out

    def summary(self) -> dict:
        return {
            "pinned": int(sum(p.numel() for p in self.pinned)),
            "open_tokens": int(self.open_tokens.numel()),
            "open_positions": int(self.open_positions.sum()),
            "used_positions": self.used_positions,
            "absent": int(self.absent.numel()),
            "fit_residual": self.fit_residual,
        }


def _basis(inputs: FirstLayerInput, tokens: Tensor, length: int, dtype: torch.dtype) -> Tensor | None:
    """(n, d) rows: scaled word vectors, position vectors, then the constants, all through the norm's gain."""
    if inputs.positions is None or length > inputs.positions.shape[0]:
        return None
    def host(t: Tensor) -> Tensor:
        return t.detach().to(device="cpu", dtype=dtype)

    words = inputs.scale * host(inputs.embedding[tokens.to(inputs.embedding.device)])
    rows = [words, host(inputs.positions[:length])]
    if inputs.offset is not None:
        rows.append(host(inputs.offset)[None])
    if inputs.norm == "layernorm":  # centring: -mu * 1
        rows.append(torch.ones(1, inputs.dim, dtype=dtype))
    basis = torch.cat(rows)
    if inputs.norm_weight is not None:
        basis = basis * host(inputs.norm_weight)
    if inputs.norm != "none" and inputs.norm_bias is not None:
        basis = torch.cat([basis, host(inputs.norm_bias)[None]])
    return basis


def split_rows(gradient: Tensor, inputs: FirstLayerInput, tokens: Tensor, length: int,
               dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, float] | None:
    """The token rows (n, width) and position rows (length, width) of the first-layer gradient (d, width).

    Row a is the sum of e_(a,i) = dy_(a,i) / sigma_(a,i) over the positions of token a, row i the sum
    over the tokens at position i. Also returns the split's relative residual. None where the split does
    not apply (no learned positions, or at least as many basis vectors as dimensions).
    """
    basis = _basis(inputs, tokens.cpu(), length, dtype)
    if basis is None or basis.shape[0] >= basis.shape[1]:
        return None
    n = tokens.numel()
    # A zero constant (e.g. a LayerNorm bias still at its initial 0) adds nothing: left out of the fit.
    norms = basis.norm(dim=1)
    basis = basis[(norms > 1e-12 * float(norms.max())) | (torch.arange(basis.shape[0]) < n + length)]
    g = gradient.detach().to(device="cpu", dtype=dtype)
    coef = torch.linalg.lstsq(basis.T, g, driver="gelsd").solution  # basis^T coef = g
    fit = float((basis.T @ coef - g).norm() / g.norm().clamp_min(1e-300))
    return coef[:n], coef[n : n + length], fit


def split_first_layer(gradient: Tensor, inputs: FirstLayerInput, tokens: Tensor, length: int,
                      dtype: torch.dtype = torch.float64, rounds: int = 8) -> PositionSplit | None:
    """Split the first-layer gradient (d, width) into token and position rows, and pin tokens.

    `tokens` are the candidates (those that pass the first-layer test somewhere), `length` the
    protocol's positions; at most `rounds` rounds of pinning. Returns None where the split does not
    apply: no learned positions, more basis vectors than the width, or a split that does not
    reproduce the gradient (the inputs are not of the form norm(w + p + t), e.g. masked by
    train-mode dropout, or the update is noised).
    """
    tokens = tokens.cpu()
    rows = split_rows(gradient, inputs, tokens, length, dtype)
    if rows is None or rows[2] > ZERO:
        return None
    words, places, fit = rows
    norms = words.norm(dim=1)
    present = norms > ZERO * float(norms.max().clamp_min(1e-300))
    open_idx = torch.nonzero(present).flatten().tolist()
    rest = places.clone()
    pinned: list[list[int]] = [[] for _ in range(length)]
    for _ in range(rounds):
        if not open_idx:
            break
        scores = torch.linalg.lstsq(words[open_idx].T, rest.T, driver="gelsd").solution.T  # (L, n_open)
        top = torch.topk(scores, min(2, length), dim=0)
        best, runner = top.values[0], (top.values[1] if length > 1 else torch.zeros_like(top.values[0]))
        pin = (best >= PIN_AT) & (runner < 0.5 * best)
        if not bool(pin.any()):
            break
        for k in torch.nonzero(pin).flatten().tolist():
            j, i = open_idx[k], int(top.indices[0, k])
            pinned[i].append(j)
            rest[i] -= words[j]
        open_idx = [j for k, j in enumerate(open_idx) if not bool(pin[k])]
    if open_idx:
        scores = torch.linalg.lstsq(words[open_idx].T, rest.T, driver="gelsd").solution.T
        leftover = rest - scores @ words[open_idx]
    else:
        scores = torch.zeros(length, 0, dtype=dtype)
        leftover = rest
    echoes = _echoes(words, pinned, leftover)
    scale = places.norm(dim=1)
    used = scale > ZERO * float(scale.max().clamp_min(1e-300))
    used_positions = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
    open_positions = (rest.norm(dim=1) > ZERO * scale.clamp_min(1e-300)) & used
    return PositionSplit(
        pinned=[tokens[torch.tensor(p, dtype=torch.long)] for p in pinned],
        echoes=[tokens[torch.tensor(e, dtype=torch.long)] for e in echoes],
        open_tokens=tokens[torch.tensor(open_idx, dtype=torch.long)],
        open_scores=scores,
        open_positions=open_positions,
        used_positions=used_positions,
        absent=tokens[~present],
        fit_residual=fit,
    )


def _echoes(words: Tensor, pinned: list[list[int]], leftover: Tensor) -> list[list[int]]:
    """Per position, the pinned tokens (indices into `words`) that probably also sit there.

    A token at positions i and j is pinned at i when most of its row e_(a,i) + e_(a,j) is i's; subtracting
    the whole row from position i then removes e_(a,j) too. What the fit leaves unexplained carries
    that trace: -e_(a,j) at i and +e_(a,j) at j. So the pinned rows are fitted to the leftover. A token
    whose coefficient at its own position is at most `OVERSUBTRACTED` also becomes a candidate where its
    coefficient is largest. On two MiniLM development updates (B = 8) this flagged all 6 tokens pinned
    away from a second position and put 5 of them back there, for 20 wrong extra candidates; the
    search's results on those updates did not change (benchmarks/investigations/dager/notes.md, "Echoes").
    """
    flat = [(i, j) for i, ids in enumerate(pinned) for j in ids]
    out: list[list[int]] = [[] for _ in pinned]
    if not flat:
        return out
    rows = torch.stack([words[j] for _, j in flat])
    coef = torch.linalg.lstsq(rows.T, leftover.T, driver="gelsd").solution.T  # (L, n_pinned)
    for k, (i, j) in enumerate(flat):
        column = coef[:, k].clone()
        if float(column[i]) > OVERSUBTRACTED:
            continue
        column[i] = float("-inf")
        target = int(column.argmax())
        if float(column[target]) > 0:
            out[target].append(j)
    return out
