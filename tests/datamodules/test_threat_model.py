"""`ThreatModel`: built without Lightning, it is the threat model `lti fit` builds from the same config; it is
stored by content and rebuilt from it; its simulation and update reading match slow references."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import REPO

from datamodules.federated import FedSGDClient, LoRAClient
from datamodules.targets import HFCausalLM
from datamodules.threat_model import ThreatModel, weight_update

TINY = REPO / "configs" / "audit" / "tiny_llama_lora.yaml"


@pytest.fixture(scope="module")
def threat() -> ThreatModel:
    return ThreatModel.from_config(TINY)


def test_it_is_the_threat_model_lti_fit_builds_from_the_same_config(threat):
    from lti.trainer_cli import instantiate

    _, data = instantiate(str(TINY), [])
    assert threat.pipeline.spec == data.pipeline.spec  # observed names, shapes, hashing, the weights' fingerprint
    assert threat.names == list(data.pipeline.names) and threat.seq_len == data.seq_len == 8
    assert type(threat.pipeline.client) is type(data.pipeline.client)


def test_it_is_stored_by_content_and_rebuilt_without_its_file(threat, tmp_path):
    content = threat.to_dict()
    json.dumps(content)  # storable in checkpoints, evidence files and report folders
    assert content["seq_len"] == 8 and content["client"]["init_args"]["rank"] == 8
    assert content["hashing"]["fraction"] == 0.1 and content["defense"]["class_path"].endswith("NoDefense")
    again = ThreatModel.from_dict(content)
    assert again.pipeline.spec == threat.pipeline.spec and again.to_dict() == content
    # Only the threat model's keys of an `lti fit` config count: its trainer and inverter are not part of it.
    config = yaml.safe_load(TINY.read_text())
    config["model"]["lr"] = 0.5
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(config))
    assert ThreatModel.from_config(path).to_dict() == content


def test_overrides_change_the_config_as_lti_fit_flags_would_and_leave_the_source_alone(threat):
    from lti.trainer_cli import instantiate

    source = yaml.safe_load(TINY.read_text())
    before = json.dumps(source, sort_keys=True)
    changed = ThreatModel.from_config(source, {"data.client.init_args.rank": 4, "seq_len": 6})
    _, data = instantiate(str(TINY), ["--data.client.init_args.rank", "4", "--data.seq_len", "6"])
    assert changed.pipeline.spec == data.pipeline.spec and changed.seq_len == 6
    assert changed.pipeline.spec != threat.pipeline.spec  # rank 4 adapters: other shapes
    assert changed.to_dict()["client"]["init_args"]["rank"] == 4
    assert json.dumps(source, sort_keys=True) == before
    with pytest.raises(ValueError, match="override 'clinet.rank': the threat model's keys are"):
        ThreatModel.from_config(TINY, {"clinet.rank": 4})


def test_the_content_an_lti_fit_run_records_is_the_threat_model_it_built():
    """What the CLI records of a DataModule (stored in its checkpoints) rebuilds the same observed updates, also when
    deprecated options (data.hash_bins) changed the hashing outside the threat model's keys."""
    from lti.trainer_cli import instantiate

    with pytest.warns(FutureWarning):
        _, data = instantiate(str(TINY), ["--data.hash_bins", "12"])
    content = data.threat_model.to_dict()
    assert content["hashing"]["bins"] == 12
    assert ThreatModel.from_dict(content).pipeline.spec == data.pipeline.spec


def test_bad_configs_are_refused_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ThreatModel.from_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="unknown key 'corpus'"):
        ThreatModel.from_config({"seq_len": 8, "corpus": "x"})
    with pytest.raises(ValueError, match="seq_len"):
        ThreatModel.from_config({"seq_len": "long"})
    with pytest.raises(ValueError, match="seq_len=1"):
        ThreatModel.from_config({"seq_len": 1})
    built = ThreatModel(HFCausalLM(architecture="llama", config=dict(num_hidden_layers=1, hidden_size=16,
                                   intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                                   max_position_embeddings=16)), seq_len=4)
    with pytest.raises(ValueError, match="from Python objects"):
        built.to_dict()


def tiny_threat(batch: int = 1) -> ThreatModel:
    target = HFCausalLM(architecture="llama", config=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=97, max_position_embeddings=32))
    client = LoRAClient(rank=4, target_modules=["q_proj", "v_proj"], seed=0, init_b_std=0.02,
                        local=FedSGDClient("eval", batch))
    return ThreatModel(target, client, seq_len=6)


def test_simulate_gives_each_sequences_own_update_and_their_mean_is_the_batchs():
    threat, batched = tiny_threat(), tiny_threat(3)
    ids = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(0))
    per_sequence = threat.simulate(ids.tolist())
    for row, sequence in zip(per_sequence, ids):  # the slow reference: one pipeline call per sequence
        alone = threat.pipeline({"input_ids": sequence[None, None]}, keep_update=True).update[0]
        # vectorised over the sequences or not: equal to float32 rounding
        torch.testing.assert_close(row, alone, rtol=1e-4, atol=1e-5 * float(alone.abs().max()))
    mean = batched.pipeline({"input_ids": ids[None]}, keep_update=True).update[0]
    torch.testing.assert_close(per_sequence.mean(0), mean, rtol=1e-4, atol=1e-5 * float(mean.abs().max()))
    split = threat.split(mean)
    assert list(split) == threat.names and all(g.dtype == torch.float64 for g in split.values())


def test_the_update_is_read_off_returned_weights_and_weights_load_with_checks():
    threat = tiny_threat()
    sent = threat.weights()
    update = threat.simulate([[1, 2, 3, 4, 5, 6]])[0]
    lr, start, returned = 0.05, 0, {}
    for name in threat.names:
        size = sent[name].numel()
        returned[name] = (sent[name] - lr * update[start : start + size].view_as(sent[name])).float()
        start += size
    read = threat.update_from_weights(sent, returned, lr)
    assert read.dtype == torch.float32
    torch.testing.assert_close(read, update, rtol=1e-3, atol=1e-6)  # float32 rounding of the returned weights
    torch.testing.assert_close(read, weight_update(sent, returned, lr, threat.names), rtol=0, atol=0)
    threat.load_weights(returned)
    assert torch.equal(threat.weights()[threat.names[0]], returned[threat.names[0]])
    with pytest.raises(ValueError, match="lack observed parameter"):
        threat.load_weights({})
    with pytest.raises(ValueError, match="does not have"):
        threat.load_weights({**sent, "nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        threat.load_weights({**sent, threat.names[0]: torch.zeros(1)})
