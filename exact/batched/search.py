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
it is the global model's most likely continuation. `exact.batched.attack.least_squares_check` then
re-simulates the sequences' gradients and fits the update. Plain PyTorch.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from datamodules.float_noise import same_up_to_float_noise
from datamodules.targets.hf import cache_keyword
from exact.batched.sites import Site, capture_site_inputs

#: The precisions a screen's forward pass may run in.
SCREEN_PRECISIONS = ("float32", "bfloat16")

#: Singular values of a deflated row space below this fraction of the undeflated space's largest are
#: float32 noise of the returned weights, not directions of unknown inputs.
ROW_SPACE_TOLERANCE = 1e-5
#: Inputs whose whitened singular values fall below this fraction of the largest are duplicates of others.
KNOWN_TOLERANCE = 1e-6
LOG_FLOOR = 1e-12
#: Row spaces of more rows than this (a full-weight site: GPT-2's MLP down-projection has 768) are found from
#: their Gram matrix, about 7 times faster than an SVD at 768 rows (0.095 s against 0.68 s for GPT-2's 12 sites on an
#: H200); the LoRA sites (2r rows) keep the SVD, so their searches round as they always did.
GRAM_ABOVE = 256


def _basis(matrix: Tensor, tolerance: float, reference: float | None = None) -> Tensor:
    """(d, r) orthonormal basis of the column space of `matrix` (d, n), singular values below `tolerance`
    times `reference` (default: its largest) dropped."""
    if matrix.shape[1] == 0:
        return matrix
    left, values, _ = torch.linalg.svd(matrix, full_matrices=False)
    top = float(values[0]) if reference is None else reference
    return left[:, values > tolerance * top] if top > 0 else left[:, :0]


def _bases(matrices: Tensor, tolerance: float, references: Tensor | None = None, gram: bool = False) -> list[Tensor]:
    """`_basis` of each of the matrices (S, d, n) at once (one batched SVD; `gram`: `_gram_svd`, for d >= n and
    `ROW_SPACE_TOLERANCE`'s cut)."""
    if gram and matrices.shape[-2] >= matrices.shape[-1]:
        left, values = _gram_svd(matrices)
    else:
        left, values, _ = torch.linalg.svd(matrices, full_matrices=False)
    tops = values[:, 0] if references is None else references.to(values)
    keep = (values > tolerance * tops[:, None]) & (tops[:, None] > 0)
    return [left[s][:, keep[s]] for s in range(matrices.shape[0])]


def _gram_svd(matrices: Tensor) -> tuple[Tensor, Tensor]:
    """Left singular vectors (S, d, n) and singular values (S, n), largest first, of matrices (S, d, n), d >= n,
    from the eigendecomposition of their Gram matrices (n, n). Squaring the singular values squares the
    condition number: a vector of singular value s is orthonormal to the others to within about eps (top / s)^2,
    2e-6 at `ROW_SPACE_TOLERANCE`'s cut (1e-5 of the top; about 1e-7 measured at 1.3e-5), enough for the float32
    span terms; not for `KNOWN_TOLERANCE`'s duplicates (1e-6), which stay with the SVD. Vectors of singular values
    near zero are noise; `_bases` drops them."""
    values, vectors = torch.linalg.eigh(matrices.transpose(-2, -1) @ matrices)
    values, vectors = values.flip(-1).clamp_min(0).sqrt(), vectors.flip(-1)
    left = (matrices @ vectors) / values.clamp_min(torch.finfo(values.dtype).tiny)[..., None, :]
    return left, values


@dataclass
class Known:
    """The whitened span of the inputs a search knows: an orthonormal basis (d, n_s) per site (a site drops
    the inputs that duplicate others), and each site's largest singular value, the tolerance's reference."""

    bases: list[Tensor]
    tops: Tensor  # (S,)

    @staticmethod
    def empty(dimension: int, sites: int, device: torch.device | str = "cpu") -> Known:
        return Known([torch.zeros(dimension, 0, dtype=torch.float64, device=device)] * sites,
                     torch.zeros(sites, dtype=torch.float64, device=device))


class SpanScorer:
    """Every site's whitened span test of one update: `known(inputs)` is the whitened span of the inputs a search
    knows (extended as it learns more), `deflate(known)` projects it out of the rows (`bases(inputs)`: both at
    once), `terms(hidden, bases)` grades candidates' inputs against what is left, site by site, and `score` weighs
    the sites' terms (`site_weights`, 1 each unless a learned scorer gives others)."""

    def __init__(self, rows: list[Tensor], whitening: Tensor, site_weights: Tensor | None = None) -> None:
        self.whitening = whitening.double()  # (S, d, d)
        self.whitening32 = self.whitening.float()
        self.rows = [r.double() @ w for r, w in zip(rows, self.whitening)]  # whitened (k, d) per site
        self.tops = [float(torch.linalg.matrix_norm(r, ord=2)) if r.numel() else 0.0 for r in self.rows]
        self._weigh(site_weights)

    def _weigh(self, site_weights: Tensor | None) -> None:
        self.site_weights = (torch.ones(len(self.rows), dtype=torch.float64) if site_weights is None
                             else site_weights.double().reshape(-1))
        if self.site_weights.numel() != len(self.rows):
            raise ValueError(f"{self.site_weights.numel()} site weights for {len(self.rows)} sites")

    def reweighed(self, site_weights: Tensor | None) -> SpanScorer:
        """This update's scorer (the same whitened rows) with other site weights (None: 1 each)."""
        other = copy.copy(self)
        other._weigh(site_weights)
        return other

    def known(self, inputs: list[Tensor] | None, extending: Known | None = None) -> Known:
        """The whitened span of known inputs (n, d) per site, or of `extending`'s span and these together.

        Extending projects the new inputs out of the span already found (twice: one Gram-Schmidt step loses
        orthogonality) and takes the basis of what is left, so an SVD costs the new inputs' count, not all the
        known ones': refinement knows every other sequence's inputs and, at each position, adds its own prefix
        (the beam's best prefix may change, so the prefix is added whole to the others' span). One batched SVD
        over the sites either way (each site knows as many inputs)."""
        if inputs is None or inputs[0].shape[0] == 0:
            return extending if extending is not None else Known.empty(self.whitening.shape[-1], len(self.rows),
                                                                       self.whitening.device)
        z = (torch.stack([k.double() for k in inputs]) @ self.whitening.to(inputs[0].device)).transpose(1, 2)
        if extending is None:
            left, values, _ = torch.linalg.svd(z, full_matrices=False)  # z: (S, d, n)
            tops = values[:, 0]
            keep = (values > KNOWN_TOLERANCE * tops[:, None]) & (tops[:, None] > 0)
            return Known([left[s][:, keep[s]] for s in range(z.shape[0])], tops)
        rest = []
        for k, part in zip(extending.bases, z):
            k = k.to(part)
            part = part - k @ (k.T @ part)
            rest.append(part - k @ (k.T @ part))
        # The tolerance's reference: a lower bound on the largest singular value of everything known (the span's
        # and the new inputs' largest norm), which one SVD of all of them would take. It only decides within the
        # tolerance's band (near-duplicates at float32 rounding), where either choice is as good.
        tops = torch.maximum(extending.tops.to(z), z.norm(dim=1).max(dim=1).values)
        added = _bases(torch.stack(rest), KNOWN_TOLERANCE, tops)
        return Known([torch.cat([k.to(z), a], dim=1) for k, a in zip(extending.bases, added)], tops)

    def deflate(self, known: Known) -> list[tuple[Tensor, Tensor]]:
        """Per site (known basis (d, n'), deflated row-space basis (d, r')): the rows with `known` projected out."""
        ks = [k.to(rows) for k, rows in zip(known.bases, self.rows)]
        left = [rows.T - k @ (k.T @ rows.T) for k, rows in zip(ks, self.rows)]
        if len({x.shape for x in left}) == 1:
            spans = _bases(torch.stack(left), ROW_SPACE_TOLERANCE, torch.tensor(self.tops, dtype=torch.float64),
                           gram=left[0].shape[1] > GRAM_ABOVE)
        else:
            spans = [_basis(x, ROW_SPACE_TOLERANCE, top) for x, top in zip(left, self.tops)]
        return list(zip(ks, spans))

    def bases(self, inputs: list[Tensor] | None) -> list[tuple[Tensor, Tensor]]:
        """Per site (known basis (d, n'), deflated row-space basis (d, r')) for known inputs (n, d) per site."""
        return self.deflate(self.known(inputs))

    def terms(self, hidden: list[Tensor], bases: list[tuple[Tensor, Tensor]],
              sites: range | None = None) -> Tensor:
        """(K, len(sites)) float64 log-fractions of the candidates' inputs `hidden` (K, d) per site, of the
        sites `sites` (default: all; `hidden` holds those sites' inputs, in order)."""
        sites = range(len(self.rows)) if sites is None else sites
        columns = []
        for site, h in zip(sites, hidden):
            k, rows = bases[site]
            # float32: a score needs a few digits, and V * d * d products per site dominate the search otherwise
            z = h.float() @ self.whitening32[site]
            if k.shape[1]:
                z = z - (z @ k.float()) @ k.float().T
            inside = (z @ rows.float()).pow(2).sum(1)
            fraction = inside / z.pow(2).sum(1).clamp_min(1e-300)
            columns.append(torch.log(fraction.double() + LOG_FLOOR))
        return torch.stack(columns, dim=1)

    def score(self, hidden: list[Tensor], bases: list[tuple[Tensor, Tensor]], sites: range | None = None) -> Tensor:
        """(K,) the sites' terms weighed by `site_weights`."""
        sites = range(len(self.rows)) if sites is None else sites
        return self.terms(hidden, bases, sites) @ self.site_weights[sites.start:sites.stop].to(hidden[0].device)


def decoder(target: nn.Module) -> tuple[nn.Module, nn.Module, torch.device]:
    """(the causal LM, its decoder without the vocabulary projection, their device): site inputs need only the
    decoder; the prior needs the LM."""
    lm = getattr(target, "model", target)
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    for name in ("model", "transformer"):  # Llama-family decoders hold it as `model`, GPT-2 as `transformer`
        if isinstance(getattr(base, name, None), nn.Module):
            return lm, getattr(base, name), next(lm.parameters()).device
    return lm, base, next(lm.parameters()).device


@contextmanager
def fused_attention(target: nn.Module):
    """Within it, the global model's attention runs PyTorch's fused kernel (SDPA) where the model was built with the
    eager one (the workbench builds its targets eager: `torch.func.vmap`, which simulates the clients' per-sequence
    gradients, cannot batch the masked SDPA kernels). A search runs no gradient, and its forward passes extend
    thousands of prefixes by one token each (`benchmarks.investigations.batched.extension_speed` times both; the
    difference was within the CPU's run-to-run spread). The same inputs up to float rounding. A model that cannot
    switch is left as it is."""
    lm = _fuse(target)
    try:
        yield
    finally:
        if lm is not None:
            lm.set_attn_implementation("eager")


def _fuse(target: nn.Module) -> nn.Module | None:
    """Switch the causal LM of `target` to SDPA if its attention is eager and may switch; the LM switched, else None."""
    lm = decoder(target)[0]
    eager = getattr(getattr(lm, "config", None), "_attn_implementation", None) == "eager"
    fusable = (hasattr(lm, "set_attn_implementation") and getattr(lm, "_supports_sdpa", False)
               and getattr(lm, "_can_set_attn_implementation", lambda: False)())
    if not (eager and fusable):
        return None
    lm.set_attn_implementation("sdpa")
    return lm


def _in_fused_attention(search):
    """`search(target, ...)` run within `fused_attention(target)` (nested searches switch once)."""

    @functools.wraps(search)
    def run(target: nn.Module, *args, **kwargs):
        with fused_attention(target):
            return search(target, *args, **kwargs)

    return run


def _step(lm: nn.Module, tokens: Tensor, cache=None) -> tuple[Tensor, object]:
    """The next token's log-probabilities after each row of `tokens` (continuing `cache`, if given), and the
    cache. Only the last position's logits are computed: the vocabulary projection of every position would
    cost as much as the decoder."""
    extra = {cache_keyword(lm): cache} if cache is not None else {}
    out = lm(input_ids=tokens, use_cache=True, logits_to_keep=1, **extra)
    return out.logits[:, -1].float().log_softmax(-1), out["cache" if "cache" in out else "past_key_values"]


class ExtensionCache:
    """Site inputs of extensions (a prefix and one more token) an attack already computed, reused when a later step
    extends the same prefix by the same token: refinement regrows every sequence each pass, and a sequence already
    right (most of them, late in the passes) explores the prefixes it explored the pass before.

    An entry holds the first n sites' inputs of one extension (n: the most any request for it wanted), keyed by the
    precision it was computed in too; the least recently used go once the entries hold `max_bytes` (their tensors'
    bytes, on the model's device; Python's own overhead is not counted). Size it to hold a refinement pass's
    extensions (about B * beam * bag * (L - 2) screens of `screen_sites` inputs of d floats, and B * shortlist *
    (L - 2) full ones): a pass asks for nearly the same extensions in the same order as the pass before, so a
    smaller cache drops each before it is asked for again. A reused input is the one computed before, in another
    batch of extensions, so it may differ from a recompute by float rounding."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be > 0")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple, Tensor] = OrderedDict()
        self.bytes = 0
        self.reused = 0  #: extensions served from the cache
        self.computed = 0  #: extensions run through the model

    def get(self, key: tuple, sites: int) -> Tensor | None:
        """The first `sites` sites' inputs (sites, d) of the extension `key`, if held for that many sites."""
        entry = self.entries.get(key)
        if entry is None or entry.shape[0] < sites:
            return None
        self.entries.move_to_end(key)
        return entry[:sites]

    def put(self, key: tuple, inputs: Tensor) -> None:
        """Hold `inputs` (sites, d) for `key` (replacing what it held), then drop the least recently used entries
        beyond `max_bytes`."""
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self.entries[key] = inputs
        self.bytes += inputs.nbytes
        while self.bytes > self.max_bytes and self.entries:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= dropped.nbytes


def bfloat16_twin(target: nn.Module) -> nn.Module:
    """A copy of the global model whose parameters are bfloat16, for a screen (which only shortlists): on a CPU
    with bfloat16 instructions its matrix products run about twice as fast, and unlike autocast it casts no
    activation. Buffers stay as they are (RoPE's inverse frequencies rounded to bfloat16 would turn late
    positions' angles). It holds the weights of the moment it is made: an attack makes it once, for its searches.
    Its attention is fused for good (`fused_attention`: it never runs a gradient)."""
    twin = copy.deepcopy(target)
    for parameter in twin.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
        parameter.requires_grad_(False)
    _fuse(twin)
    return twin


@dataclass
class _LayerInput:
    """The residual stream entering decoder layer `layer` at the extensions' position, (K, d), and the layer's other
    arguments (position embeddings, mask, ...), as a screen's forward pass gave them."""

    layer: int
    hidden: Tensor
    arguments: dict

    def select(self, kept: Tensor) -> _LayerInput:
        return _LayerInput(self.layer, self.hidden[kept], self.arguments)


@dataclass
class Screened:
    """Extensions run through their first sites (`Prefixes.screen`): those sites' inputs (K, d) each, and the state
    `Prefixes.complete` resumes the rest from (None: it runs them whole)."""

    inputs: list[Tensor]
    resume_from: _LayerInput | None


def _site_count(upto: int | None, sites: int) -> int:
    """The sites a forward pass asked for `upto` sites (None: every site) runs through, at most `sites`."""
    if upto is not None and upto < 1:
        raise ValueError(f"upto={upto} must be >= 1 (or None: every site)")
    return sites if upto is None else min(upto, sites)


def _tensor_leaves(value) -> list[Tensor]:
    """The tensors inside `value` (a tensor, or dicts, lists and tuples of them)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _tensor_leaves(item)]
    return []


def _site_layers(target: nn.Module, base: nn.Module, sites: list[Site]) -> list[int] | None:
    """The index in `base.layers` of the decoder layer holding each site's module, if the decoder has `layers` and
    the sites run in their order; else None (no resuming from a layer)."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return None
    layer_of = {id(module): j for j, layer in enumerate(layers) for module in layer.modules()}
    modules = dict(target.named_modules())
    found = [layer_of.get(id(modules.get(site.modules[0]))) for site in sites]
    if any(j is None for j in found) or found != sorted(found):
        return None
    return found


class Prefixes:
    """Prefixes (P, p) run once through the global model: `logp` (P, V), their next token's log-probabilities,
    `inputs`, their own site inputs (P, p, d) per site, and `extend(rows, tokens)`, the site inputs of prefix
    `rows[k]` extended by `tokens[k]` (its last position), computed in chunks from the prefixes' cache.
    `screen_model` (`bfloat16_twin(target)`) runs the extensions asked for in "bfloat16", from the same cache
    cast to bfloat16."""

    #: Extensions per forward pass: each copies the prefix's key/value cache (every layer), so memory grows with
    #: rows * p; a few thousand tokens also keep the matrix products large enough for the CPU.
    CHUNK_TOKENS = 8192

    def __init__(self, target: nn.Module, sites: list[Site], ids: Tensor, screen_model: nn.Module | None = None) -> None:
        self.target, self.sites, self.screen_model = target, sites, screen_model
        lm, self.base, _ = decoder(target)
        self.site_layers = _site_layers(target, self.base, sites)
        stepped: list = []
        self.inputs = capture_site_inputs(target, sites, lambda: stepped.append(_step(lm, ids)))
        self.logp, self.cache = stepped[0]
        self.length = ids.shape[1]
        self.tokens = ids  #: (P, p) the prefixes' tokens (the keys of an `ExtensionCache`)

    def advance(self, rows: Tensor, tokens: Tensor) -> Prefixes:
        """The prefixes `rows[k]` extended by `tokens[k]`: only the new position runs through the model (from a
        copy of the cache), so a search pays one token per prefix and position, not the whole prefix again."""
        lm, _, _ = decoder(self.target)
        expanded = _reorder(self.cache, rows)
        stepped: list = []
        new = capture_site_inputs(self.target, self.sites, lambda: stepped.append(_step(lm, tokens[:, None], expanded)))
        out = Prefixes.__new__(Prefixes)
        out.target, out.sites, out.base, out.screen_model = self.target, self.sites, self.base, self.screen_model
        out.site_layers = self.site_layers
        out.logp, out.cache = stepped[0]
        out.inputs = [torch.cat([old[rows], h.to(old)], dim=1) for old, h in zip(self.inputs, new)]
        out.length = self.length + 1
        out.tokens = torch.cat([self.tokens[rows], tokens[:, None].to(self.tokens)], dim=1)
        return out

    def extend(self, rows: Tensor, tokens: Tensor, upto: int | None = None, precision: str = "float32",
               cache: ExtensionCache | None = None) -> list[Tensor]:
        """(K, d) per site (the first `upto` sites only: the forward pass stops there; without `upto` it stops at
        the last site, as `adapter_sites` lists the sites in the order the model runs them). `precision`
        "bfloat16": run by the `screen_model` (needed), the site inputs back in the model's dtype (for a screen,
        which only shortlists). `cache`: extensions it holds are not run again, and those run are put in it."""
        if precision not in SCREEN_PRECISIONS:
            raise ValueError(f"precision={precision!r} must be one of {', '.join(SCREEN_PRECISIONS)}")
        if precision == "bfloat16" and self.screen_model is None:
            raise ValueError("a bfloat16 extension needs the prefixes' screen_model (exact.batched.search.bfloat16_twin)")
        sites = _site_count(upto, len(self.sites))
        if cache is None or rows.numel() == 0:
            return self._extend(rows, tokens, sites, precision)
        prefixes = [tuple(p) for p in self.tokens.tolist()]
        keys = [(precision, prefixes[r], t) for r, t in zip(rows.tolist(), tokens.tolist())]
        found = [cache.get(key, sites) for key in keys]
        # Each missing extension once, though several rows ask for it (sequences sharing a prefix): its first row.
        first: dict[tuple, int] = {}
        for k, entry in enumerate(found):
            if entry is None:
                first.setdefault(keys[k], k)
        missing = list(first)
        cache.reused += len(keys) - len(missing)
        cache.computed += len(missing)
        if missing:
            where = torch.tensor(list(first.values()), device=rows.device)
            computed = torch.stack(self._extend(rows[where], tokens[where], sites, precision), dim=1)  # (m, sites, d)
            held = {}
            for j, key in enumerate(missing):
                held[key] = computed[j].clone()  # its own storage: an entry must not hold the whole batch alive
                cache.put(key, held[key])
            found = [held[key] if entry is None else entry for key, entry in zip(keys, found)]
        together = torch.stack(found)  # (K, sites, d)
        return [together[:, site] for site in range(sites)]

    def screen(self, rows: Tensor, tokens: Tensor, upto: int, precision: str = "float32",
               cache: ExtensionCache | None = None) -> Screened:
        """`extend(rows, tokens, upto, precision, cache)`, keeping what `complete` resumes from where it can: the
        residual stream entering the decoder layer of the last site run, with that layer's other arguments. It can
        for a decoder of `layers` whose sites run in layer order (a Llama's), in the model's own precision, without an
        extension cache, when those arguments are the same for every extension; else the state is None and
        `complete` runs the kept extensions whole."""
        sites = _site_count(upto, len(self.sites))
        layer = self.site_layers[sites - 1] if self.site_layers is not None and sites < len(self.sites) else None
        if layer is None or precision != "float32" or cache is not None or rows.numel() == 0:
            return Screened(self.extend(rows, tokens, upto, precision, cache), None)
        state: list[tuple[Tensor, dict] | None] = []
        inputs = self._extend(rows, tokens, sites, precision, entering=(layer, state))
        if any(entry is None for entry in state):
            return Screened(inputs, None)
        # Only the first chunk's arguments are kept: one new position after prefixes of one length gives every
        # extension the same position embeddings, and the fused attention no mask. Anything holding a row per
        # extension (the eager attention's mask) would need each chunk's own: then no resuming.
        arguments = state[0][1]
        if any(leaf.ndim and leaf.shape[0] != 1 for leaf in _tensor_leaves(arguments)):
            return Screened(inputs, None)
        return Screened(inputs, _LayerInput(layer, torch.cat([h for h, _ in state]), arguments))

    def complete(self, screened: Screened, kept: Tensor, rows: Tensor, tokens: Tensor,
                 cache: ExtensionCache | None = None) -> list[Tensor]:
        """Every site's inputs (K', d) of the extensions `rows[kept]`, `tokens[kept]` that `screened` (this run's
        `screen` of `rows`, `tokens`) ran through its first sites: the screened sites' inputs as the screen found
        them, the others resumed from the screen's state, so the kept extensions' first layers are not run again (the
        same inputs as `extend` up to float rounding: tested). Without a state, `extend` of the kept extensions."""
        done = len(screened.inputs)
        if done == len(self.sites):
            return [h[kept] for h in screened.inputs]
        if screened.resume_from is None:
            return self.extend(rows[kept], tokens[kept], cache=cache)
        if kept.numel() == 0:
            return [h[:0] for h in screened.inputs] + [screened.inputs[0][:0]] * (len(self.sites) - done)
        rest = self._resume(rows[kept], screened.resume_from.select(kept), done)
        return [h[kept] for h in screened.inputs] + rest

    def _extend(self, rows: Tensor, tokens: Tensor, sites: int, precision: str,
                entering: tuple[int, list] | None = None) -> list[Tensor]:
        """`extend` without a cache: every extension through the model (its first `sites` sites), in chunks.
        `entering` (layer, list): each chunk's last position of the residual stream entering that decoder layer,
        and the layer's other arguments, appended to the list (for `screen`)."""
        if rows.numel() == 0:
            return [self.inputs[0].new_zeros(0, self.inputs[0].shape[-1]) for _ in range(sites)]
        dtype = self.inputs[0].dtype
        model, low = (self.screen_model, torch.bfloat16) if precision == "bfloat16" else (self.target, None)
        base = self.base if low is None else decoder(model)[1]
        handle = None
        if entering is not None:
            layer, state = entering

            def keep(module, args, kwargs):
                if len(args) > 1:  # arguments by position besides the input: not resumed
                    state.append(None)
                    return
                hidden = args[0] if args else kwargs["hidden_states"]
                # The cache (whatever its keyword) is the chunk's own: `_resume` hands the layers a copy of its own.
                arguments = {k: v for k, v in kwargs.items() if k != "hidden_states" and not isinstance(v, Cache)}
                state.append((hidden[:, -1].detach(), arguments))

            handle = base.layers[layer].register_forward_pre_hook(keep, with_kwargs=True)

        def step(chunk: slice, expanded) -> list[Tensor]:
            def run():
                base(input_ids=tokens[chunk, None], use_cache=True, **{cache_keyword(base): expanded})

            return [h[:, -1].to(dtype) for h in capture_site_inputs(model, self.sites, run, upto=sites)]

        try:
            return self._in_chunks(rows, low, step)
        finally:
            if handle is not None:
                handle.remove()

    def _resume(self, rows: Tensor, entry: _LayerInput, first: int) -> list[Tensor]:
        """Sites `first`.. inputs (K, d each) of prefix `rows[k]` extended by the token whose residual stream entering
        decoder layer `entry.layer` is `entry.hidden[k]`: that layer and the later ones run from a copy of the
        prefixes' cache (those layers' keys and values of the prefix are all they read; the earlier layers' entries
        of the copy stay the prefix's and are never read), in chunks."""
        wanted = self.sites[first:]
        layers = self.base.layers[entry.layer : self.site_layers[-1] + 1]

        def step(chunk: slice, expanded) -> list[Tensor]:
            def run():
                hidden = entry.hidden[chunk, None]
                for layer in layers:
                    out = layer(hidden, **{cache_keyword(layer): expanded}, **entry.arguments)
                    hidden = out[0] if isinstance(out, tuple) else out  # transformers 4 returns a tuple

            return [h[:, -1] for h in capture_site_inputs(self.target, wanted, run, upto=len(wanted))]

        return self._in_chunks(rows, None, step)

    def _in_chunks(self, rows: Tensor, dtype: torch.dtype | None, step) -> list[Tensor]:
        """`step(chunk, cache)` (the chunk a slice of `rows`, the cache a copy of the prefixes' holding those rows, cast
        to `dtype` if given) per chunk of `CHUNK_TOKENS` prefix tokens, its per-site (k, d) inputs concatenated."""
        size = max(1, self.CHUNK_TOKENS // self.length)
        parts = []
        for start in range(0, rows.numel(), size):
            chunk = slice(start, start + size)
            parts.append(step(chunk, _reorder(self.cache, rows[chunk], dtype)))
        return [torch.cat(columns) for columns in zip(*parts)]


#: `first_site_reads_tokens_alone`'s answers per model and first site: a question of architecture, tried once.
_FIRST_SITE_ALONE: weakref.WeakKeyDictionary[nn.Module, dict[Site, bool]] = weakref.WeakKeyDictionary()


@torch.no_grad()
def first_site_reads_tokens_alone(target: nn.Module, sites: list[Site], token: int, other: int) -> bool:
    """Whether the first site's input is a function of the token alone, whatever its position and prefix: a Llama's
    first layer reads the normalised embedding (RoPE turns queries and keys inside the attention); GPT-2's adds a
    position's. Tried on `token` at positions 0, 1 and 2 after `other` (equal up to float32 noise), once per model
    and first site: the answer is the architecture's, so later calls (every search) reuse it."""
    answers = _FIRST_SITE_ALONE.setdefault(target, {})
    if sites[0] not in answers:
        lm, _, device = decoder(target)
        alone = capture_site_inputs(target, sites, lambda: lm(torch.tensor([[token]], device=device)), upto=1)[0][0, 0]
        later = capture_site_inputs(target, sites, lambda: lm(torch.tensor([[other, token, token]], device=device)),
                                    upto=1)[0][0, 1:]
        # The input is one normalisation of one embedding row: a sum over the width per value.
        answers[sites[0]] = same_up_to_float_noise(later, alone.expand_as(later), terms=alone.numel())
    return answers[sites[0]]


@_in_fused_attention
@torch.no_grad()
def grow_sequences(target: nn.Module, sites: list[Site], scorer: SpanScorer, bag: list[int], batch_size: int,
                   length: int, lm_weight: float = 0.0, deflate: bool = True, beam: int = 1,
                   label_candidates: int = 1, labels: list[list[int]] | None = None,
                   others: list[list[Tensor]] | None = None, screen_sites: int = 0,
                   shortlist: int = 0, fixed: list[Tensor] | None = None,
                   screen_precision: str = "float32", cache: ExtensionCache | None = None,
                   screen_model: nn.Module | None = None,
                   prefixes: list[list[int]] | None = None,
                   first_site_shortlist: int = 0) -> tuple[list[list[int]], list[list[float]]]:
    """B sequences of `length` tokens grown over the bag (each token usable any number of times), and each
    chosen token's margin over the runner-up (a confidence; the last token's is its LM log-probability
    margin). `labels`, if given, receives each sequence's `label_candidates` likeliest last tokens.

    Deflation: by default the sequences grow *jointly*: a candidate is scored with every sequence's chosen
    prefix known, and the sequences before it at this position. `others[i]` (inputs (n, d) per site, when
    refining: every other sequence's inputs as last found) makes sequence i grow on its own instead, with
    those and its own prefix known. `fixed` (inputs (n, d) per site) are known to every sequence growing jointly:
    the inputs of sequences of the batch already trusted, when the others are grown again together.

    `screen_sites`, `shortlist`: when both are set, every extension is first scored by the first
    `screen_sites` sites alone, weighed alike (the forward pass stops there; deflated by the inputs known
    when the position starts), and only the `shortlist` best per sequence run through every site; 0 scores
    every extension at every site. `screen_precision` "bfloat16": the screen's forward pass runs in `screen_model`
    (`bfloat16_twin(target)`, made here if not given; the full pass, which chooses, stays in the model's precision).
    `cache`: extensions computed before (by this search or an earlier one of the same attack) are reused
    (`ExtensionCache`). `first_site_shortlist` (with the screen): before it, the extensions are cut to this many per
    sequence by the first site's term alone (plus the prior and the prefix's score), read from the token's own input
    at position 0, so these need no forward pass; only where the first site reads the token alone
    (`first_site_reads_tokens_alone`: a RoPE model's first layer), else ignored.

    `prefixes[i]` (with `others` only: sequences growing on their own), bag tokens sequence i starts with: they are
    kept as they are (one extension a position, no beam) and the search grows the sequence from there (a refinement
    pass resuming after the prefix it verified: `verified_lengths`). Shorter than `length - 1`.

    The extensions of all B sequences' beams run through the model together (their inputs do not depend on
    each other); only their scores do, through deflation, so the choices are made sequence by sequence."""
    if others is not None and len(others) != batch_size:
        raise ValueError(f"others holds {len(others)} sequences' inputs for {batch_size} sequences")
    if others is not None and fixed is not None:
        raise ValueError("fixed inputs are for sequences growing jointly; with others, put them in others")
    if screen_precision not in SCREEN_PRECISIONS:
        raise ValueError(f"screen_precision={screen_precision!r} must be one of {', '.join(SCREEN_PRECISIONS)}")
    forced = [[] for _ in range(batch_size)] if prefixes is None else [list(p) for p in prefixes]
    if prefixes is not None:
        if others is None:
            raise ValueError("prefixes are for sequences growing on their own (with others)")
        if len(forced) != batch_size:
            raise ValueError(f"prefixes holds {len(forced)} sequences' prefixes for {batch_size} sequences")
        if any(len(p) >= length - 1 for p in forced):
            raise ValueError(f"a prefix must be shorter than length - 1 = {length - 1} (the last input is grown)")
        in_bag = set(bag)
        outside = [t for p in forced for t in p if t not in in_bag]
        if outside:
            raise ValueError(f"prefix token {outside[0]} is not in the bag")
    labels = [] if labels is None else labels
    if screen_precision == "bfloat16" and screen_model is None:
        screen_model = bfloat16_twin(target)
    lm, base, device = decoder(target)
    candidates = torch.tensor(bag, dtype=torch.long, device=device)
    sequences: list[list[int]] = [[] for _ in range(batch_size)]
    margins: list[list[float]] = [[] for _ in range(batch_size)]

    def joined(parts: list[list[Tensor]]) -> list[Tensor]:
        """Per site, the rows of every part (each a list of (n, d) per site) stacked."""
        return [torch.cat([part[site].to(parts[-1][site]) for part in parts]) for site in range(len(sites))]

    # The spans of what stays known all along, each found once: every other sequence's inputs when refining
    # (per sequence, as it is first needed), the trusted sequences' when growing some again.
    others_known: dict[int, Known] = {}

    def known_of_others(i: int) -> Known:
        if i not in others_known:
            others_known[i] = scorer.known(others[i])
        return others_known[i]

    fixed_known = scorer.known(fixed) if fixed is not None else None

    # Position 0: every sequence's first input is a bag token alone; no prefix, no prior.
    hidden = capture_site_inputs(target, sites, lambda: lm(candidates[:, None]))
    first = [h[:, 0] for h in hidden]
    first_site_cut = (0 < first_site_shortlist and 0 < screen_sites < len(sites)
                      and first_site_reads_tokens_alone(target, sites, bag[0], bag[-1]))
    chosen_rows: list[int] = []
    joint = scorer.known(None, fixed_known)  # growing jointly: each first token picked is known for the next
    for i in range(batch_size):
        if forced[i]:  # kept as it is: no score needed
            chosen_rows.append(bag.index(forced[i][0]))
            continue
        if not deflate:
            bases = scorer.bases(None)
        elif others is not None:
            bases = scorer.deflate(known_of_others(i))
        else:
            bases = scorer.deflate(joint)
        scores = scorer.score(first, bases)
        if chosen_rows and deflate and others is None:
            scores[chosen_rows] = -float("inf")
        chosen_rows.append(int(scores.argmax()))
        if deflate and others is None and i < batch_size - 1:
            joint = scorer.known([f[chosen_rows[-1] : chosen_rows[-1] + 1] for f in first], joint)
    for i, row in enumerate(chosen_rows):
        sequences[i].append(bag[row])
        margins[i].append(0.0)
    # A beam entry: (tokens, cumulative score); `run` holds every sequence's beam as rows of one batch of
    # prefixes, in sequence order, a sequence's best prefix first.
    beams = [[(list(s), 0.0)] for s in sequences]
    run = Prefixes(target, sites, torch.tensor(sequences, dtype=torch.long, device=device), screen_model)
    for p in range(1, length):
        owners = [i for i in range(batch_size) for _ in beams[i]]
        flat = [b for i in range(batch_size) for b in beams[i]]
        best_rows = [owners.index(i) for i in range(batch_size)]
        if p == length - 1:  # the last token is a label only: the model's own guess (`labels` keeps its runners-up)
            top = run.logp[best_rows].topk(max(2, label_candidates), dim=-1)
            for i in range(batch_size):
                sequences[i].append(int(top.indices[i, 0]))
                margins[i].append(float(top.values[i, 0] - top.values[i, 1]))
            labels[:] = top.indices[:, :label_candidates].tolist()
            break
        prefix_inputs = [[h[row] for h in run.inputs] for row in best_rows]  # each sequence's chosen prefix

        start: dict[int, tuple[Known | None, list[tuple[Tensor, Tensor]]]] = {}

        def at_start(i: int) -> tuple[Known | None, list[tuple[Tensor, Tensor]]]:
            """What sequence i's scores are deflated by when the position starts (None: nothing) and the deflation,
            computed once per position and sequence (the screen and the full pass deflate by the same inputs;
            growing jointly, every sequence starts from the same ones)."""
            key = i if others is not None else 0
            if key not in start:
                if not deflate:
                    start[key] = None, scorer.bases(None)
                else:
                    known = (scorer.known(prefix_inputs[i], known_of_others(i)) if others is not None
                             else scorer.known(joined(prefix_inputs), fixed_known))
                    start[key] = known, scorer.deflate(known)
            return start[key]

        def bases_at_start(i: int) -> list[tuple[Tensor, Tensor]]:
            return at_start(i)[1]

        # Every beam entry extended by every bag token; a sequence still inside its given prefix is extended by the
        # prefix's token alone, outside the scoring (its one beam entry is advanced below).
        kept_as_is = [p < len(forced[i]) for i in range(batch_size)]
        grown = [f for f in range(len(flat)) if not kept_as_is[owners[f]]]
        rows = torch.tensor(grown, dtype=torch.long, device=device).repeat_interleave(len(bag))
        tokens = candidates.repeat(len(grown))
        owner = torch.tensor(owners, device=device)[rows]
        cumulative = torch.tensor([b[1] for b in flat], dtype=torch.float64, device=device)[rows]
        prior = lm_weight * run.logp[rows, tokens].double()
        if 0 < screen_sites < len(sites) and 0 < shortlist < max(len(b) for b in beams) * len(bag):
            if first_site_cut:
                bag_rows = torch.arange(len(bag), device=device).repeat(len(grown))
                kept = _best_of_each(owner, kept_as_is, first_site_shortlist, lambda i, mine: (
                    cumulative[mine] + prior[mine]
                    + scorer.terms([first[0][bag_rows[mine]]], bases_at_start(i), range(1))[:, 0]), in_order=True)
                rows, tokens, owner, cumulative, prior = (rows[kept], tokens[kept], owner[kept], cumulative[kept],
                                                          prior[kept])
            screen = range(screen_sites)
            screened = run.screen(rows, tokens, screen_sites, screen_precision, cache)
            early_inputs = screened.inputs
            # The screen weighs its sites alike whatever the scorer's weights: it is there to keep the true
            # extension (a learned scorer may lean on later sites and leave the first ones little weight).
            kept = _best_of_each(owner, kept_as_is, shortlist, lambda i, mine: (
                cumulative[mine] + prior[mine]
                + scorer.terms([h[mine] for h in early_inputs], bases_at_start(i), screen).sum(1)))
            # The kept extensions' later sites resume from where the screen stopped.
            inputs = run.complete(screened, kept, rows, tokens, cache)
            rows, tokens, owner, cumulative, prior = rows[kept], tokens[kept], owner[kept], cumulative[kept], prior[kept]
        else:
            inputs = run.extend(rows, tokens, cache=cache)
        sources: list[int] = []  # the next position's prefixes: their rows in `run` and their new tokens
        chosen: list[int] = []
        known = at_start(0)[0] if others is None else None
        for i in range(batch_size):
            if kept_as_is[i]:
                entry = owners.index(i)
                beams[i] = [(flat[entry][0] + [forced[i][p]], 0.0)]
                sources.append(entry)
                chosen.append(forced[i][p])
                sequences[i] = list(beams[i][0][0])
                margins[i].append(0.0)
                continue
            # Joint: the inputs the sequences before this one chose at p are known too, so two sequences do not
            # both take the direction one true input explains.
            mine = (owner == i).nonzero()[:, 0]
            first_of_position = others is not None or i == 0  # else the sequences before this one chose inputs at p
            bases = bases_at_start(i) if first_of_position or known is None else scorer.deflate(known)
            step = scorer.score([h[mine] for h in inputs], bases)
            total = cumulative[mine] + step + prior[mine]
            keep_i = total.topk(min(beam, total.numel())).indices
            beams[i] = [(flat[int(rows[mine[k]])][0] + [int(tokens[mine[k]])], float(total[k])) for k in keep_i]
            sources += [int(rows[mine[k]]) for k in keep_i]
            chosen += [int(tokens[mine[k]]) for k in keep_i]
            sequences[i] = list(beams[i][0][0])
            if known is not None and i < batch_size - 1:
                best = int(mine[keep_i[0]])
                known = scorer.known([h[best : best + 1] for h in inputs], known)
            margins[i].append(float(total[keep_i[0]] - total[keep_i[-1]]) if len(keep_i) > 1 else 0.0)
        run = run.advance(torch.tensor(sources, device=device), torch.tensor(chosen, device=device))
    return sequences, margins


def _best_of_each(owner: Tensor, skip: list[bool], count: int, score, in_order: bool = False) -> Tensor:
    """The rows of the extensions' batch to keep: each sequence i's `count` best by `score(i, mine)` (its rows `mine`,
    scored (len(mine),)), sequence by sequence, best first (`in_order`: in the batch's order); none of a sequence
    `skip`ped."""
    keep = []
    for i in range(len(skip)):
        if skip[i]:
            continue
        mine = (owner == i).nonzero()[:, 0]
        if in_order and mine.numel() <= count:
            keep.append(mine)
            continue
        best = score(i, mine).topk(min(count, mine.numel())).indices
        keep.append(mine[best.sort().values if in_order else best])
    return torch.cat(keep) if keep else owner[:0]


def _reorder(cache, rows: Tensor, dtype: torch.dtype | None = None):
    """A copy of the key/value cache holding rows `rows` (repeats allowed), its keys and values cast to `dtype` if
    given (a bfloat16 screen's)."""
    copied = copy.deepcopy(cache)
    copied.reorder_cache(rows)
    if dtype is not None:
        for layer in copied.layers:
            layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
            if hasattr(layer, "dtype"):
                layer.dtype = dtype
    return copied


@_in_fused_attention
@torch.no_grad()
def sequence_inputs(target: nn.Module, sites: list[Site], sequences: list[list[int]] | Tensor) -> list[Tensor]:
    """Every site's inputs at the sequences' input positions (all but the last token, a label only):
    (B, L - 1, d) per site."""
    _, base, device = decoder(target)
    ids = torch.as_tensor(sequences, dtype=torch.long, device=device)[:, :-1]
    return capture_site_inputs(target, sites, lambda: base(ids))


def others_inputs(inputs: list[Tensor]) -> list[list[Tensor]]:
    """For each of the B sequences, every other sequence's inputs (n, d) per site, from `sequence_inputs`' (B, L - 1, d)
    per site: what a refinement pass knows while it grows that sequence again."""
    batch = inputs[0].shape[0]
    return [[torch.cat([h[:i], h[i + 1 :]]).reshape(-1, h.shape[-1]) for h in inputs] for i in range(batch)]


@_in_fused_attention
@torch.no_grad()
def verified_lengths(target: nn.Module, sites: list[Site], scorer: SpanScorer, bag: list[int],
                     sequences: list[list[int]], lm_weight: float = 0.0, screen_sites: int = 0, shortlist: int = 0,
                     beam: int = 1, places: int = 1, screen_precision: str = "float32",
                     cache: ExtensionCache | None = None, screen_model: nn.Module | None = None,
                     inputs: list[Tensor] | None = None) -> list[int]:
    """How many of each sequence's first input tokens a refinement pass's screen confirms: the length of its longest
    prefix whose every token ranks within the first `places` of the bag's extensions of the prefix before it, with
    every other sequence's inputs (as given) and that prefix known, scored as a refinement pass of that `beam`,
    `screen_sites` and `shortlist` first scores them (`grow_sequences`): by its screen where a pass with full beams
    screens (the first `screen_sites` sites weighed alike; a pass's second position, whose beam holds one prefix, may
    be scored by every site instead), else by every site weighed by the scorer; plus `lm_weight` times the global
    model's log-probability after the prefix. The first token is scored as a pass scores it, by every site. L - 1:
    every input confirmed. A token outside the bag is not confirmed. `inputs`: the sequences' `sequence_inputs`, if
    the caller has them.

    The extensions are those a pass's regrowth would screen first (the current prefix is the likeliest beam entry),
    so an extension cache serves them to it."""
    if screen_precision not in SCREEN_PRECISIONS:
        raise ValueError(f"screen_precision={screen_precision!r} must be one of {', '.join(SCREEN_PRECISIONS)}")
    if places < 1:
        raise ValueError(f"places={places} must be >= 1")
    batch, inputs_per_sequence = len(sequences), len(sequences[0]) - 1
    if batch < 2:
        return [0] * batch
    if screen_precision == "bfloat16" and screen_model is None:
        screen_model = bfloat16_twin(target)
    lm, _, device = decoder(target)
    screened = 0 < screen_sites < len(sites) and 0 < shortlist < beam * len(bag)  # as `grow_sequences` decides
    used = range(screen_sites) if screened else range(len(sites))
    candidates = torch.tensor(bag, dtype=torch.long, device=device)
    where = {t: k for k, t in enumerate(bag)}
    ids = torch.tensor(sequences, dtype=torch.long, device=device)
    inputs = sequence_inputs(target, sites, sequences) if inputs is None else inputs  # (B, L - 1, d) per site
    others = [scorer.known(known) for known in others_inputs(inputs)]
    confirmed = [inputs_per_sequence] * batch
    first = [h[:, 0] for h in capture_site_inputs(target, sites, lambda: lm(candidates[:, None]))]

    def rank_ok(i: int, p: int, scores: Tensor) -> bool:
        own = where.get(sequences[i][p])
        return own is not None and int((scores > scores[own]).sum()) < places

    for i in range(batch):  # position 0 as a pass scores it: every site, weighed (no prefix, no prior)
        if not rank_ok(i, 0, scorer.score(first, scorer.deflate(others[i]))):
            confirmed[i] = 0
    run = Prefixes(target, sites, ids[:, :1], screen_model)
    for p in range(1, inputs_per_sequence):
        open_ = [i for i in range(batch) if confirmed[i] == inputs_per_sequence]
        if not open_:
            break
        rows = torch.tensor(open_, dtype=torch.long, device=device).repeat_interleave(len(bag))
        tokens = candidates.repeat(len(open_))
        extended = (run.extend(rows, tokens, used.stop, screen_precision, cache) if screened
                    else run.extend(rows, tokens, cache=cache))
        for j, i in enumerate(open_):
            mine = slice(j * len(bag), (j + 1) * len(bag))
            known = scorer.known([h[i, :p] for h in inputs], others[i])
            hidden, bases = [h[mine] for h in extended], scorer.deflate(known)
            scores = scorer.terms(hidden, bases, used).sum(1) if screened else scorer.score(hidden, bases)
            scores = scores + lm_weight * run.logp[i, candidates].double()
            if not rank_ok(i, p, scores):
                confirmed[i] = p
        run = run.advance(torch.arange(batch, device=device), ids[:, p])
    return confirmed


@_in_fused_attention
@torch.no_grad()
def refine_sequences(target: nn.Module, sites: list[Site], scorer: SpanScorer, bag: list[int],
                     sequences: list[list[int]], lm_weight: float = 0.0, beam: int = 1, screen_sites: int = 0,
                     shortlist: int = 0, screen_precision: str = "float32", cache: ExtensionCache | None = None,
                     screen_model: nn.Module | None = None, resume: bool = False,
                     first_site_shortlist: int = 0, only: list[int] | None = None) -> list[list[int]]:
    """One pass of refinement: every sequence grown again with every other sequence's inputs (all their
    positions, as found so far) known. With the others right, the rows' unknown inputs are this sequence's
    own L - 1, fewer than a site's 2r rows at L <= 2r: the span test becomes a membership test. The B
    sequences regrow together (each against the others' previous inputs), in one search.

    `resume`: each sequence keeps the prefix the screen confirms (`verified_lengths`, top-ranked tokens) and grows
    again from there; a sequence confirmed whole is not grown again. A pass from the start may trade a right prefix
    for a wrong one when some of the others are wrong; a resumed pass spends its extensions after the prefix.
    `first_site_shortlist`: as `grow_sequences` takes it (the confirmation of a resumed pass does not cut by it).
    `only`: the indices of the sequences grown again (default: all); the others are returned as they are, and each
    chosen one grows as it would in a pass of all (a pass regrowing one sequence at a time: `BatchedOptions.
    refine_in_turn`)."""
    if only is not None:
        if resume:
            raise ValueError("only and resume do not combine: a resumed pass chooses its sequences itself")
        if not only or any(not 0 <= i < len(sequences) for i in only) or len(set(only)) != len(only):
            raise ValueError(f"only={only} must name distinct sequences among {len(sequences)}")
    if len(sequences) < 2:
        return [list(s) for s in sequences]
    inputs = sequence_inputs(target, sites, sequences)
    others = others_inputs(inputs)
    chosen = list(range(len(sequences))) if only is None else sorted(only)
    prefixes = None
    if resume:
        confirmed = verified_lengths(target, sites, scorer, bag, sequences, lm_weight, screen_sites, shortlist, beam,
                                     screen_precision=screen_precision, cache=cache, screen_model=screen_model,
                                     inputs=inputs)
        chosen = [i for i, n in enumerate(confirmed) if n < len(sequences[i]) - 1]
        prefixes = [sequences[i][: confirmed[i]] for i in chosen]
        if not chosen:
            return [list(s) for s in sequences]
    grown, _ = grow_sequences(target, sites, scorer, bag, len(chosen), len(sequences[0]), lm_weight, beam=beam,
                              others=[others[i] for i in chosen], screen_sites=screen_sites, shortlist=shortlist,
                              screen_precision=screen_precision, cache=cache, screen_model=screen_model,
                              prefixes=prefixes, first_site_shortlist=first_site_shortlist)
    refined = [list(s) for s in sequences]
    for i, g in zip(chosen, grown):
        refined[i] = g[:-1] + [sequences[i][-1]]  # the last token stays the refit's to choose
    return refined


@_in_fused_attention
@torch.no_grad()
def likeliest_labels(target: nn.Module, sequences: list[list[int]], count: int) -> list[list[int]]:
    """Each sequence's `count` likeliest last tokens under the global model, given all its other tokens."""
    lm, _, device = decoder(target)
    prefixes = torch.tensor([s[:-1] for s in sequences], dtype=torch.long, device=device)
    logp, _ = _step(lm, prefixes)
    return logp.topk(count, dim=-1).indices.tolist()
