"""Named partial-observation presets (Li et al.) and LoRA target defaults, per architecture.

A preset `layer{i}_{part}` names one part of block i (0-based, the index in the parameter names,
e.g. `encoder.layers.0.` for transformer3's first layer) and resolves to fnmatch patterns on
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
"""

from __future__ import annotations

import re

from torch import nn

#: architecture -> (block prefix with {i}, {part: patterns relative to the block}).
PARTIAL_PRESETS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "transformer3": ("encoder.layers.{i}.", {
        "attn_qkv": ("self_attn.in_proj_weight", "self_attn.in_proj_bias"),
        "attn_out": ("self_attn.out_proj.*",),
        "ffn_in": ("linear1.*",),
        "ffn_out": ("linear2.*",),
        "attn": ("self_attn.*",),
        "ffn": ("linear1.*", "linear2.*"),
        "norms": ("norm1.*", "norm2.*"),
        "all": ("*",),
    }),
    "gpt2": ("model.transformer.h.{i}.", {
        "attn_qkv": ("attn.c_attn.*",),
        "attn_out": ("attn.c_proj.*",),
        "ffn_in": ("mlp.c_fc.*",),
        "ffn_out": ("mlp.c_proj.*",),
        "attn": ("attn.*",),
        "ffn": ("mlp.*",),
        "norms": ("ln_1.*", "ln_2.*"),
        "all": ("*",),
    }),
    "llama": ("model.model.layers.{i}.", {
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
    }),
    "bert": ("model.encoder.layer.{i}.", {
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
    }),
}

#: Why a part is missing for an architecture (fused parameters cannot be sliced by name).
_FUSED = {
    "transformer3": "transformer3 fuses query/key/value in self_attn.in_proj_weight; name selection cannot slice rows, use 'attn_qkv'",
    "gpt2": "GPT-2 fuses query/key/value in attn.c_attn; name selection cannot slice columns, use 'attn_qkv'",
}

#: Default LoRA target modules (module-name suffixes, peft's `target_modules`) per architecture.
#: transformer3's attention is nn.MultiheadAttention: its out_proj is never *called* (the packed
#: functional attention reads its weight), and peft's MultiheadAttention wrapper merges adapters
#: into the base weights in place on every forward, so only the feed-forward Linears are adapted.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "transformer3": ("linear1", "linear2"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "bert": ("query", "key", "value", "dense"),
}

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
    arch = architecture_of(model)
    if arch not in PARTIAL_PRESETS:
        raise ValueError(f"no partial-observation presets for architecture {arch!r}; known: {', '.join(PARTIAL_PRESETS)}")
    prefix, parts = PARTIAL_PRESETS[arch]
    if match is None:
        raise ValueError(f"preset {preset!r} is not of the form layer<i>_<part>; parts for {arch}: {', '.join(parts)}")
    layer, part = int(match.group(1)), match.group(2)
    if part not in parts:
        if part in ("query", "key", "value") and arch in _FUSED:
            raise ValueError(f"preset {preset!r}: {_FUSED[arch]}")
        raise ValueError(f"preset part {part!r} is unknown for {arch}; allowed: {', '.join(parts)}")
    block = prefix.format(i=layer)
    return [block + pattern for pattern in parts[part]]
