"""`lti audit`: the Flower strategy sees what the clients sent, Flower's DP mods act on it, the server
reads the right update off it, the audit records, resumes and reports, and bad input is one line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

flwr = pytest.importorskip("flwr")

from conftest import REPO  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402

from datamodules.federated import FedSGDClient, LoRAClient, UpdatePipeline  # noqa: E402
from datamodules.machine import describe_machine, machine_line  # noqa: E402
from datamodules.targets import HFCausalLM  # noqa: E402
from exact.batched import BatchedOptions  # noqa: E402
from lti.audit.attacks import observed_update  # noqa: E402
from lti.audit.federation import (  # noqa: E402
    SerialGrid,
    adapter_state,
    client_pipeline,
    load_adapter_state,
    make_client_app,
    observed_fedavg,
)
from lti.audit.options import AttackOptions, AuditOptions, FederationOptions, FlowerDPOptions  # noqa: E402
from lti.audit.run import Audit, client_batch_indices, client_ranges, epsilon_after  # noqa: E402

TINY = str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml")


def tiny_pipeline(rank: int = 4, defense=None) -> UpdatePipeline:
    target = HFCausalLM(architecture="llama", config=dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=32))
    client = LoRAClient(rank=rank, target_modules=["q_proj", "v_proj"], seed=0, init_b_std=0.02,
                        local=FedSGDClient("train", 1))
    return UpdatePipeline(target, client=client, defense=defense)


def random_data(client: int, round_: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * client + round_)
    return {"input_ids": torch.randint(0, 97, (1, 2, 6), generator=generator)}


def federate(pipeline, rounds=2, clients=3, lr=0.05, mods=None, wrap=None, local_epochs=1):
    """Run Flower rounds over the serial grid; returns (what the clients' code sent, what the strategy saw)."""
    sent, seen, globals_ = {}, {}, {}
    app = make_client_app(client_pipeline(pipeline, 2, local_epochs, lr=lr), random_data, lr, mods,
                          sent=lambda c, r, arrays: sent.__setitem__((c, r), arrays))

    def observe(round_, client, global_arrays, reply):
        seen[(client, round_)] = reply
        globals_[round_] = global_arrays

    grid = SerialGrid(app, clients)
    strategy = observed_fedavg(observe, grid.node_to_client, min_train_nodes=clients, min_available_nodes=clients)
    if wrap is not None:
        strategy = wrap(strategy)
    with grid.serving():
        strategy.start(grid=grid, initial_arrays=ArrayRecord(torch_state_dict=adapter_state(pipeline)), num_rounds=rounds)
    return sent, seen, globals_


def test_the_strategy_receives_byte_for_byte_what_each_client_sent():
    sent, seen, _ = federate(tiny_pipeline())
    assert sorted(seen) == sorted(sent) == [(c, r) for c in range(3) for r in (1, 2)]
    for key, arrays in seen.items():
        assert list(arrays.keys()) == list(sent[key].keys())
        for name in arrays.keys():
            assert arrays[name].data == sent[key][name].data  # the serialised bytes themselves
            assert arrays[name].dtype == sent[key][name].dtype and arrays[name].shape == sent[key][name].shape


def test_the_server_reads_the_clients_update_off_the_returned_weights():
    """u = (w - returned) / lr equals the pipeline's own update of the client's batch, to float32 rounding
    of the returned weights (checked against a float64 bound)."""
    pipeline = tiny_pipeline()
    lr = 0.05
    _, seen, globals_ = federate(pipeline, rounds=1, lr=lr)
    reference = client_pipeline(pipeline, 2)
    for (client, round_), reply in seen.items():
        sent = globals_[round_].to_torch_state_dict()
        recovered = observed_update(sent, reply.to_torch_state_dict(), lr, list(pipeline.names))
        generator = torch.Generator().manual_seed(1_000_003 * round_ + client)
        truth = reference(random_data(client, round_), keep_update=True, generator=generator).update[0]
        weights = torch.cat([sent[n].flatten() for n in pipeline.names]).double()
        # The client computes w - lr * u in float32: lr rounded to float32, the product and the difference
        # each add up to half an ulp (relative 2^-24) of their magnitude.
        bound = (weights.abs() + 3 * lr * truth.double().abs()) * 2 ** -24 / lr * 1.01 + 1e-12
        assert ((recovered.double() - truth.double()).abs() <= bound).all()
        assert truth.abs().max() > 0


def test_fedavg_clients_return_their_local_steps_and_the_server_reads_their_mean_gradient():
    """Two local epochs over a client's batch of two sequences: the returned adapters equal two FedSGD steps
    applied by hand (the slow reference), and (w - returned) / (2 lr) is the mean of the two gradients."""
    pipeline = tiny_pipeline()
    lr = 0.05
    _, seen, globals_ = federate(pipeline, rounds=1, clients=2, lr=lr, local_epochs=2)
    one_step = client_pipeline(pipeline, 2)  # FedSGD: the gradient of the batch at the weights loaded
    names = list(pipeline.names)
    for (client, round_), reply in seen.items():
        sent = globals_[round_].to_torch_state_dict()
        weights, gradients = {n: sent[n].double() for n in names}, []
        for _ in range(2):
            load_adapter_state(one_step, {n: w.float() for n, w in weights.items()})
            update = one_step(random_data(client, round_), keep_update=True).update
            gradient = {n: g[0].double() for n, g in one_step.split(update).items()}
            gradients.append(torch.cat([gradient[n].flatten() for n in names]))
            weights = {n: weights[n] - lr * gradient[n] for n in names}
        returned = reply.to_torch_state_dict()
        for n in names:
            assert torch.allclose(returned[n].double(), weights[n], rtol=0, atol=1e-6), n
        mean = observed_update(sent, returned, lr, names, steps=2).double()
        expected = (gradients[0] + gradients[1]) / 2
        assert (mean - expected).abs().max() <= 1e-4 * expected.abs().max()
        assert (gradients[0] - gradients[1]).abs().max() > 1e-3 * expected.abs().max()  # the second step moved
    from datamodules.federated import GaussianNoise

    noisy = tiny_pipeline(defense=GaussianNoise(0.01))
    client_pipeline(noisy, 2)  # one FedSGD step: the threat model's defense as it was trained under
    with pytest.raises(ValueError, match="without a workbench defense"):
        client_pipeline(noisy, 2, local_epochs=2)


def test_the_audits_dager_reads_updates_with_the_span_tests_of_float32_returned_weights():
    from exact.dager.options import RETURNED_FLOAT32, SpanTests

    assert AttackOptions().dager_search.span == RETURNED_FLOAT32 != SpanTests()
    assert RETURNED_FLOAT32.l1_threshold > SpanTests().l1_threshold


def test_flower_fixed_clipping_clips_every_update_the_server_sees():
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

    pipeline = tiny_pipeline()
    norm, lr = 1e-4, 0.05
    raw, seen, globals_ = federate(
        pipeline, rounds=1, lr=lr, mods=[fixedclipping_mod],
        wrap=lambda s: DifferentialPrivacyClientSideFixedClipping(s, noise_multiplier=1.0, clipping_norm=norm,
                                                                  num_sampled_clients=3))
    for key, reply in seen.items():
        sent = globals_[key[1]].to_torch_state_dict()
        clipped = observed_update(sent, reply.to_torch_state_dict(), 1.0, list(pipeline.names)).double()
        unclipped = observed_update(sent, raw[key].to_torch_state_dict(), 1.0, list(pipeline.names)).double()
        assert unclipped.norm() > norm  # the clipping acted
        assert clipped.norm() == pytest.approx(norm, rel=1e-3)
        assert torch.nn.functional.cosine_similarity(clipped, unclipped, dim=0) > 0.999


def test_flower_local_dp_adds_noise_of_the_stated_scale():
    from flwr.clientapp.mod import LocalDpMod

    pipeline = tiny_pipeline()
    clip, eps, delta = 1e-3, 50.0, 1e-5
    raw, seen, globals_ = federate(pipeline, rounds=1, lr=0.05, mods=[LocalDpMod(clip, clip, eps, delta)])
    sigma = clip * math.sqrt(2 * math.log(1.25 / delta)) / eps
    for key, reply in seen.items():
        sent = globals_[key[1]].to_torch_state_dict()
        observed = observed_update(sent, reply.to_torch_state_dict(), 1.0, list(pipeline.names)).double()
        unclipped = observed_update(sent, raw[key].to_torch_state_dict(), 1.0, list(pipeline.names)).double()
        clipped = unclipped * min(1.0, clip / float(unclipped.norm()))
        noise = observed - clipped
        assert float(noise.std()) == pytest.approx(sigma, rel=0.1)


def test_clients_hold_disjoint_consecutive_samples_and_draw_only_their_own():
    ranges = client_ranges(103, 4)
    assert [len(r) for r in ranges] == [26, 26, 25, 26] and ranges[0].start == 0 and ranges[-1].stop == 103
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    for client, own in enumerate(ranges):
        for round_ in range(1, 4):
            picked = client_batch_indices(own, 4, client, round_, seed=0)
            assert len(set(picked.tolist())) == 4 and all(i in own for i in picked.tolist())
    assert not torch.equal(client_batch_indices(ranges[0], 4, 0, 1, 0), client_batch_indices(ranges[0], 4, 0, 2, 0))
    with pytest.raises(ValueError, match="fewer than federation.clients"):
        client_ranges(3, 4)


def test_epsilon_grows_with_rounds_and_falls_with_noise():
    local = AuditOptions(threat_model=TINY, flower_dp=FlowerDPOptions(mode="local_dp", epsilon=2.0))
    assert epsilon_after(local, 3) == 6.0
    central = AuditOptions(threat_model=TINY, flower_dp=FlowerDPOptions(mode="fixed_clipping", noise_multiplier=1.0))
    noisier = AuditOptions(threat_model=TINY, flower_dp=FlowerDPOptions(mode="fixed_clipping", noise_multiplier=2.0))
    assert epsilon_after(central, 1) < epsilon_after(central, 5)
    assert epsilon_after(noisier, 5) < epsilon_after(central, 5)
    assert epsilon_after(AuditOptions(threat_model=TINY), 3) is None


@pytest.fixture(scope="module")
def tiny_audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    options = AuditOptions(threat_model=TINY, out_dir=str(out), federation=FederationOptions(clients=2, rounds=2, lr=0.5),
                           attacks=AttackOptions(probe_sequences=0), utility_sequences=8)
    records = Audit(options, say=lambda *_: None).run()
    return options, out, records


def test_an_audit_writes_its_report_and_every_round(tiny_audit):
    options, out, records = tiny_audit
    for name in ("report.md", "report.json", "leakage_over_rounds.png", "privacy_utility.png", "audit.json"):
        assert (out / name).is_file()
    assert [r["round"] for r in records] == [1, 2]
    for record in records:
        assert record["clients"] == [0, 1]
        assert set(record["attacks"]) == {"dager", "batched"}  # the batched attack runs by default
        assert record["attacks"]["dager"]["sequences"] == record["attacks"]["batched"]["sequences"] == 2
        assert math.isfinite(record["utility_after"])
    assert records[1]["utility_before"] == records[0]["utility_after"]
    stored = json.loads((out / "report.json").read_text())
    assert stored["probe_baseline"] is None  # no inverter, no probe
    # B, L and r stated beside the numbers (the tiny threat model: 8 tokens, rank 8 on q/v; one sequence per update)
    assert stored["setting"] == {"B": 1, "L": 8, "lora_rank": 8, "lora_modules": ["q_proj", "v_proj"]}
    report = (out / "report.md").read_text()
    assert "B = 1 sequence of L = 8 tokens per update, LoRA r = 8 on q_proj, v_proj, FedSGD step" in report
    assert "Staleness probe" not in report
    assert "| 2 | DAGER" in report and "## Reconstructions" in report
    # The batched attack's whitening is kept in the folder (one file for this model and auxiliary text).
    assert len(list((out / "whitening").glob("*.safetensors"))) == 1
    # The machine the times were measured on: the report's, and each round's attacks' (this one here).
    assert stored["machine"] == describe_machine("cpu")
    assert all(record["machine"] == stored["machine"] for record in records)
    assert f"min, on {machine_line(stored['machine'])}." in report and "another machine" not in report


def test_the_report_names_rounds_attacked_on_another_machine_or_before_machines_were_recorded(tiny_audit, tmp_path):
    """A resumed audit may hold rounds attacked elsewhere, or by a version that recorded no machine: their seconds are
    not this machine's, and the report says so, one line per machine."""
    from lti.audit.report import write_report

    options, _, records = tiny_audit
    here = records[0]["machine"]
    other = {**here, "cpu_model": "another"}
    moved = [{**records[0], "round": r, "machine": m} for r, m in ((1, here), (2, other), (3, other), (4, None))]
    del moved[3]["machine"]
    write_report(tmp_path, options, moved, None, 60.0, machine=here)
    report = (tmp_path / "report.md").read_text()
    assert report.count("another machine") == 1
    assert f"Rounds 2, 3 attacked on another machine or setting: {machine_line(other)}." in report
    assert "Round 4 attacked before audits recorded their machine." in report
    assert json.loads((tmp_path / "report.json").read_text())["machine"] == here


def test_the_report_counts_updates_whose_attack_the_time_budget_cut_short(tiny_audit, tmp_path):
    from lti.audit.report import write_report

    options, _, records = tiny_audit
    assert records[0]["attacks"]["batched"]["budget_reached"] == [False, False]  # no budget by default
    write_report(tmp_path, options, records, None, 60.0, machine=records[0]["machine"])
    assert "time budget reached" not in (tmp_path / "report.md").read_text()
    cut = {**records[0], "attacks": {**records[0]["attacks"],
                                     "batched": {**records[0]["attacks"]["batched"], "budget_reached": [True, False]}}}
    write_report(tmp_path, options, [cut], None, 60.0, machine=records[0]["machine"])
    assert "time budget reached on 1 of 2" in (tmp_path / "report.md").read_text()


def test_a_learned_scorer_fitted_for_another_model_is_refused_and_nothing_is_left(tmp_path):
    from exact.batched.scorer import ScorerWeights

    weights = tmp_path / "scorer.safetensors"
    ScorerWeights(torch.ones(2, dtype=torch.float64), 0.5, "another-model").save(weights)
    options = AuditOptions(threat_model=TINY, out_dir=str(tmp_path / "s"), federation=FederationOptions(clients=2, rounds=1),
                           attacks=AttackOptions(dager=False, probe_sequences=0, batched_scorer=str(weights)),
                           utility_sequences=4)
    with pytest.raises(ValueError, match="fitted for another model"):
        Audit(options, say=lambda *_: None).run()
    assert not (tmp_path / "s").exists()


def test_the_audit_takes_the_learned_scorer_fitted_nearest_its_clients_batch_size(tmp_path):
    from datamodules.federated.pipeline import target_fingerprint
    from exact.batched.scorer import ScorerWeights, save_scorers

    def built(folder: str, scorer: str | None) -> Audit:
        audit = Audit(AuditOptions(threat_model=TINY, out_dir=str(tmp_path / folder),
                                   federation=FederationOptions(clients=2, rounds=1, batch_size=2),
                                   attacks=AttackOptions(dager=False, probe_sequences=0, batched_scorer=scorer),
                                   utility_sequences=4), say=lambda *_: None)
        audit._build()
        return audit

    plain = built("plain", None)
    fingerprint, sites = target_fingerprint(plain.server.target), plain.attacks.attacks[0].whitening.sites.shape[0]
    weights = tmp_path / "scorer.safetensors"
    save_scorers(weights, [ScorerWeights(torch.full((sites,), 0.5, dtype=torch.float64), 0.25, fingerprint, (2, 4)),
                           ScorerWeights(torch.full((sites,), 2.0, dtype=torch.float64), 0.75, fingerprint, (16,))])
    audit = built("grouped", str(weights))
    chosen_sites, chosen_lm = audit.attacks.attacks[0].second_opinion
    assert chosen_lm == 0.25 and torch.equal(chosen_sites, torch.full((sites,), 0.5, dtype=torch.float64))
    assert any("fitted on updates of B = 2/4" in note for note in audit.notes)


def test_dagers_options_are_a_config_group_of_the_audit(tmp_path, capsys):
    """`--attacks.dager_search.*` reaches the DAGER the audit runs (its thresholds, budgets, extensions)."""
    from exact.dager.options import DagerOptions, SpanTests
    from lti.audit.cli import main as audit_main

    options = AuditOptions(threat_model=TINY, out_dir=str(tmp_path / "d"),
                           attacks=AttackOptions(batched=False, probe_sequences=0,
                                                 dager_search=DagerOptions(span=SpanTests(l1_threshold=0.25))))
    audit = Audit(options, say=lambda *_: None)
    audit._build()
    assert audit.attacks.attacks[0].dager.options.span.l1_threshold == 0.25
    with pytest.raises(SystemExit) as exit_info:
        audit_main(["--threat_model", TINY, "--attacks.dager_search.span.l1_threshold", "-1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "lti audit: error: DAGER l1_threshold=-1.0 must be a finite number > 0"


def test_the_batched_attack_reads_updates_of_several_sequences_and_checks_them_by_least_squares(tmp_path):
    options = AuditOptions(threat_model=TINY, out_dir=str(tmp_path / "b"),
                           federation=FederationOptions(clients=2, rounds=1, lr=0.5, batch_size=2),
                           attacks=AttackOptions(dager=False, probe_sequences=0, batched_search=BatchedOptions(beam=2),
                                                 batched_scorer_updates=2), utility_sequences=4)
    records = Audit(options, say=lambda *_: None).run()
    # The learned scorer, fitted by the audit on updates it simulated of its own auxiliary text, is kept beside
    # the whitening and named in the report.
    kept = sorted(p.name.startswith("scorer-") for p in (tmp_path / "b" / "whitening").glob("*.safetensors"))
    assert kept == [False, True]
    assert "learned scorer (fitted on 2 updates of B = 2" in (tmp_path / "b" / "report.md").read_text()
    batched = records[0]["attacks"]["batched"]
    assert batched["sequences"] == 4
    # 2 x 7 visible tokens, fewer than the 16 lora_A rows of a site: the whole bag is found
    assert min(batched["bag_recall"]) == 1.0
    assert len(batched["residual"]) == 2 and all(r >= 0 for r in batched["residual"])
    assert sum(batched["modes"].values()) == 2
    # A random tiny model: its prior carries nothing and the update-blind guess reads ~0%; the span tests alone
    # read about half (first tokens exact, later positions graded)
    assert batched["token_acc"] > 0.25, batched["token_acc"]
    assert "batched LoRA attack" in (tmp_path / "b" / "report.md").read_text()


def test_an_interrupted_audit_resumes_with_the_same_rounds(tiny_audit, tmp_path):
    import shutil

    options, out, records = tiny_audit
    copy = tmp_path / "audit"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "rounds" / "r002")  # stopped during round 2
    for scores in (copy / "rounds" / "r001").glob("attacks-*.json"):
        scores.unlink()  # and before round 1 was attacked
    kept = (copy / "rounds" / "r001" / "replies.safetensors").stat().st_mtime_ns
    statistics = {p.name: p.stat().st_mtime_ns for p in (copy / "whitening").iterdir()}
    resumed = Audit(AuditOptions(**{**vars(options), "out_dir": str(copy)}), say=lambda *_: None).run()
    assert (copy / "rounds" / "r001" / "replies.safetensors").stat().st_mtime_ns == kept
    # The whitening and the learned scorer are read back, not computed again.
    assert {p.name: p.stat().st_mtime_ns for p in (copy / "whitening").iterdir()} == statistics
    assert [r["attacks"]["batched"]["token_acc"] for r in resumed] == [r["attacks"]["batched"]["token_acc"]
                                                                       for r in records]
    for name in ("sent", "replies", "after", "batches"):
        assert (copy / "rounds" / "r002" / f"{name}.safetensors").read_bytes() == \
            (out / "rounds" / "r002" / f"{name}.safetensors").read_bytes()
    assert [r["attacks"]["dager"]["token_acc"] for r in resumed] == [r["attacks"]["dager"]["token_acc"] for r in records]


def test_a_fedavg_audit_attacks_the_mean_gradient_of_the_clients_local_steps(tmp_path):
    options = AuditOptions(threat_model=TINY, out_dir=str(tmp_path / "a"),
                           federation=FederationOptions(clients=2, rounds=1, lr=0.5, local_epochs=3),
                           attacks=AttackOptions(probe_sequences=0), utility_sequences=4)
    audit = Audit(options, say=lambda *_: None)
    records = audit.run()
    assert records[0]["attacks"]["dager"]["sequences"] == 2
    assert audit.attacks.steps == 3 and audit.attacks.attacks[0].trajectory == (0.0, 0.5, 1.0)
    assert audit.attacks.attacks[1].check is False  # no refit of a FedAvg client's mean gradient
    report = (tmp_path / "a" / "report.md").read_text()
    assert "FedAvg: 3 local SGD steps at lr = 0.5" in report and "The clients run FedAvg" in report


def test_an_audit_folder_written_before_the_fedavg_options_still_resumes(tiny_audit, tmp_path):
    import shutil

    options, out, records = tiny_audit
    copy = tmp_path / "audit"
    shutil.copytree(out, copy)
    identity = json.loads((copy / "audit.json").read_text())
    for key in ("local_epochs", "minibatch_size"):
        del identity["federation"][key]  # as written before these options existed
    (copy / "audit.json").write_text(json.dumps(identity))
    same = FederationOptions(**{**vars(options.federation), "minibatch_size": options.federation.batch_size})
    resumed = Audit(AuditOptions(**{**vars(options), "federation": same, "out_dir": str(copy)}), say=lambda *_: None).run()
    assert [r["attacks"]["dager"]["token_acc"] for r in resumed] == [r["attacks"]["dager"]["token_acc"] for r in records]
    fedavg = FederationOptions(**{**vars(options.federation), "local_epochs": 2})
    with pytest.raises(ValueError, match="other federation"):
        Audit(AuditOptions(**{**vars(options), "federation": fedavg, "out_dir": str(copy)})).run()


def test_a_folder_of_another_audit_is_refused(tiny_audit):
    options, out, _ = tiny_audit
    other = AuditOptions(**{**vars(options), "federation": FederationOptions(clients=3, rounds=2)})
    with pytest.raises(ValueError, match="other federation"):
        Audit(other).run()


@pytest.mark.parametrize("argv, message", [
    (["--attacks.rounds", "[5]"], "attacks.rounds has round 5, but the simulation runs rounds 1..3"),
    (["--federation.clients", "0"], "federation.clients=0 must be >= 1"),
    (["--federation.minibatch_size", "2"], "federation.minibatch_size=2 must be in [1, batch_size = 1]"),
    (["--attacks.pointer_second_weight", "-1"], "attacks.pointer_second_weight=-1.0 must be finite and >= 0"),
    (["--flower_dp.mode", "local_dp", "--flower_dp.epsilon", "0"], "flower_dp.epsilon=0.0 must be"),
])
def test_bad_audit_options_are_one_line(argv, message, tmp_path, capsys):
    from lti.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "--threat_model", TINY, "--out_dir", str(tmp_path / "a"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "a").exists()  # nothing written


def test_a_threat_model_without_lora_is_refused(tmp_path, capsys):
    from lti.cli import main

    config = tmp_path / "fedsgd.yaml"
    text = (REPO / "configs" / "audit" / "tiny_llama_lora.yaml").read_text()
    start = text.index("  client:")
    end = text.index("  defense:")
    config.write_text(text[:start] + "  client:\n    class_path: datamodules.federated.FedSGDClient\n" + text[end:])
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "--threat_model", str(config), "--out_dir", str(tmp_path / "a")])
    assert exit_info.value.code == 2
    assert "the audit federates LoRA fine-tuning" in capsys.readouterr().err


def test_without_flower_the_audit_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    import sys

    from lti.cli import main

    monkeypatch.setitem(sys.modules, "flwr", None)  # import flwr -> ImportError
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "--threat_model", TINY, "--out_dir", str(tmp_path / "a")])
    assert exit_info.value.code == 2
    assert 'pip install -e ".[flower]"' in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_inverter(tmp_path_factory):
    """A few steps of the tiny threat model's own `lti fit`: a checkpoint the audit can load."""
    from lti.cli import main

    folder = tmp_path_factory.mktemp("inverter")
    main(["fit", "--config", TINY, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
          "--trainer.default_root_dir", str(folder), "--checkpoint.dirpath", str(folder / "ckpt"),
          "--data.eval_samples", "4"])
    return str(folder / "ckpt" / "last.ckpt")


def test_the_learned_inverter_attacks_every_round_and_is_probed_for_staleness(tiny_inverter, tmp_path):
    options = AuditOptions(threat_model=TINY, out_dir=str(tmp_path / "a"), federation=FederationOptions(clients=2, rounds=2),
                           attacks=AttackOptions(dager=False, checkpoint=tiny_inverter, probe_sequences=6, rounds=[2]),
                           utility_sequences=4)
    audit = Audit(options, say=lambda *_: None)
    records = audit.run()
    assert records[0]["attacks"] == {} and records[0]["probe"] == {}  # round 1 was not asked for
    learned = records[1]["attacks"]["learned"]
    assert learned["sequences"] == 2 and 0.0 <= learned["token_acc"] <= 1.0
    assert records[1]["probe"]["learned"]["sequences"] == 6
    report = (tmp_path / "a" / "report.md").read_text()
    assert "learned inverter (LTI)" in report
    # The probe's baseline, counted here position by position: the majority token of the server's data.
    majority = audit.data.majority_tokens.tolist()
    hits = [row[p] == majority[p] for row in audit.probe_ids.tolist() for p in range(len(row))]
    expected = 100 * sum(hits) / len(hits)
    assert f"scores {expected:.1f}% on them" in report
    saved = json.loads((tmp_path / "a" / "report.json").read_text())
    assert any("Staleness probe: 6 held-out" in note for note in saved["notes"])
    assert saved["probe_baseline"] == pytest.approx(expected / 100)


def test_an_inverter_of_another_threat_model_is_refused(tiny_inverter, tmp_path):
    config = tmp_path / "rank4.yaml"
    config.write_text(Path(TINY).read_text().replace("rank: 8", "rank: 4"))
    options = AuditOptions(threat_model=str(config), out_dir=str(tmp_path / "a"),
                           attacks=AttackOptions(checkpoint=tiny_inverter))
    with pytest.raises(ValueError, match="trained under another threat model"):
        Audit(options).run()
    assert not (tmp_path / "a").exists()


def test_an_inverter_loads_from_its_checkpoint_alone_and_predicts_as_its_module(tiny_inverter):
    """The checkpoint stores its threat model and inverter by content: `from_checkpoint` needs no config file and
    predicts exactly what the Lightning module, built from the config and given the same weights, predicts."""
    from datamodules.threat_model import ThreatModel
    from lti.audit.attacks import LearnedInverter
    from lti.trainer_cli import instantiate

    saved = torch.load(tiny_inverter, map_location="cpu", weights_only=True)
    assert saved["lti"]["threat_model"] == ThreatModel.from_config(TINY).to_dict()
    assert saved["lti"]["inverter"]["class_path"] == "lti.inverters.EmbeddingInverter"
    alone = LearnedInverter.from_checkpoint(tiny_inverter)
    module, data = instantiate(TINY)
    data.prepare_data()
    data.setup("validate")
    module.inverter.bind(data.inversion_spec)
    module.load_state_dict(saved["state_dict"])
    ids, _ = data.blocks("evaluation")
    features = data.pipeline({"input_ids": ids[:3, None]}).features
    with torch.no_grad():
        expected = module.eval()(features.float()).argmax(-1)
    assert torch.equal(alone.predict(features), expected)
    assert alone.sequences == 1 and alone.threat_model.to_dict() == saved["lti"]["threat_model"]
    found = alone.attack(data.pipeline({"input_ids": ids[:1, None]}, keep_update=True).update[0], alone.threat_model, 1)
    assert found.sequences == expected[:1].tolist()


def test_a_checkpoint_without_its_records_or_naming_foreign_code_is_refused(tiny_inverter, tmp_path):
    from datamodules.threat_model import ThreatModel
    from lti.audit.attacks import LearnedInverter
    from lti.trainer_cli import instantiate

    saved = torch.load(tiny_inverter, map_location="cpu", weights_only=True)

    def written(name: str, **lti) -> str:
        torch.save(dict(saved, lti={**saved["lti"], **lti}), tmp_path / name)
        return str(tmp_path / name)

    older = str(tmp_path / "older.ckpt")
    torch.save(dict(saved, lti={k: v for k, v in saved["lti"].items() if k not in ("inverter", "threat_model")}), older)
    with pytest.raises(ValueError, match="does not record its inverter and threat model"):
        LearnedInverter.from_checkpoint(older)
    # An older checkpoint loads into the inverter its config builds (what the audit does), predicting the same.
    module, _ = instantiate(TINY)
    threat = ThreatModel.from_config(TINY)
    old = LearnedInverter.from_checkpoint(older, threat, module.inverter)
    new = LearnedInverter.from_checkpoint(tiny_inverter, threat)
    features = torch.randn(2, threat.pipeline.spec.num_bins, generator=torch.Generator().manual_seed(0))
    assert torch.equal(old.predict(features), new.predict(features))
    with pytest.raises(ValueError, match="is not one of the workbench's"):
        LearnedInverter.from_checkpoint(written("foreign.ckpt", inverter={"class_path": "os.system", "init_args": {}}))
    content = dict(saved["lti"]["threat_model"], defense={"class_path": "subprocess.Popen", "init_args": {}})
    with pytest.raises(ValueError, match="names 'subprocess.Popen', not one of the workbench's classes"):
        LearnedInverter.from_checkpoint(written("foreign_threat.ckpt", threat_model=content))
    target = saved["lti"]["threat_model"]["target"]
    remote = dict(target, init_args={**target["init_args"], "config": {**target["init_args"]["config"],
                                                                      "trust_remote_code": True}})
    with pytest.raises(ValueError, match="trust_remote_code"):
        LearnedInverter.from_checkpoint(written("remote.ckpt", threat_model=dict(saved["lti"]["threat_model"],
                                                                                  target=remote)))
    # Another sequence length than the threat model's: refused, not read as more, shorter sequences.
    with pytest.raises(ValueError, match="sequences of 8 tokens; the threat model's are 4"):
        LearnedInverter.from_checkpoint(tiny_inverter, ThreatModel.from_config(TINY, {"seq_len": 4}))
    # A checkpoint of more than an inverter (a hybrid's evidence prior) is not silently cut down to it.
    hybrid = str(tmp_path / "hybrid.ckpt")
    torch.save(dict(saved, state_dict={**saved["state_dict"], "evidence_prior.weight": torch.zeros(1)}), hybrid)
    with pytest.raises(ValueError, match="holds more than an inverter"):
        LearnedInverter.from_checkpoint(hybrid)


@pytest.fixture(scope="module")
def tiny_pointer(tmp_path_factory):
    """A few steps of `lti candidates fit` on the tiny threat model's candidates: weights the audit can load."""
    from lti.cli import main

    folder = tmp_path_factory.mktemp("pointer")
    for split, limit in (("auxiliary", "64"), ("evaluation", "8")):
        main(["candidates", "build", "--config", TINY, "--split", split, "--limit", limit, "--count", "12",
              "--out", str(folder / f"{split}.safetensors")])
    main(["candidates", "fit", "--train", str(folder / "auxiliary.safetensors"), "--eval", str(folder / "evaluation.safetensors"),
          "--out_dir", str(folder / "fit"), "--max_steps", "4", "--val_every", "4", "--hidden", "16", "--layers", "1",
          "--heads", "2", "--batch_size", "16"])
    return str(folder / "fit" / "pointer.safetensors")


@pytest.mark.parametrize("decode", ["argmax", "lm", "second_layer"])
def test_the_candidate_pointer_attacks_every_round_and_is_probed_for_staleness(tiny_pointer, tmp_path, decode):
    options = AuditOptions(threat_model=TINY, out_dir=str(tmp_path / "a"), federation=FederationOptions(clients=2, rounds=2),
                           attacks=AttackOptions(dager=False, pointer=tiny_pointer, pointer_decode=decode, probe_sequences=6,
                                                 rounds=[2]),
                           utility_sequences=4)
    audit = Audit(options, say=lambda *_: None)
    records = audit.run()
    pointer = records[1]["attacks"]["pointer"]
    assert pointer["sequences"] == 2 and 0.0 <= pointer["token_acc"] <= 1.0
    assert records[1]["probe"]["pointer"]["sequences"] == 6 and "learned" not in records[1]["probe"]
    # The attack equals the pointer run by hand on the update the server read off Flower's arrays.
    from safetensors.torch import load_file

    from lti.audit.attacks import observed_update
    from lti.audit.federation import load_adapter_state

    folder = tmp_path / "a" / "rounds" / "r002"
    sent, replies = load_file(str(folder / "sent.safetensors")), load_file(str(folder / "replies.safetensors"))
    load_adapter_state(audit.server, sent)
    names = list(audit.server.names)
    update = observed_update(sent, {n: replies[f"c0/{n}"] for n in names}, options.federation.lr, names)
    by_hand = audit.attacks.pointer.predict(audit.server.split(update[None]))[0].tolist()
    truth = load_file(str(folder / "batches.safetensors"))["c0"][0].tolist()
    sample = pointer["samples"][0]
    assert sample["client"] == 0 and sample["reconstruction"] == audit.data.tokenizer.decode(by_hand)
    assert sample["reference"] == audit.data.tokenizer.decode(truth)
    report = (tmp_path / "a" / "report.md").read_text()
    assert "candidate pointer (span bag, learned order)" in report and f"decoded by {decode}" in report


def test_a_pointer_of_another_threat_model_is_refused(tiny_pointer, tmp_path):
    config = tmp_path / "rank4.yaml"
    config.write_text(Path(TINY).read_text().replace("rank: 8", "rank: 4"))
    options = AuditOptions(threat_model=str(config), out_dir=str(tmp_path / "a"), attacks=AttackOptions(pointer=tiny_pointer))
    with pytest.raises(ValueError, match="another threat model than the audit's"):
        Audit(options).run()
    assert not (tmp_path / "a").exists()
    # The same threat model from a copy of its config elsewhere is the same threat model.
    config.write_text(Path(TINY).read_text())
    audit = Audit(AuditOptions(threat_model=str(config), out_dir=str(tmp_path / "b"), attacks=AttackOptions(pointer=tiny_pointer)))
    audit._build()
    assert audit.attacks.pointer is not None


def test_clients_send_every_adapter_when_the_server_observes_a_subset():
    from datamodules.federated import ParameterSelection

    target = HFCausalLM(architecture="llama", config=dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=32))
    server = UpdatePipeline(target, client=LoRAClient(rank=4, target_modules=["q_proj", "v_proj"], init_b_std=0.02,
                                                      local=FedSGDClient("train", 1)),
                            observed=ParameterSelection(include=["*layers.0.*"]))
    assert all("layers.0." in name for name in server.names) and len(server.names) == 4
    clients = client_pipeline(server, 2)
    assert len(clients.names) == 8 and set(server.names) < set(clients.names)
    update = clients(random_data(0, 1), keep_update=True).update
    assert update.shape == (1, sum(p.numel() for n, p in clients.target.named_parameters() if ".lora_" in n))
    assert len(server.names) == 4  # the server's pipeline is left as it was


def test_the_report_goes_to_wandb_when_asked(tiny_audit, monkeypatch):
    """`--wandb true`: one W&B step per round with the report's numbers (W&B itself replaced by a recorder)."""
    import sys
    import types

    from lti.audit.report import write_report

    options, out, records = tiny_audit
    logged, inits = [], []

    class Run:
        def log(self, metrics):
            logged.append(metrics)

        def finish(self):
            logged.append("finished")

    fake = types.SimpleNamespace(init=lambda **kwargs: inits.append(kwargs) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    write_report(out, AuditOptions(**{**vars(options), "wandb": True}), records, None, 1.0)
    assert inits[0]["mode"] == "offline" and inits[0]["dir"] == str(out)
    assert [m["round"] for m in logged[:-1]] == [1, 2] and logged[-1] == "finished"
    assert logged[1]["dager/token_acc"] == records[1]["attacks"]["dager"]["token_acc"]
    assert logged[0]["utility/validation_loss"] == records[0]["utility_after"]


def test_a_server_that_observes_a_subset_federates_every_adapter_and_resumes_under_dp(tmp_path):
    """11 layers: safetensors' sorted keys ("layers.10" before "layers.2") differ from the model's order,
    which Flower's DP mods require; the server's inverter observes layer 0 only, the clients send all."""
    overlay = tmp_path / "subset.yaml"
    overlay.write_text("data:\n  target:\n    init_args:\n      config: {num_hidden_layers: 11, hidden_size: 32, "
                       "intermediate_size: 64, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 50257, "
                       "max_position_embeddings: 64}\n  observed:\n    class_path: datamodules.federated.ParameterSelection\n"
                       "    init_args: {include: ['*layers.0.*']}\n")
    options = AuditOptions(threat_model=TINY, threat_model_args=["--config", str(overlay)], out_dir=str(tmp_path / "a"),
                           federation=FederationOptions(clients=2, rounds=2, lr=0.5),
                           flower_dp=FlowerDPOptions(mode="local_dp", clipping_norm=1.0, epsilon=1e6),
                           attacks=AttackOptions(dager=False, probe_sequences=0), utility_sequences=4)
    first = Audit(options, say=lambda *_: None).run()
    from safetensors.torch import load_file

    replies = load_file(str(tmp_path / "a" / "rounds" / "r001" / "replies.safetensors"))
    assert sum(".lora_" in k and k.startswith("c0/") for k in replies) == 11 * 4  # every layer's q/v A and B
    import shutil

    shutil.rmtree(tmp_path / "a" / "rounds" / "r002")
    resumed = Audit(options, say=lambda *_: None).run()  # round 2 again, from round 1's aggregate, under LocalDpMod
    assert [r["round"] for r in resumed] == [1, 2] and resumed[0] == first[0]
    assert resumed[1]["utility_before"] == first[1]["utility_before"]


def test_a_rerun_with_other_attack_options_attacks_again(tiny_audit, tmp_path):
    import shutil

    options, out, records = tiny_audit
    copy = tmp_path / "audit"
    shutil.copytree(out, copy)
    again = Audit(AuditOptions(**{**vars(options), "out_dir": str(copy),
                                  "attacks": AttackOptions(dager=False, batched=False, probe_sequences=0)}),
                  say=lambda *_: None).run()
    assert all(r["attacks"] == {} for r in again)  # the stored scores are not reported as this run's
    files = sorted((copy / "rounds" / "r001").glob("attacks-*.json"))
    assert sorted(json.loads(f.read_text())["options"]["dager"] for f in files) == [False, True]  # side by side


@pytest.mark.parametrize("config", sorted(str(p) for p in (REPO / "configs" / "audit").glob("*.yaml")
                                          if p.read_text().startswith("threat_model:") or "\nthreat_model:" in p.read_text()))
def test_every_audit_config_parses_and_names_a_threat_model_that_parses(config, capsys):
    import yaml

    from lti.audit.cli import main as audit_main
    from lti.cli import main

    with pytest.raises(SystemExit) as exit_info:
        audit_main(["--config", config, "--print_config"])
    assert exit_info.value.code in (0, None)
    parsed = yaml.safe_load(capsys.readouterr().out)
    assert parsed["federation"]["clients"] >= 4 and parsed["federation"]["rounds"] >= 3
    if config.endswith("/smollm2_lora.yaml"):  # the default: a partial batched_search keeps the other defaults
        assert parsed["attacks"]["batched_search"] == {**dataclasses.asdict(BatchedOptions()), "extension_cache_gib": 1.0}
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / parsed["threat_model"]), "--print_config"])
    assert exit_info.value.code in (0, None)
    threat = yaml.safe_load(capsys.readouterr().out)
    assert threat["data"]["init_args"]["client"]["class_path"] == "datamodules.federated.LoRAClient"


def test_the_extension_cache_does_not_name_another_set_of_attack_scores(tmp_path):
    """Stored scores are kept per set of attack options; the batched attack's extension cache changes its speed
    only, so a rerun with it reads the scores already there. Its beam does name another set."""
    def key(**search):
        options = AuditOptions(threat_model=TINY, out_dir=str(tmp_path),
                               attacks=AttackOptions(batched_search=BatchedOptions(**search)))
        return Audit(options, say=lambda *_: None).attack_options()[1]

    assert key() == key(extension_cache_gib=2.0) != key(beam=2)


def test_no_time_budget_keeps_the_scores_of_audits_made_before_it_and_a_budget_names_another_set(tmp_path):
    """Without a budget the options hashed are those of audits made before the option existed (the key they stored
    their scores under); a budget names another set."""
    def chosen(**search):
        options = AuditOptions(threat_model=TINY, out_dir=str(tmp_path),
                               attacks=AttackOptions(batched_search=BatchedOptions(**search)))
        return Audit(options, say=lambda *_: None).attack_options()

    (plain, key), (budgeted_options, budgeted) = chosen(), chosen(time_budget=30.0)
    assert "time_budget" not in plain["batched_search"] and budgeted_options["batched_search"]["time_budget"] == 30.0
    assert key != budgeted


def test_the_report_states_the_batched_attacks_time_budget_when_there_is_one(tmp_path):
    def notes(**search):
        audit = Audit(AuditOptions(threat_model=TINY, out_dir=str(tmp_path / str(len(search))),
                                   federation=FederationOptions(clients=2, rounds=1),
                                   attacks=AttackOptions(dager=False, probe_sequences=0,
                                                         batched_search=BatchedOptions(**search)),
                                   utility_sequences=4), say=lambda *_: None)
        audit._build()
        return audit.notes

    assert not any("time budget" in note for note in notes())
    assert any("time budget: 12.5 s an update" in note for note in notes(time_budget=12.5))
