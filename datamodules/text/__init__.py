"""Text corpora, tokenisation, packing into fixed-length samples, and marginal pseudo-data (no Lightning)."""

from datamodules.text.corpora import CORPORA, EmbeddedCorpus, HubCorpus, LocalCorpus, TextCorpus
from datamodules.text.packing import pack_blocks, pack_lines, tokenize_splits
from datamodules.text.pseudo import MarginalSampler, token_counts
from datamodules.text.tokenizer import EMBEDDED_GPT2, load_tokenizer

__all__ = [
    "CORPORA", "TextCorpus", "EmbeddedCorpus", "HubCorpus", "LocalCorpus",
    "pack_blocks", "pack_lines", "tokenize_splits", "MarginalSampler", "token_counts",
    "EMBEDDED_GPT2", "load_tokenizer",
]
