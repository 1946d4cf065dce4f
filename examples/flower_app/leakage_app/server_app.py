"""The server: Flower's FedAvg, wrapped in LeakageAudit, which reads every client's update before aggregating."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from exact.batched import BatchedOptions
from exact.interface import BatchedAttack, DagerAttack
from leakage_app.text import blocks, threat_model
from lti.audit.leakage_audit import LeakageAudit

app = ServerApp()


def truth_from(folder: str):
    """Tests only: the clients' true sequences, from the files they wrote (a real server has none)."""
    if not folder:
        return None
    return lambda server_round, node: torch.tensor(
        json.loads((Path(folder) / f"round-{server_round}-node-{node}.json").read_text())["ids"])


def attacks_for(threat) -> list:
    """The server's attacks: the batched LoRA attack (whitened by the server's own text) and DAGER."""
    return [BatchedAttack(BatchedOptions(beam=2, refine=1), auxiliary_ids=blocks("auxiliary")[:256]), DagerAttack()]


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    threat = threat_model()
    attacks = attacks_for(threat)
    nodes = len(list(grid.get_node_ids()))
    strategy = LeakageAudit(FedAvg(fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes), threat,
                            attacks, lr=float(config["lr"]), batch_size=int(config["batch-size"]),
                            out_dir=str(config["report-dir"]), truth=truth_from(str(config["truth-dir"])))
    strategy.start(grid=grid, initial_arrays=ArrayRecord(torch_state_dict=threat.weights()),
                   num_rounds=int(config["num-server-rounds"]))
