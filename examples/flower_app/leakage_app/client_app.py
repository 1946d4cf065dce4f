"""The clients: one SGD step of their LoRA adapters on a batch of B sequences (plain PyTorch), new weights back."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from leakage_app.text import client_batch, threat_model

app = ClientApp()


def local_step(model: torch.nn.Module, global_state: dict[str, torch.Tensor], ids: torch.Tensor,
               lr: float) -> dict[str, torch.Tensor]:
    """One SGD step of the weights in `global_state` on the batch `ids` (B, L): the new weights, in float32."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in global_state.items():
            params[name].copy_(value)
    trained = [params[name].requires_grad_(True) for name in global_state]
    model.train()
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    grads = torch.autograd.grad(loss, trained)
    for param in trained:
        param.requires_grad_(False)
    return {name: (global_state[name] - lr * grad).float().contiguous() for name, grad in zip(global_state, grads)}


@app.train()
def train(msg: Message, context: Context) -> Message:
    global_state = msg.content["arrays"].to_torch_state_dict()
    config = context.run_config
    partition, partitions = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    server_round = int(msg.content["config"]["server-round"])
    ids = client_batch(partition, partitions, server_round, int(config["batch-size"]))
    # The global model with its LoRA adapters, as the config defines it.
    arrays = ArrayRecord(torch_state_dict=local_step(threat_model().target, global_state, ids, float(config["lr"])))
    if config["truth-dir"]:  # tests only: what this client sent and its true text, for scoring the server
        from lti.audit.leakage_audit import arrays_digest

        folder = Path(str(config["truth-dir"]))
        folder.mkdir(parents=True, exist_ok=True)
        record = {"node": context.node_id, "round": server_round, "partition": partition, "ids": ids.tolist(),
                  "sha256": arrays_digest(arrays)}
        (folder / f"round-{server_round}-node-{context.node_id}.json").write_text(json.dumps(record))
    metrics = MetricRecord({"num-examples": int(ids.shape[0])})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)
