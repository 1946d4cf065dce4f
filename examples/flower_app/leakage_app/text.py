"""The text both sides use in this example: the workbench's embedded corpus cut into blocks of the threat model's
length. Clients hold evaluation blocks (their private text), the server auxiliary ones (its own text, for the
batched attack's whitening). In your app, clients read their own data and the server its own."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from datamodules.text import EmbeddedCorpus, load_tokenizer
from datamodules.text.packing import pack_blocks, tokenize_splits
from datamodules.threat_model import ThreatModel

THREAT_MODEL = Path(__file__).resolve().parents[1] / "threat_model.yaml"


@cache
def threat_model() -> ThreatModel:
    return ThreatModel.from_config(THREAT_MODEL)


@cache
def blocks(split: str) -> torch.Tensor:
    """(N, L) token ids of the corpus split ("auxiliary" or "evaluation")."""
    threat = threat_model()
    tokenized = tokenize_splits(EmbeddedCorpus().load(), load_tokenizer(threat.tokenizer_name))
    return pack_blocks(tokenized[split], threat.seq_len)


def client_batch(partition: int, partitions: int, server_round: int, batch_size: int) -> torch.Tensor:
    """(B, L): the blocks client `partition` trains on in a round (its own share, a fresh draw each round)."""
    own = blocks("evaluation")[partition::partitions]
    generator = torch.Generator().manual_seed(1_000 * server_round + partition)
    return own[torch.randperm(own.shape[0], generator=generator)[:batch_size]]
