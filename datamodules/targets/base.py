"""The interface every text target model implements.

A client update is the gradient of the next-token loss. To compute per-sequence gradients fast, the
model is split into a *body* (tokens -> final hidden states, where almost all observed parameters
live) and a *head* (the big vocabulary projection). The head runs batched, once; only the body is
differentiated per sequence (see `datamodules.federated.engines.next_token`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor, nn


class TargetLM(nn.Module, ABC):
    """A language model whose updates the server observes.

    Subclasses must expose `vocab_size`, `max_positions`, `hidden_size` and implement `body` and
    `head`. `forward(input_ids)` returns logits (B, L, V).
    """

    vocab_size: int
    max_positions: int
    hidden_size: int
    #: Parameter-name patterns (fnmatch) the paper's server observes by default.
    default_observed: tuple[str, ...] = ("*",)
    #: Parameter-name patterns that are never observed by default (embedding / tied decoder).
    default_excluded: tuple[str, ...] = ()

    @abstractmethod
    def body(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Token ids (B, L) -> final hidden states (B, L, d), before the vocabulary projection."""

    @abstractmethod
    def head(self, hidden: Tensor) -> Tensor:
        """Final hidden states (..., d) -> logits (..., V)."""

    @property
    @abstractmethod
    def embedding_matrix(self) -> Tensor:
        """The input token embedding matrix (V, d), known to the server."""

    @property
    def head_parameter_names(self) -> set[str]:
        """Names (as in `named_parameters()`) of the parameters used only by `head`."""
        return set()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.head(self.body(input_ids, attention_mask))

    def check_sequence_length(self, length: int) -> None:
        if length > self.max_positions:
            raise ValueError(
                f"sequence length {length} exceeds the target model's {self.max_positions} positions; "
                f"use seq_len <= {self.max_positions} or a model with more positions"
            )


def next_token_loss(logits: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Per-sequence mean next-token cross-entropy, shape (B,).

    Position t predicts token t+1; padded targets (attention_mask == 0) are ignored. `logits` may
    cover all L positions or only the first L-1 (the ones that predict something), which saves the
    head's work on the last position. One loss per sequence lets callers get per-sequence gradients
    from a single batched backward.
    """
    targets = input_ids[:, 1:]
    if logits.shape[1] == input_ids.shape[1]:
        logits = logits[:, :-1]
    # Half-precision logits are promoted for a stable softmax; float64 (reference tests) stays float64.
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    flat = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view(targets.shape)
    if attention_mask is None:
        return flat.mean(dim=1)
    weight = attention_mask[:, 1:].to(flat.dtype)
    return (flat * weight).sum(dim=1) / weight.sum(dim=1).clamp_min(1.0)
