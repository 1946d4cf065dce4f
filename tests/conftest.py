"""Shared fixtures: tiny models and corpora so every test runs in seconds on a CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]

AUX_LINES = [
    f"Sentence number {i} talks about federated learning, privacy and the server that reads gradients."
    for i in range(40)
] + ["The quick brown fox jumps over the lazy dog and runs far away from here."]
EVAL_LINES = [f"Held out line {i} is about clients that send updates to a curious server every round." for i in range(12)]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Hash buckets, tokenizer files and corpora go to a per-session cache, not the user's."""
    os.environ["LTI_CACHE_DIR"] = str(tmp_path_factory.mktemp("lti-cache"))


@pytest.fixture
def tiny_transformer3():
    from datamodules.targets import Transformer3

    return Transformer3(vocab_size=300, hidden_size=16, num_heads=2, ffn_size=32, num_layers=2, max_positions=8)


@pytest.fixture
def tiny_gpt2():
    from datamodules.targets import HFCausalLM

    return HFCausalLM(architecture="gpt2", config=dict(
        n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ))


@pytest.fixture(scope="session")
def corpus_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("corpus")
    aux, ev = folder / "aux.txt", folder / "eval.txt"
    aux.write_text("\n".join(AUX_LINES) + "\n")
    ev.write_text("\n".join(EVAL_LINES) + "\n")
    return {"auxiliary": aux, "evaluation": ev}


def tiny_config(tmp_path: Path, corpus_files: dict[str, Path], **overrides) -> Path:
    """Write a tiny, fast `lti` config (GPT-2 vocabulary, 1-layer transformer3, local corpus)."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 4, "logger": False, "accelerator": "cpu", "devices": 1, "enable_progress_bar": False,
            "default_root_dir": str(tmp_path / "run"), "val_check_interval": 4, "num_sanity_val_steps": 0,
            "enable_model_summary": False,
        },
        "model": {"inverter": {"class_path": "lti.inverters.EmbeddingInverter", "init_args": {"hidden": 32}}},
        "data": {
            "target": {"class_path": "datamodules.targets.Transformer3", "init_args": {
                "hidden_size": 16, "num_heads": 2, "ffn_size": 32, "num_layers": 1, "max_positions": 8}},
            "corpus": {"class_path": "datamodules.text.LocalCorpus", "init_args": {
                "auxiliary_files": [str(corpus_files["auxiliary"])], "evaluation_files": [str(corpus_files["evaluation"])]}},
            "seq_len": 8, "batch_size": 4, "eval_samples": 8,
        },
        "checkpoint": {"dirpath": str(tmp_path / "ckpt")},
        "results": {"print_table": False},
    }
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def make_config(tmp_path, corpus_files):
    return lambda **overrides: tiny_config(tmp_path, corpus_files, **overrides)


@pytest.fixture
def grid_file(make_config, tmp_path):
    """A tiny attack x defense x protocol grid (LTI and DAGER under two defenses) for the matrix tests."""
    base = make_config(**{"trainer.max_steps": 2, "trainer.limit_val_batches": 0, "data.eval_samples": 4,
                          # DAGER needs two attention layers; 8 tokens per update stay below d = 16.
                          "data.target.init_args.num_layers": 2})
    grid = {
        "out_dir": str(tmp_path / "matrix"),
        "base": [str(base)],
        "overrides": {"trainer.max_steps": 2},
        "protocols": {"fedsgd": None},
        "defenses": {
            "none": str(REPO / "configs/defenses/none.yaml"),
            "gauss": {"configs": [str(REPO / "configs/defenses/gaussian.yaml")], "noise": 0.01},
        },
        "attacks": {
            "lti": None,
            "dager": {"kind": "exact", "configs": [str(REPO / "configs/exact/dager.yaml")], "metrics_prefix": "test/dager",
                      "extra_metrics": ["exact_fraction"], "not_applicable": {"gauss": "noise breaks exactness"}},
        },
        "wandb": {"mode": "offline"},
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def observe_text(client, target, names, input_ids, attention_mask=None, *, defense=None, generator=None, trainable=None):
    """A protocol's defended (U, D) updates of text clients: `client.observe` with its observation context."""
    from datamodules.federated import NextTokenLoss, NoDefense, Observation

    batch = {"input_ids": input_ids} if attention_mask is None else {"input_ids": input_ids, "attention_mask": attention_mask}
    return client.observe(batch, Observation(target, names, NextTokenLoss(), defense or NoDefense(), generator, trainable=trainable))


def observe_images(client, target, names, inputs, labels, *, defense=None, generator=None, trainable=None):
    """A protocol's defended (U, D) updates of image/table clients."""
    from datamodules.federated import ClassificationLoss, NoDefense, Observation

    observation = Observation(target, names, ClassificationLoss(), defense or NoDefense(), generator, trainable=trainable)
    return client.observe({"inputs": inputs, "labels": labels}, observation)


def per_example_text(client, target, names, input_ids, attention_mask=None):
    """A FedSGD client's (U, m, D) per-sequence gradients."""
    from datamodules.federated import NextTokenLoss, Observation

    batch = {"input_ids": input_ids} if attention_mask is None else {"input_ids": input_ids, "attention_mask": attention_mask}
    return client.per_example_gradients(batch, Observation(target, names, NextTokenLoss()))


def per_example_images(client, target, names, inputs, labels):
    """A FedSGD client's (U, m, D) per-sample gradients of image/table clients."""
    from datamodules.federated import ClassificationLoss, Observation

    return client.per_example_gradients({"inputs": inputs, "labels": labels}, Observation(target, names, ClassificationLoss()))
