"""Span evidence: DAGER's first-layer test as graded, server-computable scores for a learned inverter.

The rows of the first attention layer's weight gradient lie in the span of the batch's first-layer
inputs, so every vocabulary token t at every position p has a distance to that span (DAGER's step 1,
`exact.dager.span`). Without a defense and while the batch's m * L tokens are fewer than the width d,
the batch's tokens are at distance ~0 and every other token is not: the test names the tokens of each
position exactly, but not which sequence each belongs to. Under sign, pruning or noise the span is
full-rank; capped at its m * L strongest directions (and at `max_span_fraction` of the width, so that
a batch with more tokens than d still leaves a complement) the distance degrades into a ranking.

`SpanEvidence(update)` turns a batch of defended updates into scores z (U, L, V): the mean log-distance
of the position minus the token's own, so that larger is closer and a score is comparable across
updates whatever their rank. The learned inverter adds a learned function of z to its logits
(`lti.evidence_prior`). Plain PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from datamodules.targets.hf import cache_keyword
from exact.dager.span import SpanBasis, numerical_ranks, token_distances
from exact.layers import capture_input, find_layers
from exact.option_group import OptionGroup

#: Added to every distance before the log: distances below it (exact membership up to float32
#: rounding of the expansion, about 1e-4) all count as "in the span".
DISTANCE_FLOOR = 1e-4


def _finite(spaces: Tensor) -> Tensor:
    """Input spaces in float64 with non-finite entries (a corrupted or adversarial update) set to 0."""
    return torch.nan_to_num(spaces.detach().double(), nan=0.0, posinf=0.0, neginf=0.0)


def _capped_ranges(spaces: Tensor, rank_tol: float, max_rank: int) -> Tensor:
    """(U, d, r) float64 orthonormal bases of the updates' spans (U, d, width), from a thin SVD (d * width^2,
    not the d^3 of a full basis: LoRA's 2r columns are far fewer than d), each of its numerical rank capped
    at `max_rank`; an update of lower rank is padded with zero columns (they project to 0)."""
    left, s, _ = torch.linalg.svd(_finite(spaces).cpu(), full_matrices=False)  # one matrix at a time on a GPU: on the CPU
    ranks = numerical_ranks(s, rank_tol).clamp_max(max_rank)
    keep = torch.arange(left.shape[-1])[None] < ranks[:, None]  # (U, width)
    width = int(ranks.max()) if ranks.numel() else 0
    return (left * keep[:, None]).narrow(-1, 0, max(width, 1)).to(spaces.device)


@dataclass(frozen=True)
class EvidenceOptions(OptionGroup):
    """The hybrid learned attack's exact evidence (issue 33): DAGER's first-layer span test as an input.

    Args:
        enabled: Add the scores of the span test to the inverter's logits (reads the defended update of
            every training batch, so the updates are computed on the fly: no observation cache).
        max_span_fraction: Keep at most this fraction of the width d as span directions (the strongest
            singular directions), so that updates of more than d tokens still rank tokens.
        blocks: `qkv` (all three projection blocks of the first attention layer) or `q` (the query only).
        rank_tol: Singular values below rank_tol times the largest count as zero (the numerical rank).
    """

    enabled: bool = False
    max_span_fraction: float = 0.9
    blocks: str = "qkv"
    rank_tol: float = 1e-6

    def _check(self) -> None:
        if not 0.0 < self.max_span_fraction < 1.0:
            raise ValueError(f"evidence.max_span_fraction={self.max_span_fraction} must be in (0, 1)")
        if self.blocks not in ("q", "qkv"):
            raise ValueError(f"evidence.blocks {self.blocks!r} is not allowed; use 'q' or 'qkv'")
        if self.rank_tol <= 0:
            raise ValueError(f"evidence.rank_tol={self.rank_tol} must be > 0")


class SpanEvidence(nn.Module):
    """Per-position token scores (U, L, V) of a batch of defended updates, from the first attention layer.

    `target` is the global model; `observed` the parameter names the server observes (the first
    layer's projection must be among them); `tokens_per_update` caps the span rank at the update's
    m * L tokens.
    """

    def __init__(self, target: nn.Module, observed: list[str], tokens_per_update: int, seq_len: int,
                 options: EvidenceOptions = EvidenceOptions()) -> None:
        super().__init__()
        try:
            layers = find_layers(target)
        except ValueError as error:
            raise ValueError(f"model.evidence needs the first attention layer of the target: {error}") from None
        self.first, self.inputs, self.options = layers.first, layers.inputs, options
        sources = self.first.sources(set(observed), options.blocks)
        if sources is None:
            raise ValueError(f"model.evidence reads the first attention layer's gradient "
                             f"({', '.join(self.first.names(options.blocks))}, or its LoRA adapters' lora_A), which "
                             "the server does not observe under data.observed; observe it or disable model.evidence")
        self.names = [name for _, name in sources]  # what `spans` reads from each update
        if self.inputs.positions is not None and seq_len > self.inputs.num_positions:
            raise ValueError(f"model.evidence: seq_len {seq_len} exceeds the target's {self.inputs.num_positions} positions")
        self.seq_len = seq_len
        self.max_rank = min(tokens_per_update, int(math.floor(options.max_span_fraction * self.inputs.dim)))

    def input_spaces(self, update: dict[str, Tensor]) -> Tensor:
        """(U, d, width): each update's first-layer gradient as columns in the input space."""
        count = next(iter(update.values())).shape[0]
        return torch.stack([self.first.input_space({n: update[n][u] for n in self.names}, self.options.blocks)
                            for u in range(count)])

    def spans(self, update: dict[str, Tensor]) -> list[SpanBasis]:
        """One span basis per update of the batched update dict {name: (U, *shape)} (one batched eigendecomposition)."""
        spaces = self.input_spaces(update)  # (U, d, width)
        count = spaces.shape[0]
        g = _finite(spaces)
        # The left singular vectors of g are the eigenvectors of g g^T (d x d). Small batched
        # decompositions run one matrix at a time on a GPU (milliseconds each), so they run on the CPU.
        values, vectors = torch.linalg.eigh((g @ g.transpose(1, 2)).cpu())
        s = values.flip(-1).clamp_min(0).sqrt()  # descending singular values
        left = vectors.flip(-1).to(spaces.device)
        numerical = numerical_ranks(s, self.options.rank_tol).tolist()
        return [SpanBasis(left[u], s[u], numerical[u], min(numerical[u], self.max_rank)) for u in range(count)]

    def ranges(self, update: dict[str, Tensor], spaces: Tensor | None = None) -> Tensor:
        """(U, d, r) each update's capped span as an orthonormal basis, zero columns past its rank: the range
        of `spans` (`_capped_ranges`). `spaces`: the updates' `input_spaces`, if already computed."""
        spaces = self.input_spaces(update) if spaces is None else spaces
        return _capped_ranges(spaces, self.options.rank_tol, self.max_rank)

    def distances(self, update: dict[str, Tensor], tokens: Tensor | None = None, chunk: int = 8) -> Tensor:
        """(U, L, V) distance of every token (or (U, L, C) of the token ids `tokens`, (C,)) at every
        position to each update's capped span, float32.

        Without a normalisation before the first attention (post-LN models such as transformer3) the
        input is y = s E[t] + c_p and ||N^T y||^2 expands into a per-token part (a (V, d) x (d, d)
        product per update) and (V, L) cross terms; other models go through the per-update reference
        `token_distances`, which this fast path is tested against.
        """
        bases = self.spans(update)
        positions = list(range(self.seq_len))
        if self.inputs.norm != "none":
            full = torch.stack([token_distances(b, self.inputs, positions).float() for b in bases])
            return full if tokens is None else full[..., tokens.to(full.device)]
        device = bases[0].u.device
        u = torch.stack([b.u for b in bases]).float()  # (U, d, d)
        ranks = torch.tensor([b.rank for b in bases], device=device)
        complement = (torch.arange(u.shape[1], device=device)[None] >= ranks[:, None]).float()  # (U, d)
        embedding = self.inputs.embedding.detach()
        rows = embedding if tokens is None else embedding[tokens.to(embedding.device)]
        tokens = self.inputs.scale * rows.to(device, torch.float32)  # (V, d)
        consts = torch.stack([self.inputs.constant(p, torch.float32).to(device) for p in positions])  # (L, d)
        norm_sq = tokens.pow(2).sum(1)[:, None] + 2 * tokens @ consts.T + consts.pow(2).sum(1)[None]  # (V, L) ||y||^2
        out = torch.empty(len(bases), self.seq_len, tokens.shape[0], device=device)
        for start in range(0, len(bases), chunk):
            basis, w = u[start : start + chunk], complement[start : start + chunk, None]  # (c, d, d), (c, 1, d)
            tok = torch.matmul(tokens, basis)  # (c, V, d): coordinates in each update's singular basis
            con = torch.matmul(consts, basis)  # (c, L, d)
            residual = ((tok.pow(2) * w).sum(-1, keepdim=True) + 2 * (tok * w) @ con.transpose(1, 2)
                        + (con.pow(2) * w).sum(-1)[:, None])  # (c, V, L)
            out[start : start + chunk] = (residual.clamp_min(0) / norm_sq.clamp_min(1e-30)).sqrt().transpose(1, 2)
        return out

    def forward(self, update: dict[str, Tensor], tokens: Tensor | None = None, reference: Tensor | None = None) -> Tensor:
        """(U, L, V) scores: the position's mean log-distance minus the token's (larger: closer to the span).

        With token ids `tokens` (C,) only their (U, L, C) scores, the mean taken over the columns
        `reference` (indices into `tokens` of a uniform draw from the vocabulary: an estimate of the
        vocabulary's mean that the batch's own tokens do not bias). A training step with a sampled
        softmax scores a few thousand tokens instead of V.
        """
        log_distance = torch.log(self.distances(update, tokens) + DISTANCE_FLOOR)
        base = log_distance if reference is None else log_distance[..., reference]
        return base.mean(-1, keepdim=True) - log_distance


@dataclass
class Candidates:
    """The tokens a position-free span test puts in each update, and what the span says of each.

    For a target whose first-layer input carries no position (RoPE: SmolLM2, Llama), the span test
    names the update's bag of tokens but not their order. Part of the order is in the gradient itself:
    each span row is sum_t a_t x_t over the update's token inputs x_t, and a_t (the gradient reaching
    position t, through the LoRA B matrix for an adapter) depends on where t stands: the first
    position's query gradient vanishes, early keys and values collect the attention of every later
    query. Solving for a over the candidates gives each candidate a position-bearing signature.
    """

    ids: Tensor  #: (U, K) token ids, the closest to each update's span first
    scores: Tensor  #: (U, K) span scores (the vocabulary's mean log-distance minus the token's)
    coefficients: Tensor  #: (U, K, width) the candidates' least-squares coefficients in the span rows, over their norm


class CandidateEvidence:
    """`count` candidates per update from a position-free first layer (`Candidates`), in batches.

    Every token's first-layer input is the same at every position, so the inputs of the whole
    vocabulary are computed once (V, d) and each batch's distances are one product with the
    updates' span ranges: ||x||^2 - ||R^T x||^2, in float64 (the range branch of DAGER's
    `token_distances`, which this is tested against).
    """

    def __init__(self, evidence: SpanEvidence, count: int, chunk: int = 16) -> None:
        inputs = evidence.inputs
        if inputs.positions is not None:
            raise ValueError("candidate evidence is for targets whose first-layer input carries no position (RoPE "
                             "models); a target with position embeddings scores every position apart: use model.evidence")
        if not 0 < count <= inputs.vocab_size:
            raise ValueError(f"candidate count {count} must be in [1, {inputs.vocab_size}] (the vocabulary)")
        self.evidence, self.count, self.chunk = evidence, count, chunk
        self._inputs: Tensor | None = None

    def vocabulary_inputs(self, device: torch.device) -> Tensor:
        """(V, d) float64: every token's first-layer input (computed once)."""
        if self._inputs is None or self._inputs.device != device:
            inputs = self.evidence.inputs
            ids = torch.arange(inputs.vocab_size, device=inputs.embedding.device)
            self._inputs = inputs(ids, None).detach().to(device)
        return self._inputs

    def __call__(self, update: dict[str, Tensor]) -> Candidates:
        spaces = self.evidence.input_spaces(update)
        bases = self.evidence.ranges(update, spaces)
        spaces = _finite(spaces)  # (U, d, width)
        x = self.vocabulary_inputs(spaces.device)
        x_sq = x.pow(2).sum(1)  # (V,)
        ids, scores, coefficients = [], [], []
        for start in range(0, len(bases), self.chunk):
            chunk = bases[start : start + self.chunk]
            projected = torch.matmul(x, chunk.to(x)).pow(2).sum(-1)  # (c, V)
            distance = ((x_sq - projected).clamp_min(0) / x_sq.clamp_min(1e-300)).sqrt()
            log_distance = torch.log(distance + DISTANCE_FLOOR)
            score = log_distance.mean(1, keepdim=True) - log_distance
            top = score.topk(self.count, dim=1)  # (c, K)
            chosen = x[top.indices]  # (c, K, d)
            solution = torch.linalg.lstsq(chosen.transpose(1, 2), spaces[start : start + len(chunk)]).solution  # (c, K, width)
            norm = solution.flatten(1).norm(dim=1).clamp_min(1e-300)[:, None, None]
            ids.append(top.indices)
            scores.append(top.values.float())
            coefficients.append((solution / norm).float())
        return Candidates(torch.cat(ids), torch.cat(scores), torch.cat(coefficients))


class SecondLayerEvidence:
    """DAGER's second-layer test as a graded score of candidate prefixes, for a decoder's beam search.

    The rows of the second attention layer's weight gradient (its LoRA adapters' lora_A rows) lie in
    the span of that layer's inputs, and in a causal model the input at position p depends on the
    prefix up to p only. So a prefix's last input has a distance to the span: about 1e-6 for the
    client's own prefix (one sequence, no defense) against 1e-2 and more for others, and a ranking
    still under clipping or rounding. The score is -log(distance + DISTANCE_FLOOR).

    In a causal language model's update the last of the `seq_len` tokens is a label only (its inputs
    get no gradient), so only the first `seq_len - 1` positions are scored. Each call runs block 0
    alone for one new token per prefix, from the prefixes' layer-0 key/value cache (as DAGER's
    causal search does); the cache rows are returned for the caller to keep the extensions it chooses.
    """

    def __init__(self, target: nn.Module, observed: list[str], seq_len: int, rank_tol: float = 1e-6,
                 blocks: str = "qkv") -> None:
        try:
            layers = find_layers(target)
        except ValueError as error:
            raise ValueError(f"the second-layer test needs the target's first two attention layers: {error}") from None
        if not layers.causal or layers.hf_base_model is None:
            raise ValueError("the second-layer test scores prefixes of a causal Hugging Face decoder; "
                             f"this target is {layers.architecture}")
        sources = layers.second.sources(set(observed), blocks)
        if sources is None:
            raise ValueError(f"the second-layer test reads the second attention layer's gradient "
                             f"({', '.join(layers.second.names(blocks))}, or its LoRA adapters' lora_A), which the "
                             "server does not observe")
        self.layers, self.blocks, self.rank_tol = layers, blocks, rank_tol
        self.names = [name for _, name in sources]
        self.visible = seq_len - 1  # the last token is a label only

    def input_spaces(self, update: dict[str, Tensor]) -> Tensor:
        """(U, d, width) float32: each update's second-layer gradient as columns in its input space."""
        count = next(iter(update.values())).shape[0]
        return torch.stack([self.layers.second.input_space({n: update[n][u] for n in self.names}, self.blocks)
                            for u in range(count)]).float()

    def ranges(self, spaces: Tensor) -> Tensor:
        """(U, d, r) float64 orthonormal bases of the spans (`_capped_ranges`), capped at the `seq_len - 1`
        inputs of one sequence."""
        return _capped_ranges(spaces, self.rank_tol, self.visible)

    @torch.no_grad()
    def extend(self, tokens: Tensor, position: int, ranges: Tensor,
               cache: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Scores (n, g) of g prefixes per update, whose layer-0 key/value cache is `cache` (rows
        (n g, ...); None at position 0), extended by `tokens` (n g,) at `position`, against each
        update's `ranges` (n, d, r); and the extended prefixes' cache (rows (n g, ...))."""
        from transformers import DynamicCache

        base = self.layers.hf_base_model
        device = self.layers.inputs.embedding.device
        tokens = tokens.to(device)
        kv = DynamicCache() if cache is None else DynamicCache(ddp_cache_data=[cache])
        positions = torch.full((tokens.shape[0], 1), position, dtype=torch.long, device=device)
        hidden = capture_input(self.layers.second_input_module, lambda: base(
            input_ids=tokens[:, None], position_ids=positions, use_cache=True, **{cache_keyword(base): kv}))
        v = hidden[:, -1].double().view(ranges.shape[0], -1, hidden.shape[-1])  # (n, g, d)
        inside = torch.matmul(v, ranges.to(v)).pow(2).sum(-1)
        norm = v.pow(2).sum(-1)
        distance = ((norm - inside).clamp_min(0) / norm.clamp_min(1e-300)).sqrt()
        layer = kv.layers[0]
        return -torch.log(distance + DISTANCE_FLOOR).float(), (layer.keys, layer.values)
