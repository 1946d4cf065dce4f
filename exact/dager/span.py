"""DAGER steps 1 and 2: span bases of a layer's gradient, and every vocabulary token's distance to one.

1. **Span of the first attention layer.** The query block of the first attention layer's weight
   gradient is decomposed by SVD (float64 by default); its numerical rank r (singular values above
   `rank_tol` times the largest) is at most the number of tokens that reach the loss. The basis of
   the orthogonal complement gives the distance of a normalised vector v to the span,
   ||v - R R^T v|| = ||N^T v||.
2. **Token filtering.** Every vocabulary token t at every position p has a known first-layer input
   (embedding + position through the first normalisation, `exact.layers.FirstLayerInput`). Tokens
   whose distance is below `l1_threshold` are the candidates of position p. The test runs in chunks
   over the vocabulary; the position-independent part of the projection is computed once per chunk
   (the normalisation is expanded algebraically), and survivors are re-checked with the explicit
   float64 reference.

Also the linear-algebra helpers the later steps share: the orthonormal complement of some vectors
against a basis, and orthogonal matching pursuit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from exact.layers import FirstLayerInput

_TINY = 1e-300


@dataclass
class SpanBasis:
    """Orthonormal bases of the span of a gradient's columns and of its orthogonal complement."""

    u: Tensor  #: (d, d) left singular vectors (float64 by default)
    singular_values: Tensor  #: descending
    numerical_rank: int  #: number of singular values above rank_tol * the largest
    rank: int  #: the rank used: the numerical rank, possibly capped

    @property
    def dim(self) -> int:
        return int(self.u.shape[0])

    @property
    def range(self) -> Tensor:
        return self.u[:, : self.rank]

    @property
    def complement(self) -> Tensor:
        return self.u[:, self.rank :]

    def with_rank(self, rank: int) -> SpanBasis:
        return SpanBasis(self.u, self.singular_values, self.numerical_rank, max(0, min(int(rank), self.dim)))

    def distance(self, vectors: Tensor) -> Tensor:
        """Distance of the normalised rows of `vectors` (n, d) to the span: ||v - R R^T v|| / ||v|| = ||N^T v|| / ||v||."""
        v = vectors.to(self.u.dtype)
        norm = v.norm(dim=-1)
        if self.rank >= self.dim:
            return torch.zeros_like(norm)
        return (v @ self.complement).norm(dim=-1) / norm.clamp_min(_TINY)


def numerical_ranks(singular_values: Tensor, rank_tol: float) -> Tensor:
    """Numerical rank of each row of descending singular values (..., k): how many are above `rank_tol`
    times the row's largest (0 for a zero row or no values)."""
    if singular_values.shape[-1] == 0:
        return torch.zeros(singular_values.shape[:-1], dtype=torch.long, device=singular_values.device)
    top = singular_values[..., :1]
    return torch.where(top[..., 0] > 0, (singular_values > rank_tol * top).sum(-1), 0)


def span_basis(
    gradient: Tensor, rank_tol: float = 1e-6, max_rank: int | None = None, dtype: torch.dtype = torch.float64
) -> SpanBasis:
    """SVD basis of the column span of `gradient` (d, k), with an explicit relative rank tolerance.

    Non-finite entries count as zero. The numerical rank is the number of singular values above
    `rank_tol` times the largest (0 for a zero gradient); `max_rank` caps the rank used.
    """
    g = torch.nan_to_num(gradient.detach().to(dtype), nan=0.0, posinf=0.0, neginf=0.0)
    if g.shape[1] > g.shape[0]:
        # Wide (e.g. fused QKV): g = R^T Q^T with orthonormal Q, so g and R^T share U and S (2-3x faster).
        g = torch.linalg.qr(g.T, mode="r").R.T
    u, s, _ = torch.linalg.svd(g, full_matrices=True)
    numerical = int(numerical_ranks(s, rank_tol))
    rank = numerical if max_rank is None else min(numerical, max_rank)
    return SpanBasis(u, s, numerical, min(rank, g.shape[0]))


def _orthonormal_complement(vectors: Tensor, basis: Tensor, tol: float = 1e-6) -> Tensor:
    """Orthonormal basis of the part of span(columns of `vectors`) orthogonal to the orthonormal `basis`.

    Columns are normalised first; directions whose singular value (relative to a unit vector) is
    below `tol` are dropped (an input already in the span adds nothing).
    """
    v = vectors / vectors.norm(dim=0, keepdim=True).clamp_min(_TINY)
    if basis.shape[1]:
        v = v - basis @ (basis.T @ v)
    if v.shape[1] == 0:
        return v
    u, s, _ = torch.linalg.svd(v, full_matrices=False)
    return u[:, s > tol]


def _matching_pursuit(dictionary: Tensor, target: Tensor, max_atoms: int, tol: float = 1e-6) -> list[int]:
    """Orthogonal matching pursuit: rows of `dictionary` (V, d) whose combination gives `target` (d,)."""
    rows32 = dictionary.float()
    norms = rows32.norm(dim=1).clamp_min(1e-30)
    support: list[int] = []
    residual = target.clone()
    total = float(target.norm())
    for _ in range(max_atoms):
        score = (rows32 @ residual.float()) / norms
        t = int(score.argmax())
        if t in support:
            break
        support.append(t)
        basis = dictionary[support].T  # (d, s)
        coef = torch.linalg.lstsq(basis, target[:, None]).solution
        residual = target - (basis @ coef)[:, 0]
        if float(residual.norm()) <= tol * total:
            break
    return support


def token_distances(
    basis: SpanBasis,
    inputs: FirstLayerInput,
    positions: Sequence[int | None],
    chunk: int = 8192,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Distance to the span of every vocabulary token at every position: (len(positions), V).

    The first-layer input is norm(s*E[t] + c_p). Up to a positive factor it equals
    y = u_t + w_p + sigma_tp * beta with u_t = gamma*centre(s*E[t]), w_p = gamma*centre(c_p) (no centring
    without LayerNorm; beta = 0 without a bias; sigma the LayerNorm scale), so the projection of y and
    ||y|| expand into a per-token part computed once per vocabulary chunk and cheap (V x P) cross
    terms. The squared residual is ||N^T y||^2 (complement N) or ||y||^2 - ||R^T y||^2 (range R),
    whichever basis is smaller; accurate to about 1e-7 in float64. `Dager` re-checks the tokens that
    pass with the explicit reference (`FirstLayerInput.__call__`, `SpanBasis.distance`).
    """
    vocab, d = inputs.vocab_size, inputs.dim
    device = basis.u.device
    out = torch.empty(len(positions), vocab, dtype=dtype, device=device)
    if basis.rank >= basis.dim:
        return out.zero_()
    use_range = basis.rank < basis.dim - basis.rank
    proj = (basis.range if use_range else basis.complement).to(dtype)
    layernorm = inputs.norm == "layernorm"
    gamma = (
        inputs.norm_weight.detach().to(device, dtype)
        if inputs.norm_weight is not None and inputs.norm != "none"
        else torch.ones(d, dtype=dtype, device=device)
    )
    beta = (
        inputs.norm_bias.detach().to(device, dtype)
        if (layernorm and inputs.norm_bias is not None)
        else torch.zeros(d, dtype=dtype, device=device)
    )
    consts = torch.stack([inputs.constant(p, dtype).to(device) for p in positions])  # (P, d)
    cc = consts - consts.mean(1, keepdim=True) if layernorm else consts
    w = gamma * cc  # (P, d)
    wn = w @ proj  # (P, k)
    gn = beta @ proj  # (k,)
    w2, wn2, beta2, gn2 = w.pow(2).sum(1), wn.pow(2).sum(1), beta.pow(2).sum(), gn.pow(2).sum()
    w_beta, wn_gn = w @ beta, wn @ gn
    cc2 = cc.pow(2).sum(1)
    embedding = inputs.embedding.detach()
    for start in range(0, vocab, chunk):
        x = inputs.scale * embedding[start : start + chunk].to(device, dtype)
        xc = x - x.mean(1, keepdim=True) if layernorm else x
        u = gamma * xc
        a = u @ proj
        if layernorm:
            var = (xc.pow(2).sum(1, keepdim=True) + 2 * (xc @ cc.T) + cc2[None]) / d
            sigma = torch.sqrt(var + inputs.eps)
        else:
            sigma = torch.zeros(1, 1, dtype=dtype, device=device)
        p2 = (  # ||P^T y||^2
            a.pow(2).sum(1, keepdim=True) + wn2[None] + sigma.pow(2) * gn2 + 2 * (a @ wn.T)
            + 2 * sigma * (a @ gn)[:, None] + 2 * sigma * wn_gn[None]
        )
        n2 = (  # ||y||^2
            u.pow(2).sum(1, keepdim=True) + w2[None] + sigma.pow(2) * beta2 + 2 * (u @ w.T)
            + 2 * sigma * (u @ beta)[:, None] + 2 * sigma * w_beta[None]
        )
        r2 = n2 - p2 if use_range else p2
        out[:, start : start + chunk] = (r2.clamp_min(0) / n2.clamp_min(_TINY)).sqrt().T
    return out
