"""The hybrid learned attack (`model.evidence`): the span evidence reaches the inverter's logits in
training and evaluation, its weights are learned and saved, and settings it cannot run under are refused."""

import json
from types import SimpleNamespace

import pytest
import torch

from datamodules.federated import FedSGDClient
from datamodules.targets import Transformer3
from datamodules.text import LocalCorpus
from datamodules.text_inversion import TextInversionDataModule
from exact.span_evidence import EvidenceOptions
from lti.cli import main
from lti.decoding import decode
from lti.module import InversionModule

TWO_LAYERS = {"data.target.init_args.num_layers": 2}  # the span evidence is read where DAGER reads it
M2 = {"class_path": "datamodules.federated.FedSGDClient", "init_args": {"mode": "train", "samples_per_update": 2}}


def test_fit_with_evidence_learns_its_weights_and_evaluates_with_them(make_config, tmp_path, monkeypatch):
    config = make_config(**{"model.evidence": {"enabled": True}, "data.client": M2, "data.grouping": "fresh",
                            "trainer.max_steps": 6, "trainer.val_check_interval": 6, "model.lr": 0.05, **TWO_LAYERS})
    main(["fit", "--config", str(config)])
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    assert float(state["evidence_prior.slope"].abs()) > 0 or float(state["evidence_prior.hinges"].abs().sum()) > 0
    main(["test", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt")])
    metrics = json.loads((tmp_path / "run" / "test_metrics.json").read_text())["metrics"]
    assert 0.0 <= metrics["test/lti/token_acc"] <= 1.0
    rules = []
    monkeypatch.setattr("lti.module.decode", lambda logits, m, rule: rules.append(rule) or decode(logits, m, rule))
    main(["validate", "--config", str(config), "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"),
          "--model.decoding", "distinct"])
    assert rules and set(rules) == {"distinct"}  # the command line's choice, not the checkpoint's
    result = json.loads((tmp_path / "run" / "val_metrics.json").read_text())
    assert 0.0 <= result["metrics"]["val/lti/token_acc"] <= 1.0


def test_evaluation_logits_include_the_evidence_bonus(corpus_files):
    """The bonus is the prior of the span scores of this batch's own updates, the same for each sequence slot."""
    dm = TextInversionDataModule(
        target=Transformer3(hidden_size=16, num_heads=2, ffn_size=32, num_layers=2, max_positions=8),
        corpus=LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])]), seq_len=4, batch_size=2,
        client=FedSGDClient(mode="train", samples_per_update=2))
    dm.setup("validate")
    module = InversionModule(evidence=EvidenceOptions(enabled=True))
    module.trainer = SimpleNamespace(datamodule=dm, training=False, global_rank=0)
    module.setup("validate")
    module.configure_model()
    with torch.no_grad():
        module.evidence_prior.slope.fill_(2.0)
    batch = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)
    bonus = module._evidence_bonus(batch)(None, None)  # (U, m*L, V)
    scores = module.span_evidence(dm.pipeline.split(batch["update"]))
    assert scores.abs().max() > 1.0
    assert torch.allclose(bonus[:, :4], 2.0 * scores) and torch.allclose(bonus[:, 4:], 2.0 * scores)
    # A sampled-softmax step scores only its candidates, against the mean of the uniformly drawn ones.
    candidates, reference = torch.tensor([3, 17, 40, 41, 90]), torch.tensor([0, 2, 4])
    sampled = module._evidence_bonus(batch)(candidates, reference)
    shifted = scores[..., candidates] - scores[..., candidates][..., reference].mean(-1, keepdim=True)
    assert torch.allclose(sampled[:, :4], 2.0 * shifted, atol=1e-4)


def test_evidence_with_an_observation_cache_is_refused_in_one_line(make_config, tmp_path):
    config = make_config(**{"model.evidence": {"enabled": True}, "data.cache": {"path": str(tmp_path / "cache")}, **TWO_LAYERS})
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    assert not (tmp_path / "cache").exists()


def test_a_checkpoint_that_saved_its_decoding_does_not_override_the_command_line(make_config, tmp_path, monkeypatch):
    config = make_config(**{"data.client": M2, "trainer.max_steps": 2, "trainer.val_check_interval": 2})
    main(["fit", "--config", str(config)])
    path = tmp_path / "ckpt" / "last.ckpt"
    state = torch.load(path, weights_only=True)
    state["hyper_parameters"]["decoding"] = "argmax"  # as checkpoints written before it was left out
    old = tmp_path / "old.ckpt"
    torch.save(state, old)
    rules = []
    monkeypatch.setattr("lti.module.decode", lambda logits, m, rule: rules.append(rule) or decode(logits, m, rule))
    main(["validate", "--config", str(config), "--ckpt_path", str(old), "--model.decoding", "distinct"])
    assert rules and set(rules) == {"distinct"}


def test_fit_with_evidence_reads_lora_adapters(tmp_path, monkeypatch):
    """The hybrid on a LoRA threat model (the audit's tiny Llama, q/v adapters): the span is read from the
    observed lora_A gradients, training runs and the evidence weights learn."""
    from conftest import REPO

    monkeypatch.setenv("LTI_CACHE_DIR", str(tmp_path / "cache"))
    main(["fit", "--config", str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml"), "--model.evidence.enabled", "true",
          "--data.keep_eval_updates", "true", "--model.lr", "0.05", "--trainer.max_steps", "3",
          "--trainer.val_check_interval", "3", "--data.eval_samples", "4", "--data.batch_size", "4",
          "--trainer.default_root_dir", str(tmp_path / "run"), "--checkpoint.dirpath", str(tmp_path / "ckpt")])
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    assert float(state["evidence_prior.slope"].abs()) > 0 or float(state["evidence_prior.hinges"].abs().sum()) > 0
