"""`LeakageAudit` wraps any Flower strategy: it reads byte for byte what the clients returned, its attacks score as
the audit's own do on the same updates, the wrapped strategy aggregates as if unwrapped, and its report is
refused over an earlier one."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord  # noqa: E402
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx  # noqa: E402
from test_audit import random_data, tiny_pipeline  # noqa: E402

from datamodules.machine import describe_machine  # noqa: E402
from datamodules.threat_model import ThreatModel  # noqa: E402
from exact.batched import BatchedOptions, SiteWhitening, adapter_sites  # noqa: E402
from exact.interface import BatchedAttack, DagerAttack  # noqa: E402
from lti.audit.attacks import RoundAttacks  # noqa: E402
from lti.audit.federation import SerialGrid, adapter_state, client_pipeline, make_client_app  # noqa: E402
from lti.audit.leakage_audit import LeakageAudit, arrays_digest  # noqa: E402

LR, CLIENTS = 0.05, 2
OPTIONS = BatchedOptions(beam=2, refine=1, label_candidates=4)


def run(pipeline, strategy, rounds=2):
    """Flower rounds of `strategy` over the serial grid: (what each client's code sent, the final arrays)."""
    sent = {}
    app = make_client_app(client_pipeline(pipeline, 2, lr=LR), random_data, LR,
                          sent=lambda c, r, arrays: sent.__setitem__((c, r), arrays))
    grid = SerialGrid(app, CLIENTS)
    with grid.serving():
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(torch_state_dict=adapter_state(pipeline)),
                                num_rounds=rounds)
    return sent, result.arrays.to_torch_state_dict(), grid


def whitening_of(pipeline) -> SiteWhitening:
    blocks = torch.randint(0, 97, (16, 6), generator=torch.Generator().manual_seed(5))
    return SiteWhitening.fit(pipeline.target, adapter_sites(list(pipeline.names)), blocks)


@pytest.mark.parametrize("make", [lambda: FedProx(proximal_mu=0.1, fraction_evaluate=0.0),
                                  lambda: FedAdam(fraction_evaluate=0.0)], ids=["FedProx", "FedAdam"])
def test_the_wrapper_reads_what_the_clients_sent_and_the_strategy_aggregates_as_if_unwrapped(make, tmp_path):
    pipeline = tiny_pipeline()
    _, unwrapped, _ = run(tiny_pipeline(), make())
    threat = ThreatModel.from_pipeline(pipeline, seq_len=6)
    audit = LeakageAudit(make(), threat, [DagerAttack()], lr=LR, out_dir=tmp_path / "report")
    sent, wrapped, grid = run(pipeline, audit)
    for name in unwrapped:
        assert torch.equal(unwrapped[name], wrapped[name])
    node_to_client = grid.node_to_client
    for round_ in (1, 2):
        report = json.loads((tmp_path / "report" / f"round-{round_:04d}.json").read_text())
        assert len(report["updates"]) == CLIENTS
        for row in report["updates"]:
            assert row["received_sha256"] == arrays_digest(sent[(node_to_client[row["node"]], round_)])
            assert row["batch_size"] == 2  # the replies' num-examples
            assert len(row["attacks"]["dager"]["sequences"]) <= 2 and "scores" not in row["attacks"]["dager"]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["attacks"]["dager"]["updates"] == 2 * CLIENTS
    # What the report was read under, by content (this threat model was built from Python objects: no config).
    assert summary["threat_model"]["config"] is None and summary["threat_model"]["seq_len"] == 6
    assert summary["threat_model"]["observed"] == threat.pipeline.spec.to_dict()
    assert summary["machine"] == describe_machine("cpu")  # what the seconds ran on


def test_the_wrappers_scores_equal_the_audits_round_attacks_on_the_same_updates(tmp_path, capsys, monkeypatch):
    """The same updates read through the wrapper (the `Attack` interface) and through the audit's `RoundAttacks`:
    the same reconstructions, so the same scores."""
    pipeline = tiny_pipeline()
    whitening = whitening_of(pipeline)
    threat = ThreatModel.from_pipeline(pipeline, seq_len=6)
    attacks = [DagerAttack(), BatchedAttack(OPTIONS, whitening=whitening)]
    seen = {}

    class Recording(FedAvg):  # what the wrapped strategy receives, to give the audit's path the same arrays
        def configure_train(self, server_round, arrays, config, grid):
            seen[("sent", server_round)] = arrays
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            seen[("replies", server_round)] = {m.metadata.src_node_id: m.content["arrays"] for m in replies}
            return super().aggregate_train(server_round, replies)

    audit = LeakageAudit(Recording(fraction_evaluate=0.0), threat, attacks, lr=LR, out_dir=tmp_path / "report",
                         truth=lambda round_, node: random_data(node - 1000, round_)["input_ids"][0])
    run(pipeline, audit, rounds=1)  # the serial grid numbers its nodes 1000 + client index
    report = json.loads((tmp_path / "report" / "round-0001.json").read_text())
    reference = RoundAttacks(pipeline, threat.decode, 6, LR, [DagerAttack(), BatchedAttack(OPTIONS, whitening=whitening)],
                             samples=0)
    sent = seen[("sent", 1)].to_torch_state_dict()
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # the bar is what is checked below
    for node, arrays in seen[("replies", 1)].items():
        ids = random_data(node - 1000, 1)["input_ids"][0]
        capsys.readouterr()
        expected = reference.attack(sent, {node: arrays.to_torch_state_dict()}, {node: ids})
        assert "attacking updates" in capsys.readouterr().err  # the bar per update
        row = next(r for r in report["updates"] if r["node"] == node)
        for name in ("dager", "batched"):
            got = row["attacks"][name]["scores"]
            assert got["correct"] / got["tokens"] == expected[name]["token_acc"]
            for key in ("rouge1", "rouge2", "exact_fraction"):
                assert got[key] == expected[name][key]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert set(summary["attacks"]) == {"dager", "batched"}
    assert 0.0 <= summary["attacks"]["batched"]["scores"]["token_acc"] <= 1.0


def test_the_wrapper_refuses_an_earlier_report_and_bad_arguments(tmp_path):
    threat = ThreatModel.from_pipeline(tiny_pipeline(), seq_len=6)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already holds a leakage report"):
        LeakageAudit(FedAvg(), threat, [DagerAttack()], lr=LR, out_dir=tmp_path)
    LeakageAudit(FedAvg(), threat, [DagerAttack()], lr=LR, out_dir=tmp_path, overwrite=True)
    assert not (tmp_path / "summary.json").exists()
    with pytest.raises(ValueError, match="at least one attack"):
        LeakageAudit(FedAvg(), threat, [], lr=LR, out_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="names must differ"):
        LeakageAudit(FedAvg(), threat, [DagerAttack(), DagerAttack()], lr=LR, out_dir=tmp_path / "b")
    from exact.interface import SpearAttack

    with pytest.raises(ValueError, match="recovers a layer's inputs, not tokens"):
        LeakageAudit(FedAvg(), threat, [SpearAttack("model.model.layers.0.mlp.up_proj")], lr=LR, out_dir=tmp_path / "d")
    with pytest.raises(ValueError, match="lr=0"):
        LeakageAudit(FedAvg(), threat, [DagerAttack()], lr=0, out_dir=tmp_path / "c")
