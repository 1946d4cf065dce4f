"""The `Attack` interface: DAGER and the batched attack behind it return what they return called directly."""

from __future__ import annotations

import json

import pytest
import torch
from test_batched import VOCAB, pipeline

from datamodules.threat_model import ThreatModel
from exact.batched import BatchedLoRA, BatchedOptions, SiteWhitening, adapter_sites
from exact.dager import Dager
from exact.interface import Attack, BatchedAttack, DagerAttack, Reconstruction

OPTIONS = BatchedOptions(beam=2, refine=1, label_candidates=4)


def batch_update(batch: int, seed: int):
    pipe = pipeline(batch)
    threat = ThreatModel.from_pipeline(pipe, seq_len=5)
    ids = torch.randint(0, VOCAB, (batch, 5), generator=torch.Generator().manual_seed(seed))
    update = pipe({"input_ids": ids[None]}, keep_update=True).update[0]
    return threat, ids, update


def test_dager_behind_the_interface_is_dager():
    threat, ids, update = batch_update(1, 0)
    found = DagerAttack().attack(update, threat, 1)
    split = {name: grads[0] for name, grads in threat.pipeline.split(update[None]).items()}
    direct = Dager().attack(threat.target, split, batch_size=1, max_length=5)
    assert isinstance(DagerAttack(), Attack) and found.sequences == direct.sequences
    assert found.certified_update == direct.exact and len(found.certified) == len(found.sequences)


def test_the_batched_attack_behind_the_interface_is_the_batched_attack_and_fits_its_whitening_once(tmp_path, monkeypatch):
    threat, ids, update = batch_update(2, 1)
    blocks = torch.randint(0, VOCAB, (32, 5), generator=torch.Generator().manual_seed(3))
    cache = tmp_path / "whitening.safetensors"
    attack = BatchedAttack(OPTIONS, auxiliary_ids=blocks, whitening_cache=cache)
    found = attack.attack(update, threat, 2)
    assert cache.is_file() and isinstance(attack, Attack)
    whitening = SiteWhitening.fit(threat.target, adapter_sites(threat.names), blocks)
    torch.testing.assert_close(attack.whitening.sites, whitening.sites, rtol=1e-9, atol=1e-12)
    direct = BatchedLoRA(threat.target, threat.names, whitening, OPTIONS).attack(threat.split(update), 2, 5,
                                                                                 threat.simulate, update)
    assert found.sequences == direct.sequences and found.diagnostics["residual"] == direct.residual
    assert found.certified == [direct.certified] * 2 and found.confidence == direct.margins
    json.dumps(found.to_dict(lambda ids: " ".join(map(str, ids))))
    # A second attack object reads the cached whitening instead of fitting it again.
    monkeypatch.setattr(SiteWhitening, "fit", lambda *a, **k: pytest.fail("the cached whitening was fitted again"))
    again = BatchedAttack(OPTIONS, auxiliary_ids=blocks, whitening_cache=cache)
    assert again.attack(update, threat, 2).sequences == found.sequences


def test_the_batched_attack_stays_bound_to_its_threat_model_and_fits_again_for_another_model():
    threat, ids, update = batch_update(2, 1)
    blocks = torch.randint(0, VOCAB, (32, 5), generator=torch.Generator().manual_seed(3))
    attack = BatchedAttack(OPTIONS, auxiliary_ids=blocks)
    attack.attack(update, threat, 2)
    first, search = attack.whitening, attack._bound[1]
    attack.attack(update, threat, 2)
    assert attack.whitening is first and attack._bound[1] is search
    other_pipe = pipeline(2, seed=1)
    other = ThreatModel.from_pipeline(other_pipe, seq_len=5)
    assert other.fingerprint != threat.fingerprint
    attack.attack(other_pipe({"input_ids": ids[None]}, keep_update=True).update[0], other, 2)
    assert attack.whitening is not first and attack._bound[0] is other
    expected = SiteWhitening.fit(other.target, adapter_sites(other.names), blocks)
    torch.testing.assert_close(attack.whitening.sites, expected.sites, rtol=1e-9, atol=1e-12)


def test_a_reconstruction_is_json_ready():
    found = Reconstruction([[1, 2]], [True], [[0.5, 0.25]], {"bag": torch.tensor([1, 2]), "mode": {"a"}})
    assert json.loads(json.dumps(found.to_dict()))["diagnostics"] == {"bag": [1, 2], "mode": ["a"]}
