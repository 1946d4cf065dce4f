"""Find the layers DAGER reads, by module name and type -- never by parameter position.

DAGER needs, for a target model:

* the first and second attention layers' query projections (their weight gradients span the layer
  inputs), as `ProjectionRef`s: the module, the full parameter name (as in `named_parameters()`, so it
  indexes the per-parameter update dict), the weight layout and which rows/columns are the query block;
* how the first attention layer's input is computed from a token and its position
  (`FirstLayerInput`: embedding, optional position table, scale, offset and normalisation), so that
  all V candidate tokens can be tested without running the model;
* the module whose *input* is the second attention layer's input (hooked to read it);
* whether attention is causal and whether positions are rotary (RoPE: first-layer inputs carry no
  position);
* optionally the final normalisation that feeds the vocabulary projection, whose gradient gives the
  last token of every sequence in next-token training (it is only ever a label, never an input).

Supported: `datamodules.targets.Transformer3`, and Hugging Face GPT-2, BERT and Llama-family models (bare, or
wrapped in any module, e.g. `datamodules.targets.HFCausalLM`). Each architecture's module names (embeddings,
attention projections, normalisations) come from its record in `datamodules.targets.architectures`; this
module holds the generic lookup. Plain PyTorch; no Lightning.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from datamodules.federated.protocols.base import model_mode
from datamodules.targets.architectures import (
    ARCHITECTURES,
    BY_MODEL_TYPE,
    Architecture,
    NormKind,
)


@dataclass(frozen=True)
class GradientBlock:
    """One block of a weight whose gradient spans the layer's inputs (e.g. the query rows of a fused QKV)."""

    param_name: str  #: full name in `named_parameters()`: the key into the update dict
    layout: Literal["in_out", "out_in"]  #: Conv1D stores (in, out); nn.Linear / MHA store (out, in)
    start: int  #: first output feature of the block
    stop: int  #: one past its last output feature

    def input_space(self, weight_grad: Tensor) -> Tensor:
        """The block as (d_in, width): its columns lie in the span of the layer inputs."""
        if self.layout == "in_out":
            return weight_grad[:, self.start : self.stop]
        return weight_grad[self.start : self.stop, :].transpose(0, 1)


def lora_a_name(param_name: str, adapter: str = "default") -> str | None:
    """The peft lora_A weight beside a wrapped layer's base weight (`x.base_layer.weight` -> `x.lora_A.default.weight`)."""
    suffix = ".base_layer.weight"
    return param_name[: -len(suffix)] + f".lora_A.{adapter}.weight" if param_name.endswith(suffix) else None


@dataclass(frozen=True)
class ProjectionRef:
    """The attention projections of one layer whose weight gradients span that layer's inputs.

    `query` is the paper's choice (DAGER reads the query gradient). `blocks` adds the key and value
    blocks: in a causal model the first position's query always attends only to itself, so its
    query gradient vanishes and only the key/value gradients contain the first token.
    """

    module_name: str  #: the attention (or query projection) module
    query: GradientBlock
    key_value: tuple[GradientBlock, ...] = ()

    @property
    def param_name(self) -> str:
        return self.query.param_name

    def blocks(self, which: str = "qkv") -> tuple[GradientBlock, ...]:
        if which not in ("q", "qkv"):
            raise ValueError(f"gradient blocks {which!r} not allowed; use 'q' or 'qkv'")
        return (self.query,) if which == "q" else (self.query, *self.key_value)

    def sources(self, observed: Collection[str], which: str = "qkv") -> list[tuple[GradientBlock | None, str]] | None:
        """The observed parameters the span is read from, as (block, name) with block None for a LoRA
        adapter's lora_A, or None if `observed` cannot give the span.

        A LoRA client sends adapter updates only: for a projection W + B A, dL/dA = B^T dL/dW (up to
        the LoRA scale) has its rows in the span of the layer inputs too, so lora_A's gradient stands
        in for the weight's (DAGER's LoRA setting; it spans all the inputs only when the rank r is at
        least the number of tokens). A fused projection's blocks share one adapter, used once. LoRA often
        adapts only some projections (q and v, as FlowerTune does): then the key or value block without an
        adapter is left out, and the span is read from the adapters there are (the query's and at least one
        of key and value are required).
        """
        parts, adapters, missing = [], set(), []
        for block in self.blocks(which):
            if block.param_name in observed:
                parts.append((block, block.param_name))
                continue
            adapter = lora_a_name(block.param_name)
            if adapter is None or adapter not in observed:
                missing.append(block)
                continue
            if adapter not in adapters:
                adapters.add(adapter)
                parts.append((None, adapter))
        # The query adapter alone is not enough for "qkv": causal models' first token is only in key/value.
        if missing and (not adapters or self.query in missing or all(b in missing for b in self.key_value)):
            return None
        return parts

    def input_space(self, update: Mapping[str, Tensor], which: str = "qkv") -> Tensor | None:
        """(d_in, total width) from the update dict, or None if a needed parameter is not observed (`sources`)."""
        sources = self.sources(update.keys(), which)
        if sources is None:
            return None
        # lora_A is (r, d_in): its rows are the input-space vectors.
        return torch.cat([update[name].transpose(0, 1) if block is None else block.input_space(update[name])
                          for block, name in sources], dim=1)

    def names(self, which: str = "qkv") -> list[str]:
        return sorted({b.param_name for b in self.blocks(which)})


@dataclass
class FirstLayerInput:
    """first-layer input(token t, position p) = norm(scale * E[t] + P[p] + offset)."""

    embedding: Tensor  #: (V, d) token embedding
    scale: float = 1.0
    positions: Tensor | None = None  #: (P, d) absolute position embedding; None for RoPE models
    offset: Tensor | None = None  #: (d,) constant added to every token (BERT: token type 0)
    norm: NormKind = "none"
    norm_weight: Tensor | None = None
    norm_bias: Tensor | None = None
    eps: float = 0.0

    @property
    def vocab_size(self) -> int:
        return int(self.embedding.shape[0])

    @property
    def dim(self) -> int:
        return int(self.embedding.shape[1])

    @property
    def num_positions(self) -> int | None:
        return None if self.positions is None else int(self.positions.shape[0])

    def pre_norm(self, token_ids: Tensor, position: int | None, dtype: torch.dtype = torch.float64) -> Tensor:
        x = self.scale * self.embedding[token_ids].to(dtype)
        return x + self.constant(position, dtype)

    def constant(self, position: int | None, dtype: torch.dtype = torch.float64) -> Tensor:
        """The token-independent part P[p] + offset, shape (d,)."""
        c = torch.zeros(self.dim, dtype=dtype, device=self.embedding.device)
        if self.positions is not None and position is not None:
            c = c + self.positions[position].to(dtype)
        if self.offset is not None:
            c = c + self.offset.to(dtype)
        return c

    def __call__(self, token_ids: Tensor, position: int | None, dtype: torch.dtype = torch.float64) -> Tensor:
        """Reference: the explicit first-layer inputs (n, d) of tokens `token_ids` at `position`."""
        return self.normalise(self.pre_norm(token_ids, position, dtype))

    def normalise(self, x: Tensor) -> Tensor:
        """The first layer's normalisation, with its gain and bias, of pre-norm vectors x (..., d)."""
        if self.norm == "layernorm":
            x = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + self.eps)
        elif self.norm == "rmsnorm":
            x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm_weight is not None:
            x = x * self.norm_weight.to(x)
        if self.norm_bias is not None:
            x = x + self.norm_bias.to(x)
        return x


@dataclass
class FinalNorm:
    """The normalisation whose output feeds the vocabulary projection `head_weight` (V, d)."""

    module: nn.Module
    weight_name: str | None
    bias_name: str | None
    kind: NormKind
    eps: float
    head_weight: Tensor

    def normalise(self, hidden: Tensor) -> Tensor:
        """x-hat: the normalised input before the elementwise affine (float64)."""
        x = hidden.double()
        if self.kind == "layernorm":
            return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + self.eps)
        if self.kind == "rmsnorm":
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x


@dataclass
class DagerLayers:
    architecture: str
    first: ProjectionRef
    second: ProjectionRef
    #: The module whose first positional input is the second attention layer's input.
    second_input_module: nn.Module
    inputs: FirstLayerInput
    causal: bool
    rope: bool
    final_norm: FinalNorm | None
    #: The Hugging Face base model if the target is one (enables the key/value-cache prefix search).
    hf_base_model: nn.Module | None = None
    #: Token-type / position details a probe needs (BERT: token_type_ids of zeros are the default).
    hidden_size: int = 0
    #: Rate of the dropout on the summed embeddings before the first attention (0: none, or unknown).
    embedding_dropout: float = 0.0
    #: Attention heads of the first layer (None when the attention module does not say).
    first_heads: int | None = None

    def observed_names(self, which: str = "qkv") -> list[str]:
        """Parameter names DAGER reads from the update dict (the final norm's are optional)."""
        names = self.first.names(which) + self.second.names(which)
        if self.final_norm is not None:
            names += [n for n in (self.final_norm.weight_name, self.final_norm.bias_name) if n]
        return names


# ----------------------------------------------------------------------------------------------------------
# Lookup helpers


def _module_regex(pattern: str) -> re.Pattern:
    return re.compile(r"(^|\.)" + pattern + r"$")


def _find_module(model: nn.Module, pattern: str, kind: type | tuple[type, ...] | None = None) -> tuple[str, nn.Module]:
    """The unique module whose full name matches the regex `pattern` (anchored at a name boundary)."""
    regex = _module_regex(pattern)
    hits = [(name, mod) for name, mod in model.named_modules() if regex.search(name)]
    if kind is not None:
        hits = [(n, m) for n, m in hits if isinstance(_unwrapped(m), kind)]
    if len(hits) != 1:
        found = ", ".join(n for n, _ in hits[:4]) or "none"
        raise ValueError(f"expected exactly one module named like {pattern!r}, found {len(hits)} ({found})")
    return hits[0]


def _maybe_module(model: nn.Module, pattern: str, kind=None) -> tuple[str, nn.Module] | None:
    try:
        return _find_module(model, pattern, kind)
    except ValueError:
        return None


def _param_name(model: nn.Module, module_name: str, attr: str) -> str:
    name = f"{module_name}.{attr}" if module_name else attr
    params = dict(model.named_parameters())
    if name not in params and f"{module_name}.base_layer.{attr}" in params:
        name = f"{module_name}.base_layer.{attr}"  # a peft (LoRA) wrapper around the layer
    if name not in params:
        raise ValueError(f"parameter {name!r} not found in the target model")
    return name


def _unwrapped(module: nn.Module) -> nn.Module:
    """The layer inside a peft (LoRA) wrapper, or the module itself."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) else module


def _fused(model: nn.Module, module_name: str, attr: str, layout, d: int) -> ProjectionRef:
    """Fused QKV weight: query, key and value blocks of width d along the output dimension."""
    name = _param_name(model, module_name, attr)
    q, k, v = (GradientBlock(name, layout, i * d, (i + 1) * d) for i in range(3))
    return ProjectionRef(module_name, q, (k, v))


def _separate(model: nn.Module, module_names: tuple[str, ...]) -> ProjectionRef:
    """Separate nn.Linear query, key and value projections, by full module name."""
    modules = dict(model.named_modules())
    blocks = []
    for module_name in module_names:
        linear = _unwrapped(modules[module_name]) if module_name in modules else None
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"expected an nn.Linear named {module_name!r}")
        blocks.append(GradientBlock(_param_name(model, module_name, "weight"), "out_in", 0, linear.out_features))
    return ProjectionRef(module_names[0], blocks[0], tuple(blocks[1:]))


def _hf_model(target: nn.Module) -> nn.Module | None:
    """The Hugging Face PreTrainedModel inside `target` (or `target` itself), if any."""
    for _, mod in target.named_modules():
        if hasattr(mod, "config") and hasattr(mod, "base_model") and hasattr(mod.config, "model_type"):
            return mod
    return None


def _norm_kind(module: nn.Module) -> NormKind | None:
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    name = type(module).__name__.lower()
    if "rmsnorm" in name:
        return "rmsnorm"
    if "layernorm" in name:
        return "layernorm"
    return None


def detect_final_norm(target: nn.Module, head: nn.Module | None) -> FinalNorm | None:
    """The normalisation whose output is the vocabulary projection's input, found by running the model.

    Module names differ (GPT-2 `ln_f`, Llama `norm`, a wrapped BERT's last `output.LayerNorm` or a bare
    BERT's `cls.predictions.transform.LayerNorm`), so the one that actually feeds `head` in a forward
    pass of two tokens is taken.
    """
    if head is None or getattr(head, "weight", None) is None:
        return None
    norms = [(n, m, k) for n, m in target.named_modules() if (k := _norm_kind(m)) is not None]
    outputs: dict[str, Tensor] = {}
    box: list[Tensor] = []
    handles = [m.register_forward_hook(lambda mod, a, out, n=n: outputs.__setitem__(n, out)) for n, m, _ in norms]
    handles.append(head.register_forward_pre_hook(lambda mod, a: box.append(a[0])))
    vocab = int(head.weight.shape[0])
    ids = torch.tensor([[1 % vocab, 7 % vocab]], device=head.weight.device)
    try:
        with torch.no_grad(), model_mode(target, "eval"):
            target(ids) if hasattr(target, "body") else target(input_ids=ids)
    except Exception:  # noqa: BLE001 - detection is best effort; DAGER then skips last-token recovery
        return None
    finally:
        for h in handles:
            h.remove()
    if not box:
        return None
    fed = box[0]
    params = dict(target.named_parameters())
    for name, module, kind in reversed(norms):
        out = outputs.get(name)
        if isinstance(out, Tensor) and out.shape == fed.shape and torch.equal(out, fed):
            weight = f"{name}.weight" if f"{name}.weight" in params else None
            bias = f"{name}.bias" if f"{name}.bias" in params else None
            eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None) or 1e-6
            return FinalNorm(module, weight, bias, kind, float(eps), head.weight)
    return None


def _with_width(layers: DagerLayers) -> DagerLayers:
    d = layers.inputs.dim
    layers.hidden_size = d
    return layers


# ----------------------------------------------------------------------------------------------------------
# Architectures: the module names come from `datamodules.targets.architectures`; this reads them


def _path(*names: str) -> str:
    """Regex for the module named by the dotted `names` (matched at a name boundary by `_find_module`)."""
    return re.escape(".".join(names))


def _attention(target: nn.Module, arch: Architecture, i: int) -> tuple[ProjectionRef, nn.Module]:
    """Block i's attention projections and the module whose input is the block's attention input."""
    first = arch.qkv[0]
    if arch.fused:
        name, module = _find_module(target, _path(arch.block_name(i), first))
        weight = getattr(_unwrapped(module), arch.qkv_param, None)
        if weight is None:
            raise ValueError(f"{arch.name} attention without a fused {arch.qkv_param} is not supported")
        d = int(weight.shape[0 if arch.qkv_layout == "out_in" else 1]) // 3
        return _fused(target, name, arch.qkv_param, arch.qkv_layout, d), module
    name, module = _find_module(target, _path(arch.block_name(i), first), nn.Linear)
    block = name[: len(name) - len(first)]  # the block's full name and a dot
    return _separate(target, tuple(block + projection for projection in arch.qkv)), module


def _first_layer_input(target: nn.Module, arch: Architecture) -> FirstLayerInput:
    _, emb = _find_module(target, _path(arch.embedding), nn.Embedding)
    positions = _find_module(target, _path(arch.positions), nn.Embedding)[1].weight if arch.positions else None
    types = _maybe_module(target, _path(arch.token_types), nn.Embedding) if arch.token_types else None
    norm = None
    if arch.embedding_norm:
        norm = _find_module(target, _path(arch.embedding_norm))[1]
    elif arch.attention_norm:
        _, block0 = _find_module(target, _path(arch.block_name(0)))
        if getattr(block0, "norm_first", True):  # a post-LN block's attention reads x itself
            norm = _find_module(target, _path(arch.block_name(0), arch.attention_norm))[1]
    return FirstLayerInput(
        embedding=emb.weight,
        scale=math.sqrt(emb.weight.shape[1]) if arch.scale_embedding else 1.0,
        positions=positions,
        offset=None if types is None else types[1].weight[0],
        norm=arch.norm if norm is not None else "none",
        norm_weight=None if norm is None else norm.weight,
        norm_bias=None if norm is None else getattr(norm, "bias", None),
        eps=0.0 if norm is None else float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))),
    )


def _layers(target: nn.Module, arch: Architecture, hf: nn.Module | None) -> DagerLayers:
    """Everything DAGER reads in `target`, located by the module names of its architecture record."""
    config = None if hf is None else hf.config
    for key, value in arch.requires.items():
        if getattr(config, key, value) != value:
            raise ValueError(f"DAGER supports {arch.name} with {key}={value!r} only")
    if not any(_module_regex(_path(arch.block_name(1))).search(name) for name, _ in target.named_modules()):
        raise ValueError("DAGER needs at least two attention layers")
    first, _ = _attention(target, arch, 0)
    second, second_input = _attention(target, arch, 1)
    dropout = _maybe_module(target, _path(arch.embedding_dropout), nn.Dropout) if arch.embedding_dropout else None
    _, block0 = _find_module(target, _path(arch.block_name(0)))
    heads = next((int(getattr(m, a)) for m in block0.modules() for a in ("num_heads", "num_attention_heads")
                  if isinstance(getattr(m, a, None), int)), None)
    causal = arch.causal
    if isinstance(causal, str):
        causal = bool(getattr(target if config is None else config, causal, False))
    head = _find_module(target, _path(arch.head))[1] if arch.head else hf.get_output_embeddings()
    return DagerLayers(
        architecture=arch.name,
        first=first,
        second=second,
        second_input_module=second_input,
        inputs=_first_layer_input(target, arch),
        causal=causal,
        rope=arch.rope,
        final_norm=detect_final_norm(target, head),
        hf_base_model=hf.base_model if arch.kv_cache and hf is not None else None,
        embedding_dropout=float(dropout[1].p) if dropout is not None else 0.0,
        first_heads=heads,
    )


def find_layers(target: nn.Module) -> DagerLayers:
    """Locate everything DAGER needs in `target`; raises ValueError for unsupported architectures."""
    from datamodules.targets.transformer3 import Transformer3

    if isinstance(target, Transformer3):
        return _with_width(_layers(target, ARCHITECTURES["transformer3"], None))
    hf = _hf_model(target)
    if hf is None:
        raise ValueError(
            f"DAGER does not know the architecture of {type(target).__name__}; supported: transformer3 and "
            f"Hugging Face {', '.join(sorted(BY_MODEL_TYPE))}"
        )
    model_type = hf.config.model_type
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(f"DAGER does not support Hugging Face model_type {model_type!r}; supported: {', '.join(sorted(BY_MODEL_TYPE))}")
    return _with_width(_layers(target, BY_MODEL_TYPE[model_type], hf))


# ----------------------------------------------------------------------------------------------------------
# Reading layer inputs from the running model (used by the second-layer check and by tests)


class _Stop(Exception):
    """Raised by a hook once the wanted activation is captured: the rest of the model never runs."""


def capture_input(module: nn.Module, run) -> Tensor:
    """Run `run()` and return the first positional input of `module`, stopping the forward there."""
    box: list[Tensor] = []

    def hook(mod, args, kwargs):
        x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, Tensor))
        box.append(x)
        raise _Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run()
    except _Stop:
        pass
    finally:
        handle.remove()
    if not box:
        raise RuntimeError(f"module {type(module).__name__} was not called by the forward pass")
    return box[0]


def find_module_by_name(model: nn.Module, name: str) -> nn.Module:
    return dict(model.named_modules())[name]
