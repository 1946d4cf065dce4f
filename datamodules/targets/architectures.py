"""Which layers each target architecture has, by name: one `Architecture` record per architecture.

Everything that selects parts of a target by name reads these records: the partial-observation
presets (Li et al.) and LoRA target defaults here, and the layers exact attacks read
(`exact.layers.find_layers`: embeddings, the first blocks' attention projections, normalisations).

Presets. A preset `layer{i}_{part}` names one part of block i (0-based, the index in the parameter
names, e.g. `encoder.layers.0.` for transformer3's first layer) and resolves to fnmatch patterns on
parameter names, so selection stays by name, never by position:

| part      | transformer3                      | gpt2                | llama                      | bert                          |
|-----------|-----------------------------------|---------------------|----------------------------|-------------------------------|
| query/key/value | fused: use `attn_qkv`       | fused: `attn_qkv`   | `self_attn.{q,k,v}_proj`   | `attention.self.{query,...}`  |
| attn_qkv  | `self_attn.in_proj_*`             | `attn.c_attn`       | q, k and v projections     | query, key and value          |
| attn_out  | `self_attn.out_proj`              | `attn.c_proj`       | `self_attn.o_proj`         | `attention.output.dense`      |
| ffn_in    | `linear1`                         | `mlp.c_fc`          | `mlp.gate_proj`, `up_proj` | `intermediate.dense`          |
| ffn_out   | `linear2`                         | `mlp.c_proj`        | `mlp.down_proj`            | `output.dense`                |
| attn, ffn, norms, all | the whole attention / feed-forward / LayerNorms / block                          |

Fused q/k/v (transformer3's `in_proj_weight`, GPT-2's `c_attn`): query, key and value are row (or
column) slices of one parameter. Name selection observes whole parameters, so `layer{i}_query` is
refused with a one-line error there; `attn_qkv` observes the fused block (a server that only sees
queries would need slicing, which is not supported).

Module paths. `block` is the module name of block i as it ends in any wrapping (`h.{i}`), matched at
a name boundary; `block_prefix` is the full parameter-name prefix in the workbench's own targets
(`model.transformer.h.{i}.` inside `HFCausalLM`), which presets use. Attention, FFN and norm paths are
relative to a block; embedding paths are module-name endings in the whole model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

NormKind = Literal["none", "layernorm", "rmsnorm"]


@dataclass(frozen=True)
class Architecture:
    """What one architecture's layers are called, and the facts about them that name lookups need."""

    name: str  #: `transformer3`, or the Hugging Face `model_type`
    block_prefix: str  #: parameter-name prefix of block i in the workbench target, with `{i}`
    block: str  #: module name (ending) of block i in any wrapping, with `{i}`
    parts: Mapping[str, tuple[str, ...]]  #: preset part -> fnmatch patterns relative to `block_prefix`
    lora_targets: tuple[str, ...]  #: default peft `target_modules` (module-name suffixes)
    #: Attention projections of a block (relative to it): one fused module, or query, key and value.
    qkv: tuple[str, ...]
    qkv_param: str = "weight"  #: the projection weight's attribute (`in_proj_weight` for nn.MultiheadAttention)
    qkv_layout: Literal["in_out", "out_in"] = "out_in"  #: Conv1D stores (in, out); nn.Linear / MHA (out, in)
    #: Why presets cannot select query, key or value alone (a fused projection); None when separate.
    fused_qkv: str | None = None
    embedding: str = ""  #: token embedding module (name ending in the whole model)
    scale_embedding: bool = False  #: the token embedding is multiplied by sqrt(d)
    positions: str | None = None  #: absolute position embedding module; None for rotary models
    token_types: str | None = None  #: token-type embedding (type 0 is added to every token), if any
    embedding_norm: str | None = None  #: normalisation right after the embeddings (BERT)
    #: Dropout on the summed embeddings before the first attention's normalisation (name ending in the
    #: whole model); a train-mode client masks the first-layer inputs with it (`exact.dager.dropout`).
    embedding_dropout: str | None = None
    #: Normalisation inside a block before attention (pre-LN), relative to the block. A block with
    #: `norm_first = False` (transformer3's post-LN default) reads its input un-normalised.
    attention_norm: str | None = None
    norm: NormKind = "none"  #: kind of the normalisation in front of the first attention
    causal: bool | str = True  #: causal attention, or the attribute (HF config / model) that says so
    rope: bool = False  #: rotary positions: first-layer inputs carry no position
    kv_cache: bool = False  #: the Hugging Face key/value cache may be used for prefix searches
    head: str | None = None  #: vocabulary projection module; None: Hugging Face `get_output_embeddings()`
    model_types: tuple[str, ...] = ()  #: the Hugging Face model_types with these layer names (none: not HF)
    #: Hugging Face config values the layer description assumes (attribute -> required value).
    requires: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.block_prefix.endswith(self.block + "."):
            raise ValueError(f"{self.name}: block_prefix {self.block_prefix!r} does not end with block {self.block!r}")
        if len(self.qkv) not in (1, 3) or (len(self.qkv) == 1) != (self.fused_qkv is not None):
            raise ValueError(f"{self.name}: qkv is one fused module (with fused_qkv) or three separate ones")
        if self.fused_qkv is not None and any(p in self.parts for p in ("query", "key", "value")):
            raise ValueError(f"{self.name}: a fused projection has no separate query/key/value parts")

    @property
    def fused(self) -> bool:
        return len(self.qkv) == 1

    def block_name(self, i: int) -> str:
        return self.block.format(i=i)

    def patterns(self, layer: int, part: str) -> list[str]:
        """fnmatch patterns of `part` of block `layer` on the workbench target's parameter names."""
        prefix = self.block_prefix.format(i=layer)
        return [prefix + pattern for pattern in self.parts[part]]


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture(
            name="transformer3",
            block_prefix="encoder.layers.{i}.",
            block="encoder.layers.{i}",
            parts={
                "attn_qkv": ("self_attn.in_proj_weight", "self_attn.in_proj_bias"),
                "attn_out": ("self_attn.out_proj.*",),
                "ffn_in": ("linear1.*",),
                "ffn_out": ("linear2.*",),
                "attn": ("self_attn.*",),
                "ffn": ("linear1.*", "linear2.*"),
                "norms": ("norm1.*", "norm2.*"),
                "all": ("*",),
            },
            # transformer3's attention is nn.MultiheadAttention: its out_proj is never *called* (the
            # packed functional attention reads its weight), and peft's MultiheadAttention wrapper merges
            # adapters into the base weights in place on every forward, so only the feed-forward Linears
            # are adapted.
            lora_targets=("linear1", "linear2"),
            qkv=("self_attn",),
            qkv_param="in_proj_weight",
            qkv_layout="out_in",
            fused_qkv="transformer3 fuses query/key/value in self_attn.in_proj_weight; name selection cannot slice rows, use 'attn_qkv'",
            embedding="token_embedding",
            scale_embedding=True,
            positions="position_embedding",
            embedding_dropout="embedding_dropout",
            attention_norm="norm1",
            norm="layernorm",
            causal="causal",
            head="decoder",
        ),
        Architecture(
            name="gpt2",
            block_prefix="model.transformer.h.{i}.",
            block="h.{i}",
            parts={
                "attn_qkv": ("attn.c_attn.*",),
                "attn_out": ("attn.c_proj.*",),
                "ffn_in": ("mlp.c_fc.*",),
                "ffn_out": ("mlp.c_proj.*",),
                "attn": ("attn.*",),
                "ffn": ("mlp.*",),
                "norms": ("ln_1.*", "ln_2.*"),
                "all": ("*",),
            },
            lora_targets=("c_attn", "c_proj", "c_fc"),
            qkv=("attn.c_attn",),
            qkv_layout="in_out",
            fused_qkv="GPT-2 fuses query/key/value in attn.c_attn; name selection cannot slice columns, use 'attn_qkv'",
            embedding="wte",
            positions="wpe",
            embedding_dropout="drop",
            attention_norm="ln_1",
            norm="layernorm",
            causal=True,
            kv_cache=True,
            model_types=("gpt2",),
        ),
        Architecture(
            name="llama",
            block_prefix="model.model.layers.{i}.",
            block="layers.{i}",
            parts={
                "query": ("self_attn.q_proj.*",),
                "key": ("self_attn.k_proj.*",),
                "value": ("self_attn.v_proj.*",),
                "attn_qkv": ("self_attn.q_proj.*", "self_attn.k_proj.*", "self_attn.v_proj.*"),
                "attn_out": ("self_attn.o_proj.*",),
                "ffn_in": ("mlp.gate_proj.*", "mlp.up_proj.*"),
                "ffn_out": ("mlp.down_proj.*",),
                "attn": ("self_attn.*",),
                "ffn": ("mlp.*",),
                "norms": ("input_layernorm.*", "post_attention_layernorm.*"),
                "all": ("*",),
            },
            lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            embedding="embed_tokens",
            attention_norm="input_layernorm",
            norm="rmsnorm",
            causal=True,
            rope=True,
            kv_cache=True,
            model_types=("llama", "mistral", "qwen2"),
        ),
        Architecture(
            name="bert",
            block_prefix="model.encoder.layer.{i}.",
            block="encoder.layer.{i}",
            parts={
                "query": ("attention.self.query.*",),
                "key": ("attention.self.key.*",),
                "value": ("attention.self.value.*",),
                "attn_qkv": ("attention.self.query.*", "attention.self.key.*", "attention.self.value.*"),
                "attn_out": ("attention.output.dense.*",),
                "ffn_in": ("intermediate.dense.*",),
                "ffn_out": ("output.dense.*",),
                "attn": ("attention.*",),
                "ffn": ("intermediate.*", "output.dense.*"),
                "norms": ("attention.output.LayerNorm.*", "output.LayerNorm.*"),
                "all": ("*",),
            },
            lora_targets=("query", "key", "value", "dense"),
            qkv=("attention.self.query", "attention.self.key", "attention.self.value"),
            embedding="embeddings.word_embeddings",
            positions="embeddings.position_embeddings",
            token_types="embeddings.token_type_embeddings",
            embedding_norm="embeddings.LayerNorm",
            norm="layernorm",
            causal="is_decoder",
            # The full re-computation is exact and simple for an encoder; the cache path is not used.
            kv_cache=False,
            model_types=("bert",),
            requires={"position_embedding_type": "absolute"},
        ),
    )
}

#: Hugging Face model_type -> the record of its layer names.
BY_MODEL_TYPE: dict[str, Architecture] = {kind: arch for arch in ARCHITECTURES.values() for kind in arch.model_types}

#: architecture -> (block prefix with {i}, {part: patterns relative to the block}).
PARTIAL_PRESETS: dict[str, tuple[str, Mapping[str, tuple[str, ...]]]] = {
    name: (arch.block_prefix, arch.parts) for name, arch in ARCHITECTURES.items()
}

#: Default LoRA target modules (module-name suffixes, peft's `target_modules`) per architecture.
LORA_TARGETS: dict[str, tuple[str, ...]] = {name: arch.lora_targets for name, arch in ARCHITECTURES.items()}

_PRESET = re.compile(r"^layer(\d+)_([a-z_]+)$")


def architecture_of(model: nn.Module) -> str:
    """`transformer3`, or the Hugging Face `model_type` of the wrapped model (gpt2, llama, bert ...)."""
    from datamodules.targets.transformer3 import Transformer3

    if isinstance(model, Transformer3):
        return "transformer3"
    config = getattr(getattr(model, "model", None), "config", None)
    kind = getattr(config, "model_type", None)
    if kind is None:
        raise ValueError(f"cannot tell the architecture of {type(model).__name__}; presets know {', '.join(PARTIAL_PRESETS)}")
    return str(kind)


def preset_patterns(model: nn.Module, preset: str) -> list[str]:
    """Preset name (`layer0_ffn_in`) -> fnmatch patterns on `model`'s parameter names."""
    match = _PRESET.match(preset)
    name = architecture_of(model)
    if name not in ARCHITECTURES:
        raise ValueError(f"no partial-observation presets for architecture {name!r}; known: {', '.join(PARTIAL_PRESETS)}")
    arch = ARCHITECTURES[name]
    if match is None:
        raise ValueError(f"preset {preset!r} is not of the form layer<i>_<part>; parts for {name}: {', '.join(arch.parts)}")
    layer, part = int(match.group(1)), match.group(2)
    if part not in arch.parts:
        if part in ("query", "key", "value") and arch.fused_qkv is not None:
            raise ValueError(f"preset {preset!r}: {arch.fused_qkv}")
        raise ValueError(f"preset part {part!r} is unknown for {name}; allowed: {', '.join(arch.parts)}")
    return arch.patterns(layer, part)
