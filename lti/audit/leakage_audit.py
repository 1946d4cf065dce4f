"""`LeakageAudit`: a Flower strategy wrapper that reports what the server of *any* Flower app could read.

In the shape of Flower's DP wrappers (`DifferentialPrivacyClientSideFixedClipping(strategy, ...)`): it wraps any
message-API strategy (FedAvg, FedProx, FedAdam, a user's own), records the arrays each train message carries
to its node, and when the replies come back reads every client's update off the arrays it returned
(`ThreatModel.update_from_weights`), runs the attacks on it (`exact.interface.Attack`), writes the report and
hands the replies, untouched, to the wrapped strategy.

    strategy = LeakageAudit(FedAvg(), threat, [BatchedAttack(auxiliary_ids=blocks), DagerAttack()],
                            lr=0.05, out_dir="runs/leakage")
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=3)

The report folder (the user's choice; reconstructions are client text) holds `round-NNNN.json` per attacked
round, each update's reconstructions with their certificates and the SHA-256 of the arrays as received, and
`summary.json`. Scores against the clients' true sequences appear only when `truth(round, node_id)` supplies
them, as a simulation can; a real server has none. Files are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Message
from flwr.common.logger import log
from flwr.serverapp.strategy import Strategy

from datamodules.atomic_files import write_text_atomically
from datamodules.machine import describe_machine
from datamodules.metrics import ScoreTotals, score_batch
from datamodules.threat_model import ThreatModel
from exact.interface import Attack, reads, token_attacks
from lti.audit.observed import ObservedStrategy

#: truth(round, node id) -> (B, L) the client's true token ids, or None (a simulation's; a real server has none)
Truth = Callable[[int, int], torch.Tensor | None]


def arrays_digest(arrays: ArrayRecord) -> str:
    """SHA-256 over an ArrayRecord's names and bytes as Flower carries them (name, dtype, shape, data)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = arrays[name]
        digest.update(name.encode())
        digest.update(f"{array.dtype}{tuple(array.shape)}".encode())
        digest.update(array.data)
    return digest.hexdigest()


class LeakageAudit(ObservedStrategy):
    """Wraps `strategy`; every attacked round's client updates are read by `attacks` before aggregation.

    Args:
        strategy: The Flower strategy to wrap (message API); it aggregates as if unwrapped.
        threat_model: What the server knows: the global model, the clients' protocol and defense, the sequence
            length. Its observed parameters must be among the arrays the strategy sends, under the same names.
        attacks: The attacks each update is read by.
        lr: The clients' learning rate: a client returns w - lr * (its steps' summed gradients).
        out_dir: The report folder (client text ends up here).
        local_steps: Local SGD steps per client and round (1: FedSGD); the update read is their mean gradient.
        batch_size: Sequences per client update; None: each reply's `num-examples` metric.
        rounds: Rounds to attack (1-based); None: every round.
        truth: Scores against the clients' true sequences, where a simulation supplies them.
        arrays_key: The record key of the arrays in train messages and replies (Flower's default "arrays").
        overwrite: Replace an earlier report in `out_dir` (else refused: one folder, one run).
    """

    def __init__(self, strategy: Strategy, threat_model: ThreatModel, attacks: Sequence[Attack], *, lr: float,
                 out_dir: str | Path, local_steps: int = 1, batch_size: int | None = None,
                 rounds: Iterable[int] | None = None, truth: Truth | None = None, arrays_key: str = "arrays",
                 overwrite: bool = False) -> None:
        super().__init__(strategy, rounds=rounds, arrays_key=arrays_key)
        attacks = token_attacks(attacks, "LeakageAudit")
        if not lr > 0:
            raise ValueError(f"lr={lr} must be > 0")
        if local_steps < 1 or (batch_size is not None and batch_size < 1):
            raise ValueError("local_steps and batch_size must be >= 1")
        self.threat_model, self.attacks = threat_model, list(attacks)
        self.lr, self.local_steps, self.batch_size = float(lr), int(local_steps), batch_size
        self.truth = truth
        self.out_dir = Path(out_dir)
        earlier = sorted(self.out_dir.glob("round-*.json")) + sorted(self.out_dir.glob("summary.json"))
        if earlier and not overwrite:
            raise FileExistsError(f"{self.out_dir} already holds a leakage report ({earlier[0].name}); choose another "
                                  "out_dir or pass overwrite=True")
        for path in earlier:
            path.unlink()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._totals: dict[str, ScoreTotals] = {}
        self._counts: dict[str, dict[str, float]] = {}

    def __repr__(self) -> str:
        return f"LeakageAudit({self.strategy!r}, attacks={[a.name for a in self.attacks]})"

    def summary(self) -> None:
        log(INFO, "\t├── LeakageAudit: attacks %s, report in %s", [a.name for a in self.attacks], self.out_dir)
        self.strategy.summary()

    def observe_round(self, server_round: int, sent: dict[int, ArrayRecord], replies: list[Message]) -> None:
        threat = self.threat_model
        model = dict(threat.target.named_parameters())
        rows = []
        for reply in sorted(replies, key=lambda m: m.metadata.src_node_id):
            node = reply.metadata.src_node_id
            if reply.has_error() or node not in sent or self.arrays_key not in reply.content.array_records:
                rows.append({"node": node, "skipped": reply.error.reason if reply.has_error() else "no arrays"})
                continue
            returned_arrays = reply.content[self.arrays_key]
            sent_state = sent[node].to_torch_state_dict()
            returned = returned_arrays.to_torch_state_dict()
            threat.load_weights({name: value for name, value in sent_state.items() if name in model})
            update = threat.update_from_weights(sent_state, returned, self.lr, self.local_steps)
            batch = self.batch_size or _num_examples(reply)
            truth = self.truth(server_round, node) if self.truth is not None else None
            row = {"node": node, "batch_size": batch, "received_sha256": arrays_digest(returned_arrays), "attacks": {}}
            for attack in self.attacks:
                if not reads(attack, batch):
                    continue
                found = attack.attack(update, threat, batch)
                entry = found.to_dict(threat.decode)
                if truth is not None:
                    scores = score_batch(found.sequences, truth, None, threat.decode, found.certified_update)
                    self._totals.setdefault(attack.name, ScoreTotals()).add(scores)
                    entry["scores"] = {k: v for k, v in scores.items() if k != "pairs"}
                    entry["references"] = [threat.decode(s) for s in truth.tolist()]
                counts = self._counts.setdefault(attack.name, {"updates": 0, "certified_updates": 0, "seconds": 0.0})
                counts["updates"] += 1
                counts["certified_updates"] += int(found.certified_update)
                counts["seconds"] += found.seconds
                row["attacks"][attack.name] = entry
                log(INFO, "LeakageAudit: round %d, node %d, %s: %d sequences%s in %.1f s", server_round, node,
                    attack.name, len(found.sequences), ", certified" if found.certified_update else "", found.seconds)
            rows.append(row)
        report = {"round": server_round, "lr": self.lr, "local_steps": self.local_steps, "updates": rows}
        write_text_atomically(self.out_dir / f"round-{server_round:04d}.json", json.dumps(report, indent=1) + "\n")
        self._write_summary()

    def _threat_model_record(self) -> dict:
        """What the report was read under, by content: the threat model's config where it was built from one, and
        always what the server observed (parameters, shapes, the global model's fingerprint)."""
        threat = self.threat_model
        return {"config": _content_or_none(threat), "observed": threat.pipeline.spec.to_dict(),
                "seq_len": threat.seq_len, "client": threat.pipeline.client.describe(),
                "defense": threat.pipeline.defense.describe()}

    def _write_summary(self) -> None:
        summary = {"attacks": {}, "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "threat_model": self._threat_model_record(),
                   "machine": describe_machine(self.threat_model.pipeline.device)}
        for name, counts in self._counts.items():
            entry = {**counts, "seconds_per_update": counts["seconds"] / max(1, counts["updates"])}
            if name in self._totals:
                entry["scores"] = self._totals[name].means()
            summary["attacks"][name] = entry
        write_text_atomically(self.out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")


def _content_or_none(threat: ThreatModel) -> dict | None:
    try:
        return threat.to_dict()
    except ValueError:  # built from Python objects: no config content to store
        return None


def _num_examples(reply: Message) -> int:
    for record in reply.content.metric_records.values():
        if "num-examples" in record:
            return int(record["num-examples"])
    raise ValueError(f"node {reply.metadata.src_node_id}'s reply has no num-examples metric; give LeakageAudit a batch_size")
