"""`transformer3`: the target model of the LTI paper (Wu et al., UAI 2023), from the breaching framework.

Token embedding V x d scaled by sqrt(d), learnable positional embedding, `num_layers`
`nn.TransformerEncoderLayer` (post-LN, ReLU), decoder Linear d -> V whose weight is tied to the
embedding. U(+-0.1) init for the embedding/decoder weight, PyTorch defaults elsewhere. Bidirectional
(no attention mask) by default, yet trained with the next-token loss, as in the paper's code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from datamodules.targets.base import TargetLM


class Transformer3(TargetLM):
    default_excluded = ("token_embedding.weight", "decoder.weight", "decoder.bias")

    def __init__(
        self,
        vocab_size: int = 50257,
        hidden_size: int = 96,
        num_heads: int = 8,
        ffn_size: int = 1536,
        num_layers: int = 3,
        max_positions: int = 16,
        dropout: float = 0.0,
        causal: bool = False,
        init_seed: int | None = 0,
    ) -> None:
        """
        Args:
            vocab_size: Vocabulary size V (GPT-2: 50257).
            hidden_size: Model width d.
            num_heads: Attention heads per layer.
            ffn_size: Feed-forward width.
            num_layers: Number of encoder layers.
            max_positions: Rows of the learnable positional embedding (the paper's code has 1024,
                of which only the first L ever receive gradient; 16 is enough for L = 16).
            dropout: Dropout in every encoder layer and after the positional embedding (paper: 0).
            causal: Apply a causal attention mask (the paper's model is bidirectional).
            init_seed: Seed of the random initialisation, so that server and clients agree on the
                global model; None uses the global RNG.
        """
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} is outside [0, 1)")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_positions = max_positions
        self.causal = causal
        generator_state = None
        if init_seed is not None:
            generator_state = torch.random.get_rng_state()
            torch.manual_seed(init_seed)
        try:
            self.token_embedding = nn.Embedding(vocab_size, hidden_size)
            self.position_embedding = nn.Embedding(max_positions, hidden_size)
            self.embedding_dropout = nn.Dropout(dropout)
            layer = nn.TransformerEncoderLayer(
                hidden_size, num_heads, ffn_size, dropout, activation="relu", batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
            self.decoder = nn.Linear(hidden_size, vocab_size)
            self.decoder.weight = self.token_embedding.weight
            nn.init.uniform_(self.token_embedding.weight, -0.1, 0.1)
        finally:
            if generator_state is not None:
                torch.random.set_rng_state(generator_state)

    @property
    def embedding_matrix(self) -> Tensor:
        return self.token_embedding.weight

    @property
    def head_parameter_names(self) -> set[str]:
        # The decoder weight is the token embedding (tied), so observing it needs the head's gradient.
        return {"token_embedding.weight", "decoder.bias"}

    def body(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        # attention_mask is ignored on purpose: the paper's model has no padding mask.
        length = input_ids.shape[-1]
        self.check_sequence_length(length)
        positions = torch.arange(length, device=input_ids.device)
        hidden = self.token_embedding(input_ids) * math.sqrt(self.hidden_size)
        hidden = self.embedding_dropout(hidden + self.position_embedding(positions))
        mask = None
        if self.causal:
            mask = nn.Transformer.generate_square_subsequent_mask(length, device=input_ids.device)
        # The fused inference kernel has no derivative and mistakes vmapped parameters for
        # constants, so keep the plain (differentiable) path even in eval mode.
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            return self.encoder(hidden, mask=mask, is_causal=self.causal)
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)

    def head(self, hidden: Tensor) -> Tensor:
        return self.decoder(hidden)
