"""DAGER step 4: the last token of each causal sequence, recovered from the final-norm gradient.

The last token of a sequence trained with the next-token loss is only ever a label: in a causal
model it never reaches the loss as an input, so no span contains it. It is recovered from the
gradient of the final normalisation that feeds the vocabulary projection (GPT-2 `ln_f`, Llama
`norm`), whose label part is linear in the one-hot labels once the prefixes are known (greedy
matching, one token per sequence).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from exact.dager.options import CausalOptions
from exact.dager.span import _TINY, _matching_pursuit
from exact.layers import DagerLayers, FinalNorm


def recover_last_tokens(
    seqs: list[list[int]], target: nn.Module, layers: DagerLayers, update: Mapping[str, Tensor],
    batch_size: int | None, options: CausalOptions, dtype: torch.dtype, probe_tokens: int, flags: list[str],
) -> tuple[list[list[int]], list[bool], float | None]:
    """Append each sequence's final token, recovered from the final-norm gradient.

    With next_token_loss, sequence b (T_b visible tokens) adds coef_b = 1 / (m T_b) times
    (softmax - onehot(label)) @ W_head to the gradient of the final norm's output at each of its
    positions, so the final norm's bias gradient is sum (softmax - onehot) @ W_head and its weight
    gradient the same weighted by x-hat (the normalised input). Everything is known from the
    recovered prefixes except the last label of each sequence, whose contribution is the "atom"
    -coef_b [x-hat_b * W[t] ; W[t]]. Greedy matching picks one token per sequence, then pairwise
    swaps and single re-picks reduce the residual; a residual near zero certifies the tokens.

    `target` (with its `layers`) is run on the recovered prefixes, `probe_tokens` tokens at a time,
    in `dtype`; `batch_size` (None: the sequences found) gives each sequence's share of the mean.
    Returns the sequences with their last token, whether each is certified, and the relative
    residual (None when not computed); what prevents a certificate is added to `flags`.
    """
    norm = layers.final_norm
    ok = [False] * len(seqs)
    if not options.recover_last_token:
        flags.append("last tokens not recovered (recover_last_token=False)")
        return seqs, ok, None
    if norm is None:
        flags.append("last tokens not recovered: no final normalisation feeding the head was found")
        return seqs, ok, None
    names = [n for n in (norm.weight_name, norm.bias_name) if n is not None and n in update]
    if not names or not seqs:
        flags.append("last tokens not recovered: the final normalisation's gradient is not observed")
        return seqs, ok, None
    device = layers.inputs.embedding.device
    head = norm.head_weight.detach().to(device, dtype)  # (V, d)
    count = batch_size or len(seqs)
    use_w, use_b = norm.weight_name in names, norm.bias_name in names
    coef = torch.tensor([1.0 / (count * len(s)) for s in seqs], dtype=dtype, device=device)
    known_w, known_b, last_hat = _known_part(target, norm, seqs, head, coef, probe_tokens)
    observed_w = update[norm.weight_name].detach().to(device, dtype) if use_w else None
    observed_b = update[norm.bias_name].detach().to(device, dtype) if use_b else None
    observed_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in (observed_w, observed_b) if g is not None))
    # target vector: sum_b atom(b, t_b) with atom(b, t) = coef_b [x-hat_b * W[t] ; W[t]]
    z_w = known_w - observed_w if use_w else torch.zeros_like(known_w)
    z_b = known_b - observed_b if use_b else torch.zeros_like(known_b)
    system = _LabelSystem(head, coef, last_hat, z_w, z_b, use_w, use_b)
    chosen, r_w, r_b = system.solve((options.last_token_tol * observed_norm) ** 2 * 1e-4)
    relative = math.sqrt(system.residual2(r_w, r_b)) / max(observed_norm, _TINY)
    exact = relative < options.last_token_tol
    if not exact:
        flags.append(f"last-token residual {relative:.2e} >= {options.last_token_tol:.0e}")
    return [seq + [chosen[i]] for i, seq in enumerate(seqs)], [exact] * len(seqs), relative


def _known_part(target: nn.Module, norm: FinalNorm, seqs: list[list[int]], head: Tensor, coef: Tensor,
                probe_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """The final norm's weight and bias gradients with every label but the last of each sequence
    (the model run on the recovered prefixes), and the normalised input x-hat at each last position."""
    dtype, device = head.dtype, head.device
    known_w = torch.zeros(head.shape[1], dtype=dtype, device=device)
    known_b = torch.zeros_like(known_w)
    last_hat = torch.empty(len(seqs), head.shape[1], dtype=dtype, device=device)
    width = max(len(s) for s in seqs)
    rows = max(1, probe_tokens // width)
    for start in range(0, len(seqs), rows):
        group = seqs[start : start + rows]
        ids = torch.zeros(len(group), width, dtype=torch.long, device=device)
        for i, s in enumerate(group):  # right padding never changes earlier positions of a causal model
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        box: list[Tensor] = []
        handle = norm.module.register_forward_pre_hook(lambda m, a: box.append(a[0]))
        try:
            logits = target(ids) if hasattr(target, "body") else target(input_ids=ids).logits
        finally:
            handle.remove()
        xhat_all = norm.normalise(box[0]).to(dtype)
        for i, s in enumerate(group):
            b, length = start + i, len(s)
            probs = torch.softmax(logits[i, :length].to(dtype), dim=-1)
            targets = torch.tensor(s[1:], dtype=torch.long, device=device)
            probs[torch.arange(length - 1, device=device), targets] -= 1.0  # labels known except the last
            dh = coef[b] * (probs @ head)  # (T, d)
            xhat = xhat_all[i, :length]
            known_b += dh.sum(0)
            known_w += (xhat * dh).sum(0)
            last_hat[b] = xhat[-1]
    return known_w, known_b, last_hat


class _LabelSystem:
    """The unknown last labels: one token t_b per sequence b such that sum_b atom(b, t_b) = (z_w ; z_b)."""

    def __init__(self, head: Tensor, coef: Tensor, last_hat: Tensor, z_w: Tensor, z_b: Tensor, use_w: bool,
                 use_b: bool) -> None:
        self.head, self.coef, self.last_hat, self.z_w, self.z_b = head, coef, last_hat, z_w, z_b
        self.use_b = use_b
        self.n = len(coef)
        self.mw, self.mb = float(use_w), float(use_b)
        head_sq_hat = (head.pow(2) @ last_hat.pow(2).T) * self.mw + head.pow(2).sum(1, keepdim=True) * self.mb  # (V, n)
        self.sizes = coef.pow(2)[None] * head_sq_hat  # ||atom(b, t)||^2, (V, n)

    def gains(self, r_w: Tensor, r_b: Tensor, members: Tensor) -> Tensor:
        """2 <r, atom(b, t)> - ||atom(b, t)||^2 for the sequences `members`: (V, len(members))."""
        directions = self.mw * self.last_hat[members] * r_w[None] + self.mb * r_b[None]
        return 2 * self.coef[members][None] * (self.head @ directions.T) - self.sizes[:, members]

    def atom(self, b: int, t: int) -> tuple[Tensor, Tensor]:
        return self.mw * self.coef[b] * self.last_hat[b] * self.head[t], self.mb * self.coef[b] * self.head[t]

    @staticmethod
    def residual2(rw, rb) -> float:
        return float(rw.pow(2).sum() + rb.pow(2).sum())

    def residual_of(self, chosen: list[int]) -> tuple[Tensor, Tensor]:
        r_w, r_b = self.z_w.clone(), self.z_b.clone()
        for b, t in enumerate(chosen):
            a_w, a_b = self.atom(b, t)
            r_w, r_b = r_w - a_w, r_b - a_b
        return r_w, r_b

    def greedy(self) -> list[int]:
        chosen = [-1] * self.n
        r_w, r_b = self.z_w.clone(), self.z_b.clone()
        remaining = list(range(self.n))
        while remaining:
            g = self.gains(r_w, r_b, torch.tensor(remaining, device=self.head.device))
            best = int(g.max(dim=0).values.argmax())
            b, t = remaining[best], int(g[:, best].argmax())
            chosen[b] = t
            remaining.remove(b)
            a_w, a_b = self.atom(b, t)
            r_w, r_b = r_w - a_w, r_b - a_b
        return chosen

    def support_assignment(self) -> list[int] | None:
        """Tokens from the bias part (sum of coef_b * W[t_b]: a sparse non-negative combination of
        head rows, found by orthogonal matching pursuit), then which sequence ends with which by
        least squares on the full system (one-hot assignment relaxed to real weights)."""
        n, head = self.n, self.head
        if not self.use_b or n < 2:
            return None
        support = _matching_pursuit(head, self.z_b, n)
        if not support or n * len(support) > 4 * head.shape[1]:
            return None
        columns = []
        for b in range(n):
            for t in support:
                a_w, a_b = self.atom(b, t)
                columns.append(torch.cat([a_w, a_b]))
        system = torch.stack(columns, dim=1)  # (2d, n |T|)
        scale = float(system.norm(dim=0).mean())
        rows = torch.zeros(n, n * len(support), dtype=head.dtype, device=head.device)
        for b in range(n):
            rows[b, b * len(support) : (b + 1) * len(support)] = scale  # sum_t y_bt = 1
        lhs = torch.cat([system, rows])
        rhs = torch.cat([self.z_w, self.z_b, torch.full((n,), scale, dtype=head.dtype, device=head.device)])
        weights = torch.linalg.lstsq(lhs, rhs[:, None]).solution.view(n, len(support))
        return [support[int(i)] for i in weights.argmax(dim=1)]

    def refine(self, chosen: list[int]) -> tuple[list[int], Tensor, Tensor]:
        """Local search: single re-picks over the vocabulary and pairwise swaps, while they help."""
        n, atom, residual2 = self.n, self.atom, self.residual2
        chosen = list(chosen)
        r_w, r_b = self.residual_of(chosen)
        for _ in range(4 * n + 4):
            improved = False
            current = residual2(r_w, r_b)
            for b in range(n):
                a_w, a_b = atom(b, chosen[b])
                base_w, base_b = r_w + a_w, r_b + a_b
                t = int(self.gains(base_w, base_b, torch.tensor([b], device=self.head.device))[:, 0].argmax())
                if t != chosen[b]:
                    n_w, n_b = atom(b, t)
                    if residual2(base_w - n_w, base_b - n_b) < current * (1 - 1e-9):
                        chosen[b], r_w, r_b = t, base_w - n_w, base_b - n_b
                        current, improved = residual2(r_w, r_b), True
            for b1, b2 in itertools.combinations(range(n), 2):
                t1, t2 = chosen[b1], chosen[b2]
                if t1 == t2:
                    continue
                parts = [atom(b1, t1), atom(b2, t2), atom(b1, t2), atom(b2, t1)]
                s_w = r_w + parts[0][0] + parts[1][0] - parts[2][0] - parts[3][0]
                s_b = r_b + parts[0][1] + parts[1][1] - parts[2][1] - parts[3][1]
                if residual2(s_w, s_b) < current * (1 - 1e-9):
                    chosen[b1], chosen[b2], r_w, r_b = t2, t1, s_w, s_b
                    current, improved = residual2(r_w, r_b), True
            if not improved:
                break
        return chosen, r_w, r_b

    def solve(self, certified: float) -> tuple[list[int], Tensor, Tensor]:
        """The best refined assignment from the two starts (matching pursuit, greedy), with its
        residual; a start whose squared residual is below `certified` ends the search."""
        best = None
        for start in (self.support_assignment(), self.greedy()):
            if start is None:
                continue
            candidate = self.refine(start)
            if best is None or self.residual2(candidate[1], candidate[2]) < self.residual2(best[1], best[2]):
                best = candidate
            if self.residual2(best[1], best[2]) < certified:
                break  # already certified: skip the other start
        return best
