"""Any Hugging Face causal LM as the global model: built from a config (random init, offline) or
loaded from a local folder / hub name (online users)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lti.targets.base import TargetLM


class HFCausalLM(TargetLM):
    def __init__(
        self,
        pretrained: str | None = None,
        architecture: str = "gpt2",
        config: dict[str, Any] | None = None,
        init_seed: int | None = 0,
        gguf_file: str | None = None,
    ) -> None:
        """
        Args:
            pretrained: Local folder or hub name for `AutoModelForCausalLM.from_pretrained`. None
                builds a randomly initialised model of `architecture` (no download).
            architecture: `model_type` for `AutoConfig.for_model` when `pretrained` is None.
            config: Config overrides, e.g. `{n_layer: 2, n_embd: 96, n_head: 4}` for GPT-2; with
                `pretrained` they are passed to `from_pretrained` (e.g. `{resid_pdrop: 0.1}`).
            init_seed: Seed of the random initialisation (server and clients share the model).
            gguf_file: GGUF file inside `pretrained` (dequantised to fp32 by transformers).
        """
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        overrides = dict(config or {})
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
            kwargs = {"gguf_file": gguf_file} if gguf_file else {}
            self.model = AutoModelForCausalLM.from_pretrained(
                pretrained, attn_implementation="eager", torch_dtype=torch.float32, **overrides, **kwargs
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
