"""The example Flower app on Flower's Deployment Engine (a SuperLink and two SuperNodes on loopback, `flwr run`):
LeakageAudit read byte for byte what each client sent, and its reconstructions are those of the same attacks run
in this process on the same clients' updates."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from conftest import REPO  # noqa: E402

from datamodules.threat_model import weight_update  # noqa: E402
from lti.audit.leakage_audit import arrays_digest  # noqa: E402
from lti.audit.local_deployment import run_local_deployment  # noqa: E402

APP = REPO / "examples" / "flower_app"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    if shutil.which("flower-superlink") is None and not (Path(sys.executable).parent / "flower-superlink").exists():
        pytest.skip("Flower's SuperLink is not installed")
    tmp = tmp_path_factory.mktemp("deployment")
    config = {"report-dir": str(tmp / "report"), "truth-dir": str(tmp / "truth"), "num-server-rounds": 2}
    result = run_local_deployment(APP, config, [{"partition-id": i, "num-partitions": 2} for i in range(2)],
                                  timeout=600, workdir=tmp / "work", env={"PYTHONPATH": str(REPO)})
    assert result.ok, f"{result.status}: {result.run_info.get('status-details')}\n{result.logs[-3000:]}"
    return tmp, result


def test_the_wrapper_read_byte_for_byte_what_each_client_sent(deployment):
    tmp, _ = deployment
    for server_round in (1, 2):
        report = json.loads((tmp / "report" / f"round-{server_round:04d}.json").read_text())
        assert len(report["updates"]) == 2
        for row in report["updates"]:
            sent = json.loads((tmp / "truth" / f"round-{server_round}-node-{row['node']}.json").read_text())
            assert row["received_sha256"] == sent["sha256"]
            assert set(row["attacks"]) == {"batched", "dager"}
            assert row["attacks"]["batched"]["references"] is not None  # the test's truth reached the report


def test_its_reconstructions_are_the_same_attacks_run_in_process_on_the_same_updates(deployment):
    """Round 1 again in this process: the clients' step on their batches at the initial weights, the update read
    off the returned weights, the same attacks: the same sequences, and the same returned bytes."""
    tmp, _ = deployment
    sys.path.insert(0, str(APP))
    try:
        from flwr.app import ArrayRecord
        from leakage_app.client_app import local_step
        from leakage_app.server_app import attacks_for
        from leakage_app.text import threat_model
    finally:
        sys.path.remove(str(APP))
    threat = threat_model()
    initial = threat.weights()
    attacks = attacks_for(threat)
    report = json.loads((tmp / "report" / "round-0001.json").read_text())
    for row in report["updates"]:
        truth = json.loads((tmp / "truth" / f"round-1-node-{row['node']}.json").read_text())
        ids = torch.tensor(truth["ids"])
        returned = local_step(threat.target, initial, ids, 0.05)
        assert arrays_digest(ArrayRecord(torch_state_dict=returned)) == row["received_sha256"]
        threat.load_weights(initial)
        update = weight_update(initial, returned, 0.05, threat.names)
        for attack in attacks:
            assert attack.attack(update, threat, 2).sequences == row["attacks"][attack.name]["sequences"]
    summary = json.loads((tmp / "report" / "summary.json").read_text())
    assert summary["attacks"]["batched"]["updates"] == 4
    assert summary["threat_model"]["config"] == threat.to_dict()  # stored by content, not by the file's path
