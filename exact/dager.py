"""DAGER (Petrov et al., NeurIPS 2024): exact recovery of a client's token batch from its gradient.

For a linear layer Y = X W, the weight gradient is X^T dL/dY, so its columns lie in the span of the
layer's inputs X (one row per token). DAGER tests which candidate inputs lie in that span:

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
3. **Sequences.** Causal (decoder) models: extend every surviving prefix by every candidate of the next
   position and keep the extensions whose second-layer input (running block 1 only, with a key/value
   cache for Hugging Face decoders) lies in the span of the second attention layer's gradient
   (`l2_threshold`). RoPE models have position-free first-layer inputs: one unordered candidate set
   feeds every position. Bidirectional (encoder) models: every position's candidates, one group
   of sequences per length (sequences end where the end-of-sequence token passes), then a bounded
   search over combinations scored by the second-layer distance: exhaustive when small, otherwise a
   left-to-right beam search that ranks prefixes by the second-layer distance of the prefix run
   alone (a heuristic: only the exact score of complete sequences decides what passes), then
   coordinate descent with restarts seeded by the beam, then "peeling" of what was found.
4. **The last token** of a sequence trained with the next-token loss is only ever a label: in a causal
   model it never reaches the loss as an input, so no span contains it. It is recovered from the
   gradient of the final normalisation that feeds the vocabulary projection (GPT-2 `ln_f`, Llama
   `norm`), whose label part is linear in the one-hot labels once the prefixes are known (greedy
   matching, one token per sequence).

Degenerate inputs (rank 0, a span of full rank because B*L >= d, no candidate passing, missing
parameters) never raise: a best-effort result is returned with `exact=False` and the reason in the
diagnostics. When the strict test finds nothing (noise, sign, pruning, dropout) and `relaxed=True`,
a best-effort reconstruction ranks tokens by distance instead of thresholding them, against a span
truncated to the largest rank the protocol allows (B * L).

Plain PyTorch: this module never imports Lightning.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from exact.layers import DagerLayers, FirstLayerInput, capture_input, find_layers

_TINY = 1e-300


# ----------------------------------------------------------------------------------------------------------
# Span basis and distances


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

    def with_rank(self, rank: int) -> "SpanBasis":
        return SpanBasis(self.u, self.singular_values, self.numerical_rank, max(0, min(int(rank), self.dim)))

    def distance(self, vectors: Tensor) -> Tensor:
        """Distance of the normalised rows of `vectors` (n, d) to the span: ||v - R R^T v|| / ||v|| = ||N^T v|| / ||v||."""
        v = vectors.to(self.u.dtype)
        norm = v.norm(dim=-1)
        if self.rank >= self.dim:
            return torch.zeros_like(norm)
        return (v @ self.complement).norm(dim=-1) / norm.clamp_min(_TINY)


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
    top = float(s[0]) if s.numel() else 0.0
    numerical = int((s > rank_tol * top).sum()) if top > 0 else 0
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


# ----------------------------------------------------------------------------------------------------------
# Result


@dataclass
class DagerResult:
    """What DAGER recovered from one client update."""

    #: Recovered token ids, one list per sequence (an unordered set: a gradient has no batch order).
    sequences: list[list[int]]
    #: True when every sequence passed both span tests and (for causal models) its last token was
    #: recovered with a negligible residual, and no degenerate condition was met.
    exact: bool
    #: Per-sequence certificate (same meaning as `exact`, for that sequence).
    sequence_exact: list[bool] = field(default_factory=list)
    #: Per-sequence score: the largest second-layer distance along the sequence (lower is better).
    scores: list[float] = field(default_factory=list)
    diagnostics: dict[str, Any] = field(default_factory=dict)

    def padded(self, length: int | None = None, pad_token_id: int = 0) -> Tensor:
        """Sequences as a right-padded LongTensor (n, length)."""
        length = length or max((len(s) for s in self.sequences), default=0)
        out = torch.full((len(self.sequences), length), pad_token_id, dtype=torch.long)
        for i, seq in enumerate(self.sequences):
            seq = seq[:length]
            out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        return out


# ----------------------------------------------------------------------------------------------------------
# The second-layer probe: runs block 1 only


class _SecondLayer:
    """Second-layer inputs of candidate sequences, and their distances to the second span."""

    def __init__(self, target: nn.Module, layers: DagerLayers, basis: SpanBasis, token_budget: int) -> None:
        self.target = target
        self.layers = layers
        self.basis = basis
        self.token_budget = max(1, token_budget)
        self.device = layers.inputs.embedding.device
        self.evaluations = 0  # sequences (or cached steps) run through block 1

    def _run(self, ids: Tensor) -> Tensor:
        target = self.target
        if hasattr(target, "body"):
            return capture_input(self.layers.second_input_module, lambda: target.body(ids, None))
        return capture_input(self.layers.second_input_module, lambda: target(input_ids=ids))

    def inputs(self, ids: Tensor) -> Tensor:
        """(N, T) token ids -> (N, T, d) second-layer inputs (float32 as the model computes them)."""
        n, length = ids.shape
        rows = max(1, self.token_budget // max(1, length))
        out = []
        for start in range(0, n, rows):
            part = ids[start : start + rows].to(self.device)
            out.append(self._run(part))
            self.evaluations += part.shape[0]
        return torch.cat(out)

    def full(self, ids: Tensor) -> Tensor:
        """(N, T) token ids -> (N, T) distances of every position's second-layer input."""
        n, length = ids.shape
        rows = max(1, self.token_budget // max(1, length))
        out = []
        for start in range(0, n, rows):
            hidden = self.inputs(ids[start : start + rows])
            out.append(self.basis.distance(hidden.reshape(-1, hidden.shape[-1])).view(hidden.shape[0], length))
        return torch.cat(out).cpu() if out else torch.empty(0, length, dtype=self.basis.u.dtype)


class _ResidualSpan:
    """The part of the second-layer span not explained by some sequences' second-layer inputs.

    `distance(v)` is the distance of v with those inputs projected out, relative to what is left of
    v, to the projected span; inputs of the known sequences themselves score 1 (nothing new).
    """

    def __init__(self, probe: _SecondLayer, sequences: list[list[int]]) -> None:
        basis = probe.basis
        self.u = basis.u  # dtype/device, as SpanBasis
        dtype = basis.u.dtype
        by_length: dict[int, list[list[int]]] = {}
        for s in sequences:
            by_length.setdefault(len(s), []).append(s)
        rows = [probe.inputs(torch.tensor(group, dtype=torch.long)).to(dtype).reshape(-1, basis.dim)
                for group in by_length.values()]
        known = _orthonormal_complement(torch.cat(rows).T.to(basis.u.device), basis.u[:, :0])
        energy = basis.range * basis.singular_values[: basis.rank].to(dtype)
        residual = energy - known @ (known.T @ energy)
        u, s, _ = torch.linalg.svd(residual, full_matrices=False)
        keep = s > 1e-6 * float(s[0]) if s.numel() and float(s[0]) > 0 else torch.zeros(0, dtype=torch.bool)
        self.known, self.span = known, u[:, keep]
        self.rank = int(self.span.shape[1])

    def distance(self, vectors: Tensor) -> Tensor:
        v = vectors.to(self.u.dtype)
        norm = v.norm(dim=-1).clamp_min(_TINY)
        v = v - (v @ self.known) @ self.known.T
        left = v.norm(dim=-1)
        off = (v - (v @ self.span) @ self.span.T).norm(dim=-1)
        return torch.where(left > 1e-6 * norm, off / left.clamp_min(_TINY), torch.ones_like(left))


class _PrefixCache:
    """Causal prefix search with a Hugging Face key/value cache of layer 0 (one new token per step).

    Block 0's keys/values at a position depend only on the prefix, so a surviving prefix's cache is
    reused by all its extensions; a step runs one token per candidate instead of the whole prefix.
    """

    def __init__(self, probe: _SecondLayer, base_model: nn.Module) -> None:
        from transformers import DynamicCache

        self.probe = probe
        self.base = base_model
        self.cache_cls = DynamicCache
        self.keys: Tensor | None = None  # (n_prefixes, heads, p, head_dim)
        self.values: Tensor | None = None

    def step(self, parents: Tensor | None, tokens: Tensor, position: int, retain) -> Tensor:
        """Distances at `position` of prefixes[parents] + tokens (one distance per pair).

        Only the layer-0 cache rows of pairs that `retain(start, distances_of_chunk)` returns (local
        indices) are kept, so memory stays bounded by the survivors, not by the pairs tried.
        """
        n = tokens.shape[0]
        rows = max(1, self.probe.token_budget // max(1, position + 1))
        dists, kept, keys, values = [], [], [], []
        for start in range(0, n, rows):
            tok = tokens[start : start + rows].to(self.probe.device)
            if parents is None or self.keys is None:
                cache = self.cache_cls()
            else:
                idx = parents[start : start + rows].to(self.keys.device)
                cache = self.cache_cls(ddp_cache_data=[(self.keys[idx], self.values[idx])])
            pos = torch.full((tok.shape[0], 1), position, dtype=torch.long, device=tok.device)
            hidden = capture_input(
                self.probe.layers.second_input_module,
                lambda: self.base(input_ids=tok[:, None], past_key_values=cache, use_cache=True, position_ids=pos),
            )
            dist = self.probe.basis.distance(hidden[:, -1]).cpu()
            local = retain(start, dist)
            layer0 = cache.layers[0]
            keys.append(layer0.keys[local.to(layer0.keys.device)])
            values.append(layer0.values[local.to(layer0.values.device)])
            kept.append(local + start)
            dists.append(dist)
            self.probe.evaluations += tok.shape[0]
        self._retained = (torch.cat(kept), torch.cat(keys), torch.cat(values))
        return torch.cat(dists)

    def keep(self, index: Tensor) -> None:
        """Make the pairs `index` (all retained by the last step) the prefixes of the next step."""
        retained, keys, values = self._retained
        where = torch.searchsorted(retained, index)
        if where.numel() and (where.max() >= retained.numel() or not torch.equal(retained[where], index)):
            raise RuntimeError("a kept prefix was not retained by the cache")
        where = where.to(keys.device)
        self.keys, self.values = keys[where], values[where]
        self._retained = None


# ----------------------------------------------------------------------------------------------------------
# The attack


class Dager:
    """DAGER with explicit, configurable numerics. Call `attack(target, update, batch_size, max_length)`."""

    def __init__(
        self,
        rank_tol: float = 1e-6,
        blocks: str = "qkv",
        l1_threshold: float = 1e-3,
        l2_threshold: float = 1e-3,
        dtype: str = "float64",
        vocab_chunk: int = 8192,
        max_candidates: int = 1024,
        max_prefixes: int = 4096,
        max_pairs: int = 65536,
        token_budget: int = 16384,
        encoder_max_combinations: int = 4096,
        encoder_restarts: int | None = None,
        encoder_token_budget: int = 2_000_000,
        encoder_max_sweeps: int = 8,
        encoder_beam: int = 64,
        relaxed: bool = True,
        relaxed_top_k: int | None = None,
        relaxed_presence: float = 0.8,
        use_cache: bool = True,
        recover_last_token: bool = True,
        last_token_tol: float = 1e-3,
        coverage_tol: float = 1e-4,
        min_codimension: int = 4,
        eos_token_id: int | None = None,
        seed: int = 0,
    ) -> None:
        """
        Args:
            rank_tol: Numerical rank = number of singular values above rank_tol * the largest.
            blocks: Gradient blocks whose columns span the layer inputs: "q" (the paper: query only) or
                "qkv" (query, key and value; needed for the first token of causal models, whose query
                gradient vanishes because it only attends to itself).
            l1_threshold: A token passes the first-layer test when its normalised distance to the span is below this.
            l2_threshold: A sequence passes the second-layer test when every position's distance is below this.
            dtype: Dtype of the SVD and of all distances: "float64" (default) or "float32".
            vocab_chunk: Vocabulary tokens tested at once.
            max_candidates: At most this many candidates per position (the closest); more is flagged.
            max_prefixes: At most this many live prefixes in the causal search (the closest); more is flagged.
            max_pairs: At most this many (prefix, candidate) pairs per position in the causal search.
            token_budget: Tokens per forward pass of the second-layer probe.
            encoder_max_combinations: Exhaustive search over per-position candidates up to this many combinations.
            encoder_restarts: Coordinate-descent restarts beyond that (default: batch size + 3).
            encoder_token_budget: At most this many tokens run through block 1 by the bidirectional search
                of one update (bounds its time; exhausting it is recorded in the diagnostics, and flagged
                when the sequences found do not explain both gradients).
            encoder_max_sweeps: Coordinate-descent sweeps per restart.
            encoder_beam: Width of the bidirectional prefix beam search that runs before coordinate
                descent (0: coordinate descent only).
            relaxed: When the strict tests find nothing, return a best-effort reconstruction ranked by distance.
            relaxed_top_k: Candidates per position in relaxed mode (default: the batch size, at least 2).
            relaxed_presence: Relaxed mode: a position holds a token when its best first-layer distance is
                below this fraction of the vocabulary's median distance there (sets the length).
            use_cache: Use a key/value cache for the causal prefix search where the model supports it.
            recover_last_token: Recover each sequence's final token (a label only) from the final-norm gradient.
            last_token_tol: Relative residual of the final-norm gradient below which the last tokens are exact.
            min_codimension: The strict test needs the second-layer span to miss at least this many of the
                d dimensions (with fewer, random sequences pass by chance); otherwise relaxed mode.
            coverage_tol: Certificate: the recovered sequences' inputs must leave less than this fraction of
                the layer-1 and layer-2 gradients (their numerical ranges) unexplained.
            eos_token_id: End-of-sequence token of bidirectional models (sequence ends where it passes).
            seed: Seed of the encoder search's random restarts.
        """
        if isinstance(dtype, str):
            if dtype not in ("float64", "float32"):
                raise ValueError(f"DAGER dtype {dtype!r} not allowed; use 'float64' (default) or 'float32'")
            dtype = getattr(torch, dtype)
        for name, value in (("rank_tol", rank_tol), ("l1_threshold", l1_threshold), ("l2_threshold", l2_threshold)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"DAGER {name}={value} must be a finite number > 0")
        self.rank_tol = float(rank_tol)
        if blocks not in ("q", "qkv"):
            raise ValueError(f"DAGER blocks={blocks!r} not allowed; use 'q' or 'qkv'")
        self.blocks = blocks
        self.l1_threshold = float(l1_threshold)
        self.l2_threshold = float(l2_threshold)
        self.dtype = dtype
        self.vocab_chunk = int(vocab_chunk)
        self.max_candidates = int(max_candidates)
        self.max_prefixes = int(max_prefixes)
        self.max_pairs = int(max_pairs)
        self.token_budget = int(token_budget)
        self.encoder_max_combinations = int(encoder_max_combinations)
        self.encoder_restarts = encoder_restarts
        self.encoder_token_budget = int(encoder_token_budget)
        self._search_exhausted = False
        self._search_spent = 0
        self.encoder_max_sweeps = int(encoder_max_sweeps)
        self.encoder_beam = int(encoder_beam)
        self.relaxed = bool(relaxed)
        self.relaxed_top_k = relaxed_top_k
        self.relaxed_presence = float(relaxed_presence)
        self.use_cache = bool(use_cache)
        self.recover_last_token = bool(recover_last_token)
        self.last_token_tol = float(last_token_tol)
        self.coverage_tol = float(coverage_tol)
        self.min_codimension = int(min_codimension)
        self.eos_token_id = eos_token_id
        self.seed = int(seed)
        self._layers: weakref.WeakKeyDictionary[nn.Module, DagerLayers] = weakref.WeakKeyDictionary()

    def layers(self, target: nn.Module) -> DagerLayers:
        """The layers DAGER reads in `target` (looked up once per model)."""
        if target not in self._layers:
            self._layers[target] = find_layers(target)
        return self._layers[target]

    # ------------------------------------------------------------------------------------------------------

    def attack(
        self,
        target: nn.Module,
        update: Mapping[str, Tensor],
        batch_size: int | None = None,
        max_length: int | None = None,
    ) -> DagerResult:
        """Recover the sequences behind one client update.

        Args:
            target: The global model (`datamodules.targets` model or a Hugging Face model).
            update: {parameter name: gradient} of ONE client update (the mean over its sequences).
            batch_size: Sequences in the update (the client protocol, known to the server); None = unknown.
            max_length: Longest sequence length (the protocol's block length); None = the model's limit.
        """
        start = time.perf_counter()
        diag: dict[str, Any] = {"batch_size": batch_size, "max_length": max_length}
        try:
            layers = self.layers(target)
        except ValueError as error:
            return self._degenerate(diag, f"unsupported model: {error}", start)
        diag["architecture"] = layers.architecture
        self._search_exhausted = False
        self._search_spent = 0
        was_training = target.training
        target.eval()
        try:
            with torch.no_grad():
                result = self._attack(target, layers, update, batch_size, max_length, diag)
        except (RuntimeError, ValueError) as error:  # e.g. an SVD that does not converge on garbage input
            result = self._degenerate(diag, f"{type(error).__name__}: {error}")
        finally:
            target.train(was_training)
        result.diagnostics["seconds"] = time.perf_counter() - start
        return result

    __call__ = attack

    def _degenerate(self, diag: dict, reason: str, start: float | None = None, sequences=None) -> DagerResult:
        diag["mode"] = "degenerate"
        diag["reason"] = reason
        if start is not None:
            diag["seconds"] = time.perf_counter() - start
        sequences = sequences or []
        return DagerResult(sequences, False, [False] * len(sequences), [math.inf] * len(sequences), diag)

    def _attack(self, target, layers: DagerLayers, update, batch_size, max_length, diag) -> DagerResult:
        inputs = layers.inputs
        device = inputs.embedding.device
        d = inputs.dim
        g1 = layers.first.input_space(update, self.blocks)
        g2 = layers.second.input_space(update, self.blocks)
        if g1 is None or g2 is None:
            needed = [n for n in layers.first.names(self.blocks) + layers.second.names(self.blocks) if n not in update]
            return self._degenerate(diag, f"update lacks {needed}; observe the first two attention layers")
        g1, g2 = g1.to(device), g2.to(device)
        if max_length is None:
            max_length = inputs.num_positions or 64
        if inputs.num_positions is not None:
            max_length = min(max_length, inputs.num_positions)
        visible = max_length - 1 if layers.causal else max_length
        cap = None if batch_size is None else max(1, batch_size * max(1, visible))
        basis1 = span_basis(g1, self.rank_tol, None, self.dtype)
        basis2 = span_basis(g2, self.rank_tol, None, self.dtype)
        r1, r2 = basis1.numerical_rank, basis2.numerical_rank
        diag.update(
            rank1=r1, rank2=r2, dim=d, rank_cap=cap, rank_tol=self.rank_tol,
            l1_threshold=self.l1_threshold, l2_threshold=self.l2_threshold,
        )
        if r1 == 0 or r2 == 0:
            return self._degenerate(diag, "gradient of rank 0 (nothing observed, or pruned away)")
        flags: list[str] = []
        if cap is not None and max(r1, r2) > cap:
            # More directions than the protocol's tokens: noise (or a too tight rank_tol). Keep the top ones.
            flags.append(f"numerical ranks ({r1}, {r2}) exceed B*L = {cap}: truncated, not certifiable")
        r1, r2 = min(r1, cap or d), min(r2, cap or d)
        basis1, basis2 = basis1.with_rank(r1), basis2.with_rank(r2)
        if r1 < d and r2 <= d - self.min_codimension:
            result = self._strict(target, layers, update, basis1, basis2, batch_size, max_length, diag, flags)
            if result is not None:
                return result
        else:
            diag["reason"] = (
                f"span (nearly) full: ranks {r1}, {r2} of d = {d} (B*L >= d, or noise); a random vector would "
                f"pass the second-layer test by chance"
            )
        if not self.relaxed or min(r1, r2, d - 1) <= 0:
            return self._degenerate(diag, diag.get("reason", "no sequence passed the span tests"))
        # Best effort: the span truncated below d, tokens ranked by distance instead of thresholded.
        basis1, basis2 = basis1.with_rank(min(r1, d - 1)), basis2.with_rank(min(r2, d - 1))
        diag.update(relaxed_rank1=basis1.rank, relaxed_rank2=basis2.rank)
        return self._relaxed(target, layers, update, basis1, basis2, batch_size, max_length, diag)

    # ------------------------------------------------------------------------------------------------------
    # Strict (exact) path

    def _strict(self, target, layers, update, basis1, basis2, batch_size, max_length, diag, flags) -> DagerResult | None:
        inputs = layers.inputs
        # 1. first-layer candidates, position by position (one unordered set for RoPE models)
        candidates: list[Tensor] = []
        positions: list[int | None] = [None] if layers.rope else list(range(max_length))
        block = 32
        for start in range(0, len(positions), block):
            chunk = positions[start : start + block]
            dist = token_distances(basis1, inputs, chunk, self.vocab_chunk, self.dtype)
            stop = False
            for row, pos in zip(dist, chunk):
                ids = self._passing(row, inputs, basis1, pos, flags)
                if ids.numel() == 0:
                    stop = True
                    break
                candidates.append(ids)
            if stop:
                break
        diag["candidates_per_position"] = [int(c.numel()) for c in candidates]
        diag["mode"] = "strict"
        if not candidates:
            diag["reason"] = "no token passed the first-layer span test"
            return None
        probe = _SecondLayer(target, layers, basis2, self.token_budget)
        if layers.causal:
            steps = max_length - 1 if layers.rope else len(candidates)
            seqs, scores = self._causal_search(target, layers, probe, candidates, steps, batch_size, None, flags)
        else:
            seqs, scores = self._bidirectional_search(probe, candidates, batch_size)
        diag["second_layer_evaluations"] = probe.evaluations
        diag["search_budget_exhausted"] = self._search_exhausted
        if not seqs:
            diag["reason"] = "no sequence passed the second-layer span test"
            return None
        passing = [i for i, s in enumerate(scores) if s < self.l2_threshold]
        if not passing:
            diag["reason"] = "no sequence passed the second-layer span test"
            return None
        seqs, scores = [seqs[i] for i in passing], [scores[i] for i in passing]
        seqs, scores, coverage = self._select(layers, probe, basis1, basis2, seqs, scores, batch_size)
        diag["candidate_sequences"] = len(passing)
        diag.update(coverage)
        covered = max(coverage["unexplained1"], coverage["unexplained2"]) < self.coverage_tol
        if self._search_exhausted and (not covered or (batch_size is not None and len(seqs) != batch_size)):
            flags.append("bidirectional search stopped at its token budget")
        if not covered:
            flags.append(
                f"the recovered sequences leave {coverage['unexplained1']:.1e} / {coverage['unexplained2']:.1e} of "
                f"the layer-1 / layer-2 gradient unexplained (>= {self.coverage_tol:.0e})"
            )
        seq_exact = [True] * len(seqs)
        if layers.causal:
            seqs, last_ok = self._last_tokens(target, layers, update, seqs, batch_size, diag, flags)
            seq_exact = last_ok
        if batch_size is not None and len(seqs) != batch_size:
            flags.append(f"recovered {len(seqs)} distinct sequences for a batch of {batch_size}")
        diag["flags"] = flags
        exact = bool(seqs) and all(seq_exact) and not flags
        return DagerResult(seqs, exact, seq_exact, scores, diag)

    def _select(self, layers, probe, basis1, basis2, seqs, scores, batch_size):
        """Choose, among sequences that passed both tests, the set that explains the gradients.

        Greedy on explained gradient energy: each step adds the sequence whose second-layer inputs
        remove the most of the layer-2 gradient (restricted to its numerical range) still outside the
        span of the chosen sequences' inputs. Sequences that pass only by accident (a causal RoPE
        prefix repeating its first token has the same second-layer input at every position) add
        nothing and are never chosen. Returns the chosen sequences, their scores, and the fractions
        of the layer-1 and layer-2 gradients left unexplained (near 1e-7 for an exact recovery).
        """
        dtype = basis2.u.dtype
        limit = batch_size or len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: scores[i])[: max(limit, self.max_prefixes)]
        seqs, scores = [seqs[i] for i in order], [scores[i] for i in order]
        rows = self._second_inputs(probe, seqs)  # list of (T_s, d) orthonormal bases of each sequence's inputs
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
        unexplained1 = self._unexplained_first(layers, basis1, [seqs[i] for i in chosen])
        chosen_seqs = [list(seqs[i]) for i in chosen]
        return chosen_seqs, [float(scores[i]) for i in chosen], {
            "unexplained1": unexplained1, "unexplained2": unexplained2,
        }

    def _second_inputs(self, probe: "_SecondLayer", seqs: list[list[int]]) -> list[Tensor]:
        out: list[Tensor | None] = [None] * len(seqs)
        by_length: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            by_length.setdefault(len(s), []).append(i)
        for length, members in by_length.items():
            ids = torch.tensor([seqs[i] for i in members], dtype=torch.long)
            hidden = probe.inputs(ids).to(probe.basis.u.dtype)
            for j, i in enumerate(members):
                out[i] = hidden[j].T  # (d, T)
        return out

    def _unexplained_first(self, layers, basis1: SpanBasis, seqs: list[list[int]]) -> float:
        """Fraction of the layer-1 gradient (its numerical range) outside the span of the sequences' inputs."""
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

    def _passing(self, row: Tensor, inputs: FirstLayerInput, basis: SpanBasis, position, flags) -> Tensor:
        """Tokens of one position that pass the first-layer test, re-checked with the explicit reference."""
        screen = torch.nonzero(row < 2 * self.l1_threshold + 1e-6).flatten()
        if screen.numel() == 0:
            return screen
        exact = basis.distance(inputs(screen, position, self.dtype).to(basis.complement.device))
        order = torch.argsort(exact)
        screen, exact = screen[order], exact[order]
        keep = screen[exact < self.l1_threshold]
        if keep.numel() > self.max_candidates:
            flags.append(f"position {position}: {keep.numel()} candidates, kept the closest {self.max_candidates}")
            keep = keep[: self.max_candidates]
        return keep

    def _choose(self, seqs, scores, passed, batch_size):
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

    # ------------------------------------------------------------------------------------------------------
    # Causal prefix search (strict: threshold; relaxed: beam)

    def _causal_search(self, target, layers, probe, candidates, steps, batch_size, beam, flags, prior=None):
        """Prefix extension over at most `steps` positions. Returns (sequences, scores): the maximal
        prefixes that passed (strict), or the `beam` best prefixes of full length (relaxed, ranked by
        mean second-layer distance plus the candidates' first-layer distance `prior`)."""
        cached = None
        if self.use_cache and layers.hf_base_model is not None:
            cached = _PrefixCache(probe, layers.hf_base_model)
        dtype = probe.basis.u.dtype
        prefixes = torch.empty(1, 0, dtype=torch.long)
        scores = torch.zeros(1, dtype=dtype)
        finished: list[tuple[list[int], float]] = []
        for p in range(steps):
            cand = (candidates[0] if layers.rope else candidates[p]).cpu()
            first = None if prior is None else (prior[0] if layers.rope else prior[p]).cpu().to(dtype)
            k = cand.numel()
            if prefixes.shape[0] * k > self.max_pairs:  # bounded search: keep the best prefixes
                width = max(1, self.max_pairs // k)
                flags.append(f"position {p}: {prefixes.shape[0]} prefixes x {k} candidates, kept {width} prefixes")
                best = torch.argsort(scores)[:width]
                prefixes, scores = prefixes[best], scores[best]
            n = prefixes.shape[0]
            parents = torch.arange(n).repeat_interleave(k)
            tokens = cand.repeat(n)
            extra = None if first is None else first.repeat(n)

            def pair_scores(start: int, dist: Tensor) -> Tensor:
                sl = slice(start, start + dist.numel())
                if beam is None:
                    return torch.maximum(scores[parents[sl]], dist)
                step = dist if extra is None else dist + extra[sl]
                return (scores[parents[sl]] * p + step) / (p + 1)

            def retain(start: int, dist: Tensor) -> Tensor:
                if beam is None:
                    return torch.nonzero(dist < self.l2_threshold).flatten()
                return torch.argsort(pair_scores(start, dist))[:beam].sort().values

            dist = None
            if cached is not None:
                try:
                    dist = cached.step(parents if p > 0 else None, tokens, p, retain)
                except Exception as error:  # noqa: BLE001 - an unsupported cache API: re-run prefixes instead
                    flags.append(f"key/value cache unavailable ({type(error).__name__}: {error}); re-running prefixes")
                    cached = None
            if dist is None:
                dist = probe.full(torch.cat([prefixes[parents], tokens[:, None]], dim=1))[:, -1]
            dist = dist.cpu().to(dtype)
            total = pair_scores(0, dist)
            if beam is None:
                keep = torch.nonzero(dist < self.l2_threshold).flatten()
                if keep.numel() > self.max_prefixes:
                    flags.append(f"position {p}: {keep.numel()} prefixes, kept the closest {self.max_prefixes}")
                    keep = keep[torch.argsort(total[keep])[: self.max_prefixes]].sort().values
            else:
                keep = torch.argsort(total)[:beam].sort().values
            extended = torch.zeros(n, dtype=torch.bool)
            extended[parents[keep]] = True
            if beam is None and p > 0:
                for i in torch.nonzero(~extended).flatten().tolist():
                    finished.append((prefixes[i].tolist(), float(scores[i])))
            if keep.numel() == 0:
                prefixes = prefixes[:0]
                break
            prefixes = torch.cat([prefixes[parents[keep]], tokens[keep, None]], dim=1)
            scores = total[keep]
            if cached is not None:
                cached.keep(keep)
        finished += [(prefixes[i].tolist(), float(scores[i])) for i in range(prefixes.shape[0]) if prefixes.shape[1]]
        return [f[0] for f in finished], [f[1] for f in finished]

    # ------------------------------------------------------------------------------------------------------
    # Bidirectional search

    def _bidirectional_search(self, probe: _SecondLayer, candidates: list[Tensor], batch_size):
        """Sequences over per-position candidates, scored by their largest second-layer distance.

        Sequences end where the end-of-sequence token passes (one group per length; without an
        end-of-sequence token, one group of full length). Groups small enough are searched
        exhaustively. Otherwise, first pass: a prefix beam search (`_prefix_beam`) of every group,
        cheap, within half of the search budget. Second pass, while fewer than `batch_size` sequences
        pass: restarted coordinate descent on the groups still without a passing sequence, seeded by
        the beam's best sequences, sharing the first three quarters of the budget. Third pass
        ("peeling"): the groups still without one are searched again against the part of the
        second-layer span that the sequences found so far do not explain, so that a search can no
        longer settle on copies of what was already found. Every pass stops once `batch_size`
        sequences pass (the certificate, `_select`, then checks that they explain both gradients).
        """
        lengths = [len(candidates)]
        if self.eos_token_id is not None:
            ends = [p + 1 for p, c in enumerate(candidates) if (c == self.eos_token_id).any()]
            lengths = ends or lengths
        groups = []
        for length in lengths:
            cands = [c.cpu() for c in candidates[:length]]
            if self.eos_token_id is not None and (cands[-1] == self.eos_token_id).any():
                cands[-1] = torch.tensor([self.eos_token_id])
            groups.append(cands)
        want = 1 if len(groups) > 1 else (batch_size or 1)
        found: dict[tuple[int, ...], float] = {}
        by_group: list[list[list[int]]] = [[] for _ in groups]
        satisfied = [False] * len(groups)

        def merge(i: int, seqs, scores) -> None:
            for s, sc in zip(seqs, scores):
                found[tuple(s)] = min(sc, found.get(tuple(s), math.inf))
            by_group[i] += [list(s) for s in seqs]
            satisfied[i] = satisfied[i] or sum(1 for sc in scores if sc < self.l2_threshold) >= want

        def enough() -> bool:
            passing = sum(1 for sc in found.values() if sc < self.l2_threshold)
            return batch_size is not None and passing >= batch_size

        small = [math.prod(c.numel() for c in cands) <= self.encoder_max_combinations for cands in groups]
        for i, cands in enumerate(groups):  # exhaustive where small
            if small[i]:
                merge(i, *self._search_length(probe, cands, want, self.encoder_token_budget))
        # Beam search of every other group: narrow first (cheap; usually enough), then full width.
        widths = sorted({max(1, self.encoder_beam // 4), self.encoder_beam}) if self.encoder_beam > 0 else []
        for w, width in enumerate(widths):
            beam_budget = self.encoder_token_budget * (w + 1) // (2 * len(widths))
            todo = [i for i in range(len(groups)) if not small[i] and not satisfied[i]]
            for n, i in enumerate(todo):
                if enough():
                    break
                share = (beam_budget - self._search_spent) // (len(todo) - n)
                merge(i, *self._prefix_beam(probe, groups[i], want, self._search_spent + max(0, share), width))
        first_pass = self.encoder_token_budget * 3 // 4
        todo = [i for i in range(len(groups)) if not small[i] and not satisfied[i]]
        best = [min((found[tuple(s)] for s in by_group[i]), default=math.inf) for i in range(len(groups))]
        todo.sort(key=lambda i: best[i])  # the groups whose beam came closest first
        for n, i in enumerate(todo):  # coordinate descent, seeded by the beam
            if enough():
                break
            share = (first_pass - self._search_spent) // (len(todo) - n)
            initial = sorted(by_group[i], key=lambda s: found[tuple(s)])
            merge(i, *self._search_length(probe, groups[i], want, self._search_spent + max(0, share), initial))
        for i, cands in enumerate(groups):
            passing = [list(s) for s, sc in found.items() if sc < self.l2_threshold]
            if satisfied[i] or not passing or enough():
                continue
            residual = _ResidualSpan(probe, passing)
            if residual.rank == 0:
                continue
            peeled = _SecondLayer(probe.target, probe.layers, residual, probe.token_budget)
            remaining = [j for j in range(len(groups)) if not satisfied[j] and j >= i]
            share = (self.encoder_token_budget - self._search_spent) // max(1, len(remaining))
            seqs, _ = self._coordinate_descent(peeled, cands, want, limit=self._search_spent + share)
            probe.evaluations += peeled.evaluations
            if seqs:  # re-check against the full second-layer span
                check = probe.full(torch.tensor(seqs, dtype=torch.long)).max(dim=1).values
                for s, sc in zip(seqs, check.tolist()):
                    found[tuple(s)] = min(sc, found.get(tuple(s), math.inf))
                satisfied[i] = bool((check < self.l2_threshold).sum() >= want)
        ranked = sorted(found.items(), key=lambda item: item[1])
        return [list(s) for s, _ in ranked], [sc for _, sc in ranked]

    def _search_length(self, probe: _SecondLayer, cands: list[Tensor], want: int, limit: int, initial=None):
        sizes = [c.numel() for c in cands]
        total = math.prod(sizes)
        if total <= self.encoder_max_combinations:
            grid = torch.tensor(list(itertools.product(*[range(k) for k in sizes])), dtype=torch.long)
            if grid.dim() == 1:
                grid = grid[:, None]
            seqs = torch.stack([cands[p][grid[:, p]] for p in range(len(cands))], dim=1)
            dist = probe.full(seqs)
            self._search_spent += seqs.numel()
            score = dist.max(dim=1).values
            order = torch.argsort(score)
            return [seqs[i].tolist() for i in order], [float(score[i]) for i in order]
        return self._coordinate_descent(probe, cands, want, limit=limit, initial=initial)

    def _prefix_beam(self, probe: _SecondLayer, cands: list[Tensor], want: int, limit: int, width: int | None = None):
        """Left-to-right beam search over per-position candidates, for bidirectional models.

        A bidirectional model's second-layer input depends on the whole sequence, so a prefix cannot
        be checked exactly. But block 1 run on the prefix alone (closed by the end-of-sequence token
        when there is one) already puts the right token's second-layer input much closer to the span
        than a wrong one's (pretrained MiniLM: ~0.1 against 0.2-0.3): each prefix is extended by every
        candidate of the next position, the extensions are ranked by the mean second-layer distance
        over their positions, and the `width` (default `encoder_beam`) best are kept. The complete
        sequences are then scored exactly (largest second-layer distance of the full sequence); only
        these exact scores decide what passes, so the heuristic ranking can cost recall, never
        correctness.
        """
        length = len(cands)
        eos = self.eos_token_id
        closing = eos is not None and int(cands[-1].numel()) == 1 and int(cands[-1][0]) == eos
        # Tokens run per unit of width (every step runs width x candidates sequences of length p + 2):
        # the width shrinks to fit the budget, down to 2 * want; below that the beam is skipped.
        per_width = sum(int(c.numel()) * (p + 2) for p, c in enumerate(cands)) + length
        width = self.encoder_beam if width is None else width
        width = min(max(width, 2 * (want or 1)), max(0, limit - self._search_spent) // per_width)
        if width < 2 * (want or 1):
            self._search_exhausted = True
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
            if self._search_spent + ids.numel() > limit:
                self._search_exhausted = True
                return [], []
            dist = probe.full(ids)[:, : p + 1]
            self._search_spent += ids.numel()
            score = dist.mean(dim=1)
            keep = torch.argsort(score)[:width]
            prefixes = ext[keep]
        exact = probe.full(prefixes).max(dim=1).values
        self._search_spent += prefixes.numel()
        order = torch.argsort(exact)
        return [prefixes[i].tolist() for i in order], [float(exact[i]) for i in order]

    def _coordinate_descent(
        self, probe: _SecondLayer, cands: list[Tensor], want: int | None, prior: list[Tensor] | None = None,
        limit: int | None = None, rounds: int = 256, initial: list[list[int]] | None = None,
    ):
        """Bounded search: rounds of restarted coordinate descent on the mean second-layer distance
        (plus, in relaxed mode, the mean first-layer distance `prior` of the chosen candidates).

        Each sweep visits every position and, for every restart whose second-layer input there is not
        yet in the span, tries all candidates of that position with the other positions held fixed.
        Restarts begin from random candidates, avoiding the tokens of sequences already found. Rounds
        continue until `want` sequences pass or `limit` tokens (default: the attack's
        `encoder_token_budget`) have been run through block 1 by the search.
        """
        gen = torch.Generator().manual_seed(self.seed)
        length = len(cands)
        sizes = torch.tensor([c.numel() for c in cands])
        want = want or 1
        limit = self.encoder_token_budget if limit is None else min(limit, self.encoder_token_budget)
        restarts = self.encoder_restarts or want + 3
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
            self._search_spent += pk.shape[0] * length
            return dist.mean(dim=1) + first[positions[None], pk].mean(dim=1), dist

        exhausted = False

        def affordable(rows: int) -> bool:
            nonlocal exhausted
            if self._search_spent + rows * length > limit:
                exhausted = self._search_exhausted = True
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
            for _ in range(self.encoder_max_sweeps):
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

    # ------------------------------------------------------------------------------------------------------
    # Last tokens of causal sequences (labels only)

    def _last_tokens(self, target, layers: DagerLayers, update, seqs, batch_size, diag, flags):
        """Append each sequence's final token, recovered from the final-norm gradient.

        With next_token_loss, sequence b (T_b visible tokens) adds coef_b = 1 / (m T_b) times
        (softmax - onehot(label)) @ W_head to the gradient of the final norm's output at each of its
        positions, so the final norm's bias gradient is sum (softmax - onehot) @ W_head and its weight
        gradient the same weighted by x-hat (the normalised input). Everything is known from the
        recovered prefixes except the last label of each sequence, whose contribution is the "atom"
        -coef_b [x-hat_b * W[t] ; W[t]]. Greedy matching picks one token per sequence, then pairwise
        swaps and single re-picks reduce the residual; a residual near zero certifies the tokens.
        """
        norm = layers.final_norm
        ok = [False] * len(seqs)
        if not self.recover_last_token:
            flags.append("last tokens not recovered (recover_last_token=False)")
            return seqs, ok
        if norm is None:
            flags.append("last tokens not recovered: no final normalisation feeding the head was found")
            return seqs, ok
        names = [n for n in (norm.weight_name, norm.bias_name) if n is not None and n in update]
        if not names or not seqs:
            flags.append("last tokens not recovered: the final normalisation's gradient is not observed")
            return seqs, ok
        dtype = self.dtype
        device = layers.inputs.embedding.device
        head = norm.head_weight.detach().to(device, dtype)  # (V, d)
        count = batch_size or len(seqs)
        use_w, use_b = norm.weight_name in names, norm.bias_name in names
        known_w = torch.zeros(head.shape[1], dtype=dtype, device=device)
        known_b = torch.zeros_like(known_w)
        coef = torch.tensor([1.0 / (count * len(s)) for s in seqs], dtype=dtype, device=device)
        last_hat = torch.empty(len(seqs), head.shape[1], dtype=dtype, device=device)
        width = max(len(s) for s in seqs)
        rows = max(1, self.token_budget // width)
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
        observed_w = update[norm.weight_name].detach().to(device, dtype) if use_w else None
        observed_b = update[norm.bias_name].detach().to(device, dtype) if use_b else None
        observed_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in (observed_w, observed_b) if g is not None))
        # target vector: sum_b atom(b, t_b) with atom(b, t) = coef_b [x-hat_b * W[t] ; W[t]]
        z_w = known_w - observed_w if use_w else torch.zeros_like(known_w)
        z_b = known_b - observed_b if use_b else torch.zeros_like(known_b)
        mw, mb = float(use_w), float(use_b)
        head_sq_hat = (head.pow(2) @ last_hat.pow(2).T) * mw + head.pow(2).sum(1, keepdim=True) * mb  # (V, n)
        sizes = coef.pow(2)[None] * head_sq_hat  # ||atom(b, t)||^2, (V, n)

        def gains(r_w: Tensor, r_b: Tensor, members: Tensor) -> Tensor:
            """2 <r, atom(b, t)> - ||atom(b, t)||^2 for the sequences `members`: (V, len(members))."""
            directions = mw * last_hat[members] * r_w[None] + mb * r_b[None]
            return 2 * coef[members][None] * (head @ directions.T) - sizes[:, members]

        def atom(b: int, t: int) -> tuple[Tensor, Tensor]:
            return mw * coef[b] * last_hat[b] * head[t], mb * coef[b] * head[t]

        n = len(seqs)

        def residual2(rw, rb) -> float:
            return float(rw.pow(2).sum() + rb.pow(2).sum())

        def residual_of(chosen: list[int]) -> tuple[Tensor, Tensor]:
            r_w, r_b = z_w.clone(), z_b.clone()
            for b, t in enumerate(chosen):
                a_w, a_b = atom(b, t)
                r_w, r_b = r_w - a_w, r_b - a_b
            return r_w, r_b

        def greedy() -> list[int]:
            chosen = [-1] * n
            r_w, r_b = z_w.clone(), z_b.clone()
            remaining = list(range(n))
            while remaining:
                g = gains(r_w, r_b, torch.tensor(remaining, device=device))
                best = int(g.max(dim=0).values.argmax())
                b, t = remaining[best], int(g[:, best].argmax())
                chosen[b] = t
                remaining.remove(b)
                a_w, a_b = atom(b, t)
                r_w, r_b = r_w - a_w, r_b - a_b
            return chosen

        def support_assignment() -> list[int] | None:
            """Tokens from the bias part (sum of coef_b * W[t_b]: a sparse non-negative combination of
            head rows, found by orthogonal matching pursuit), then which sequence ends with which by
            least squares on the full system (one-hot assignment relaxed to real weights)."""
            if not use_b or n < 2:
                return None
            support = _matching_pursuit(head, z_b, n)
            if not support or n * len(support) > 4 * head.shape[1]:
                return None
            columns = []
            for b in range(n):
                for t in support:
                    a_w, a_b = atom(b, t)
                    columns.append(torch.cat([a_w, a_b]))
            system = torch.stack(columns, dim=1)  # (2d, n |T|)
            scale = float(system.norm(dim=0).mean())
            rows = torch.zeros(n, n * len(support), dtype=dtype, device=device)
            for b in range(n):
                rows[b, b * len(support) : (b + 1) * len(support)] = scale  # sum_t y_bt = 1
            lhs = torch.cat([system, rows])
            rhs = torch.cat([z_w, z_b, torch.full((n,), scale, dtype=dtype, device=device)])
            weights = torch.linalg.lstsq(lhs, rhs[:, None]).solution.view(n, len(support))
            return [support[int(i)] for i in weights.argmax(dim=1)]

        def refine(chosen: list[int]) -> tuple[list[int], Tensor, Tensor]:
            """Local search: single re-picks over the vocabulary and pairwise swaps, while they help."""
            chosen = list(chosen)
            r_w, r_b = residual_of(chosen)
            for _ in range(4 * n + 4):
                improved = False
                current = residual2(r_w, r_b)
                for b in range(n):
                    a_w, a_b = atom(b, chosen[b])
                    base_w, base_b = r_w + a_w, r_b + a_b
                    t = int(gains(base_w, base_b, torch.tensor([b], device=device))[:, 0].argmax())
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

        best = None
        for start in (support_assignment(), greedy()):
            if start is None:
                continue
            candidate = refine(start)
            if best is None or residual2(candidate[1], candidate[2]) < residual2(best[1], best[2]):
                best = candidate
            if residual2(best[1], best[2]) < (self.last_token_tol * observed_norm) ** 2 * 1e-4:
                break  # already certified: skip the other start
        chosen, r_w, r_b = best
        relative = math.sqrt(residual2(r_w, r_b)) / max(observed_norm, _TINY)
        diag["last_token_residual"] = relative
        exact = relative < self.last_token_tol
        if not exact:
            flags.append(f"last-token residual {relative:.2e} >= {self.last_token_tol:.0e}")
        return [seq + [chosen[i]] for i, seq in enumerate(seqs)], [exact] * len(seqs)

    # ------------------------------------------------------------------------------------------------------
    # Relaxed (best-effort) path

    def _relaxed(self, target, layers, update, basis1, basis2, batch_size, max_length, diag) -> DagerResult:
        inputs = layers.inputs
        flags: list[str] = []
        top_k = self.relaxed_top_k or max(2, batch_size or 1)
        # A causal model's last position is never an input that reaches the loss.
        steps = max(1, max_length - 1) if layers.causal else max_length
        positions: list[int | None] = [None] if layers.rope else list(range(steps))
        dist = token_distances(basis1, inputs, positions, self.vocab_chunk, self.dtype)
        if not layers.rope:
            # Positions past the longest sequence hold no token: their best distance is about the
            # vocabulary's median, while a real (noisy) token stands out. Keep up to the last one that does.
            ratio = dist.min(dim=1).values / dist.median(dim=1).values.clamp_min(_TINY)
            present = torch.nonzero(ratio < self.relaxed_presence).flatten()
            diag["relaxed_best_to_median"] = [round(float(r), 3) for r in ratio]
            if present.numel():
                steps = int(present.max()) + 1
                dist = dist[:steps]
        if layers.rope:
            k = min(dist.shape[1], top_k * steps)
            order = torch.argsort(dist[0])[:k]
            candidates, prior = [order.cpu()], [dist[0, order]]
        else:
            orders = [torch.argsort(row)[:top_k] for row in dist]
            candidates = [o.cpu() for o in orders]
            prior = [row[o] for row, o in zip(dist, orders)]
        diag["mode"] = "relaxed"
        diag["candidates_per_position"] = [int(c.numel()) for c in candidates]
        probe = _SecondLayer(target, layers, basis2, self.token_budget)
        beam = max(1, batch_size or 1) * 2
        if layers.causal:
            seqs, scores = self._causal_search(
                target, layers, probe, candidates, steps, batch_size, beam, flags, prior=prior
            )
        else:
            self._search_spent = 0
            seqs, scores = self._coordinate_descent(probe, candidates, batch_size, prior=prior, rounds=1)
        diag["second_layer_evaluations"] = probe.evaluations
        seqs, scores, _ = self._choose(seqs, scores, [False] * len(seqs), batch_size)
        if layers.causal and seqs:
            seqs, _ = self._last_tokens(target, layers, update, seqs, batch_size, diag, flags)
        diag["flags"] = flags
        diag.setdefault("reason", "no exact reconstruction")
        return DagerResult(seqs, False, [False] * len(seqs), scores, diag)


def dager_attack(
    target: nn.Module,
    update: Mapping[str, Tensor],
    batch_size: int | None = None,
    max_length: int | None = None,
    **options,
) -> DagerResult:
    """Functional shortcut: `Dager(**options).attack(target, update, batch_size, max_length)`."""
    return Dager(**options).attack(target, update, batch_size, max_length)
