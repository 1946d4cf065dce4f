"""The `Attack` interface: DAGER and the batched attack behind it return what they return called directly."""

from __future__ import annotations

import json

import pytest
import torch
from test_batched import VOCAB, pipeline

from datamodules.threat_model import ThreatModel
from exact.batched import BatchedLoRA, BatchedOptions, SiteWhitening, adapter_sites
from exact.dager import Dager
from exact.dager.options import RETURNED_FLOAT32
from exact.interface import Attack, BatchedAttack, DagerAttack, Reconstruction

OPTIONS = BatchedOptions(beam=2, refine=1, label_candidates=4)


def batch_update(batch: int, seed: int):
    pipe = pipeline(batch)
    threat = ThreatModel.from_pipeline(pipe, seq_len=5)
    ids = torch.randint(0, VOCAB, (batch, 5), generator=torch.Generator().manual_seed(seed))
    update = pipe({"input_ids": ids[None]}, keep_update=True).update[0]
    return threat, ids, update


def test_dager_behind_the_interface_is_dager_with_the_span_tests_of_float32_returned_weights():
    threat, ids, update = batch_update(1, 0)
    found = DagerAttack().attack(update, threat, 1)
    split = {name: grads[0] for name, grads in threat.pipeline.split(update[None]).items()}
    direct = Dager(span=RETURNED_FLOAT32).attack(threat.target, split, batch_size=1, max_length=5)
    assert isinstance(DagerAttack(), Attack) and found.sequences == direct.sequences
    assert found.certified_update == direct.exact and len(found.certified) == len(found.sequences)
    assert DagerAttack().dager.options.span == RETURNED_FLOAT32


def returned_float32_update(threat: ThreatModel, gradient: torch.Tensor, lr: float, step_norm: float) -> torch.Tensor:
    """The update a server reads off float32 weights a client returned after a step of norm `step_norm` along
    `gradient` (as fixed clipping scales it)."""
    sent = threat.weights()
    step = lr * gradient.double()
    step = step * step_norm / step.norm()
    returned, start = {}, 0
    for name in threat.names:
        size = sent[name].numel()
        returned[name] = (sent[name].double() - step[start : start + size].view_as(sent[name])).float()
        start += size
    return threat.update_from_weights(sent, returned, lr)


def test_dager_reads_a_small_step_off_float32_weights_where_the_papers_thresholds_lose_tokens():
    """The returned weights' rounding is fixed in size, so a small (clipped) step moves true inputs off the first
    layer's span by more than the paper's 1e-3 (up to 1.6e-3 here; the nearest wrong token stays beyond 0.8), and
    prefixes off the second layer's."""
    pipe = pipeline(1)
    threat = ThreatModel.from_pipeline(pipe, seq_len=5)
    paper, returned = 0, 0
    for seed in range(4):
        ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))
        gradient = pipe({"input_ids": ids[None]}, keep_update=True).update[0]
        update = returned_float32_update(threat, gradient, lr=0.05, step_norm=1e-3)
        visible = ids[0, :-1].tolist()  # the last token is a label only
        read = DagerAttack().attack(update, threat, 1).sequences
        assert read and read[0][: len(visible)] == visible
        returned += len(visible)
        found = DagerAttack(Dager()).attack(update, threat, 1).sequences
        paper += sum(a == b for a, b in zip(found[0], visible)) if found else 0
    assert paper <= returned - 2  # measured: 10 of 16


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


def test_spear_behind_the_interface_is_spear_on_the_layer_and_recovers_its_inputs():
    """SPEAR recovers a layer's input rows (B x L for text), certified by its own test; the interface's result is the
    direct call's, and the rows are the layer's true inputs."""
    from datamodules.federated import FedSGDClient
    from datamodules.federated.hashing import Hashing
    from datamodules.targets import Transformer3
    from exact.interface import SpearAttack
    from exact.spear import Spear, relu_linear_layer

    model = Transformer3(vocab_size=200, hidden_size=32, num_heads=2, ffn_size=128, num_layers=2, max_positions=8)
    threat = ThreatModel(model, FedSGDClient(mode="eval"), hashing=Hashing(bins=16), seq_len=8)
    ids = torch.randint(0, 200, (1, 1, 8), generator=torch.Generator().manual_seed(0))
    update = threat.pipeline({"input_ids": ids}, keep_update=True).update[0]
    found = SpearAttack("encoder.layers.0.linear1").attack(update, threat, 1)
    layer = relu_linear_layer(threat.target, "encoder.layers.0.linear1")
    split = threat.split(update)
    direct = Spear().attack(split[layer.weight_name], split[layer.bias_name], batch_size=8,
                            weight=layer.module.weight, bias=layer.module.bias)
    assert found.certified_update and direct.exact and found.sequences == []
    torch.testing.assert_close(found.inputs, direct.inputs)
    seen = []
    handle = layer.module.register_forward_hook(lambda module, args, output: seen.append(args[0].detach()))
    with torch.no_grad():
        threat.target.eval()(ids[0])
    handle.remove()
    truth = seen[0].reshape(-1, layer.module.in_features).double()
    cosine = torch.nn.functional.cosine_similarity(truth[:, None], found.inputs.double()[None], dim=-1).max(1).values
    assert bool((cosine > 0.999999).all())
    assert json.loads(json.dumps(found.to_dict()))["inputs"]


def test_the_token_callback_refuses_an_attack_that_recovers_layer_inputs():
    from exact.callbacks.attacks import AttackCallback
    from exact.interface import SpearAttack

    with pytest.raises(ValueError, match="recovers a layer's inputs, not tokens: score it with SpearCallback"):
        AttackCallback([SpearAttack("encoder.layers.0.linear1")])
