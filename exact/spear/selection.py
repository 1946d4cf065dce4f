"""SPEAR step 5: choose b independent candidates, fix their scale and sign, and certify the result.

The b sparsest linearly independent candidates form Q_hat; the scale and sign of each column come
from the bias gradient, dL/db = (dL/dZ) 1 = L Q 1, so s = Q_hat^-1 L^+ dL/db and Q = Q_hat diag(s),
and X = (Q^-1 R)^T. The *sparsity-matching certificate* compares the zero pattern of dL/dZ = L Q
with the ReLU pattern of W X_hat + b; when it fails and spare candidates exist, a local search over
single swaps runs while the agreement improves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: Floor of norms that are divided by (a zero direction must not produce NaNs).
TINY = 1e-300

#: A candidate direction: (unit direction q (b,), zero count, pivotal).
Candidate = tuple[Tensor, int, bool]


def sparsity_agreement(grad_z: Tensor, pre_activation: Tensor, zero_tol: float, dead_tol: float = 0.0) -> float:
    """Sparsity-matching score: fraction of entries where "gradient is zero" equals "ReLU inactive".

    Args:
        grad_z: dL/dZ (m, b), as reconstructed (L Q).
        pre_activation: Z = W X_hat + b (m, b) of the reconstruction.
        zero_tol: An entry of grad_z is zero when |entry| <= zero_tol * (norm of its row).
        dead_tol: A row whose norm is <= dead_tol * the largest row norm is all zero (a dead neuron).
    """
    scale = grad_z.norm(dim=1, keepdim=True)
    zero = (grad_z.abs() <= zero_tol * scale) | (scale <= dead_tol * scale.max())
    inactive = pre_activation <= 0
    return float((zero == inactive).double().mean()) if zero.numel() else 0.0


def greedy_independent(candidates: list[Candidate], b: int, partial: bool = False) -> list[int] | None:
    """Indices of the sparsest candidates that are linearly independent (b of them, or fewer if partial)."""
    chosen: list[int] = []
    basis: Tensor | None = None
    for i, (q, _, _) in enumerate(candidates):
        if len(chosen) == b:
            break
        v = q if basis is None else q - basis @ (basis.T @ q)
        if float(v.norm()) < 1e-6:
            continue
        v = v / v.norm()
        basis = v[:, None] if basis is None else torch.cat([basis, v[:, None]], dim=1)
        chosen.append(i)
    if len(chosen) == b or (partial and chosen):
        return chosen
    return None


@dataclass
class Selector:
    """Scale, certify and select candidates for one attack: the gradient's factors and the layer."""

    #: L (m, b) and R (b, n): dL/dW = L R.
    left: Tensor
    right: Tensor
    bias_grad: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    zero_tol: float
    dead_tol: float
    #: Certificate evaluations of single swaps for the final selection (1/16 of it while sampling).
    max_swaps: int
    diag: dict

    @property
    def can_certify(self) -> bool:
        """The certificate needs the layer's weight and bias, and the bias gradient for the scale."""
        return self.weight is not None and self.bias is not None and self.bias_grad is not None

    def scaled(self, q_hat: Tensor) -> tuple[Tensor, Tensor]:
        """Q = Q_hat diag(s) with s = Q_hat^-1 L^+ dL/db, and X = (Q^-1 R)^T."""
        left, right = self.left, self.right
        if self.bias_grad is None:
            x = torch.linalg.solve(q_hat, right)
            x = x / x.norm(dim=1, keepdim=True).clamp_min(TINY)
            return q_hat, x
        db = self.bias_grad.detach().to(left.device, left.dtype)
        coeff = torch.linalg.lstsq(left, db[:, None]).solution[:, 0]  # L^+ dL/db = Q 1
        scale = torch.linalg.solve(q_hat, coeff)
        q = q_hat * scale[None, :]
        return q, torch.linalg.solve(q, right)

    def certify(self, q_hat: Tensor) -> tuple[Tensor, float | None]:
        """The reconstruction X of Q_hat and its sparsity agreement (None when it cannot be certified)."""
        q, x = self.scaled(q_hat)
        if not self.can_certify or not torch.isfinite(x).all():
            return x, None
        left = self.left
        w = self.weight.detach().to(left.device, left.dtype)
        bb = self.bias.detach().to(left.device, left.dtype)
        pre = w @ x.T + bb[:, None]  # (m, b)
        return x, sparsity_agreement(left @ q, pre, self.zero_tol, self.dead_tol)

    def good_enough(self, candidates: list[Candidate], b: int) -> bool:
        """Whether sampling can stop: the selection certifies (or, without the layer, b independent
        non-pivotal directions exist)."""
        selection = self.select(candidates, b, budget=self.max_swaps // 16)
        if selection is None:
            return False
        if not self.can_certify:
            return not any(candidates[i][2] for i in selection[0])  # b independent non-pivotal directions
        return selection[2] == 1.0

    def select(self, candidates: list[Candidate], b: int, budget: int | None = None
               ) -> tuple[list[int], Tensor, float | None] | None:
        """Greedy choice of b independent candidates, then single swaps while the certificate improves."""
        chosen = greedy_independent(candidates, b)
        if chosen is None:
            return None
        q_hat = torch.stack([candidates[i][0] for i in chosen], dim=1)
        x, agreement = self.certify(q_hat)
        if agreement is not None and agreement < 1.0 and len(candidates) > b:
            chosen, x, agreement = self.swap_search(chosen, candidates, x, agreement, budget)
        return chosen, x, agreement

    def swap_search(self, chosen: list[int], candidates: list[Candidate], x: Tensor, agreement: float,
                    budget: int | None = None) -> tuple[list[int], Tensor, float]:
        """Local search: for each slot (least sparse first) take the best single swap; repeat while it helps."""
        budget = self.max_swaps if budget is None else budget
        spare = [i for i in range(len(candidates)) if i not in chosen]
        tries = 0
        improved = True
        while improved and agreement < 1.0 and tries < budget:
            improved = False
            for slot in reversed(range(len(chosen))):
                best = None
                for extra in spare:
                    if tries >= budget:
                        break
                    trial = chosen[:slot] + [extra] + chosen[slot + 1 :]
                    q_hat = torch.stack([candidates[i][0] for i in trial], dim=1)
                    if float(torch.linalg.svdvals(q_hat)[-1]) < 1e-6:
                        continue
                    tries += 1
                    x_t, a_t = self.certify(q_hat)
                    if a_t is not None and a_t > agreement and (best is None or a_t > best[2]):
                        best = (extra, x_t, a_t)
                        if a_t == 1.0:
                            break
                if best is not None:
                    extra, x, agreement = best
                    spare = [i for i in spare if i != extra] + [chosen[slot]]
                    chosen = chosen[:slot] + [extra] + chosen[slot + 1 :]
                    improved = True
                    if agreement == 1.0:
                        break
        self.diag["swaps_tried"] = self.diag.get("swaps_tried", 0) + tries
        return chosen, x, agreement
