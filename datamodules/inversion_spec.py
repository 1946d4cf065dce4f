"""What the data side tells a learned attack about the problem it inverts."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class InversionSpec:
    """What the data side tells the inverter about the problem."""

    num_features: int  # k hashed features per update
    num_positions: int  # P = sequences per update x sequence length
    vocab_size: int  # V
    embedding: Tensor  # (V, d) the global model's token embedding (known to the server)
    token_counts: Tensor  # (V,) unigram counts of the server's data (auxiliary corpus)
