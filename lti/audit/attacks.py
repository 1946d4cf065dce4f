"""The server's attacks on one round's client updates: DAGER, the learned inverter and the candidate
pointer, scored alike.

The server reads each client's update off the arrays Flower delivered: a client returned w - lr * u,
so u = (w - returned) / lr at the round's global weights w (computed in float64; the float32 rounding
of the returned weights stays in it, as it does for a real server). A FedAvg client of T local SGD
steps returned w - lr * (sum of its steps' gradients): u = (w - returned) / (T lr) is their mean, the
gradient the attacks read (DAGER also tests its second layer along the straight path of the steps). The attacks see only that update
and the round's global model; the clients' true sequences are used for scoring alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from datamodules.federated import UpdatePipeline
from datamodules.federated.hashing import HashSpec
from datamodules.metrics import ScoreTotals, score_batch
from datamodules.threat_model import ThreatModel, weight_update
from exact.interface import Attack, BatchedAttack, DagerAttack, Reconstruction, reads
from lti.audit.federation import load_adapter_state
from lti.checkpoint_files import load_checked


def observed_update(sent: dict[str, Tensor], returned: dict[str, Tensor], lr: float, names: list[str],
                    steps: int = 1) -> Tensor:
    """(D,) the client's update u in the pipeline's order, from the arrays sent and the arrays returned
    (the mean gradient of its `steps` local steps; `datamodules.threat_model.weight_update`)."""
    return weight_update(sent, returned, lr, names, steps)


@dataclass
class Tally:
    """One attack's scores over a round's updates (`ScoreTotals`), with the samples and DAGER's modes
    and diagnostics the report prints; `row()` gives the means."""

    totals: ScoreTotals = field(default_factory=ScoreTotals)
    samples: list[dict] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)
    diagnostics: dict[str, object] = field(default_factory=dict)

    def add(self, scores: dict, client: int, keep_sample: bool) -> None:
        self.totals.add(scores)
        if keep_sample:
            for reconstruction, reference in scores["pairs"]:
                self.samples.append({"client": client, "reference": reference, "reconstruction": reconstruction})

    def row(self) -> dict:
        return self.totals.means()


class LearnedInverter:
    """An `lti fit` inverter checkpoint as an attack, in plain PyTorch: `LearnedInverter.from_checkpoint(path)`
    rebuilds the inverter and its threat model from what the checkpoint stores by content (no config file,
    no DataModule); given a threat model, the checkpoint must have been trained on its observed updates."""

    name = "learned"

    def __init__(self, inverter: nn.Module, threat_model: ThreatModel, sequences: int, checkpoint: str,
                 setting: dict | None = None) -> None:
        self.inverter, self.threat_model = inverter.eval(), threat_model
        self.sequences, self.checkpoint, self.setting = sequences, checkpoint, setting or {}

    @classmethod
    def from_checkpoint(cls, path: str, threat_model: ThreatModel | None = None,
                        inverter: nn.Module | None = None) -> LearnedInverter:
        """The checkpoint's inverter, bound to `threat_model` (default: the one stored in the checkpoint; it is then
        trusted as a config file would be, within the workbench's own classes), loaded read-only (`weights_only`).
        `inverter`: the inverter to load the weights into for a checkpoint that does not record its own (written
        before checkpoints did; the caller builds it from the checkpoint's config)."""
        from datamodules.inversion_spec import InversionSpec

        saved = load_checked(path, lambda: torch.load(path, map_location="cpu", weights_only=True))
        record = saved.get("lti", {})
        if "hash_spec" not in record:
            raise ValueError(f"{path} has no hash spec: it was not written by this workbench")
        problem = record.get("problem", {})
        if "num_positions" not in problem or "vocab_size" not in problem:
            raise ValueError(f"{path} is not a text inverter's checkpoint (it records no positions and vocabulary)")
        if ("inverter" not in record and inverter is None) or (threat_model is None and "threat_model" not in record):
            raise ValueError(f"{path} does not record its inverter and threat model (written by an older lti fit): "
                             "train it again, or evaluate it with lti test --ckpt_path")
        stored = record.get("threat_model")
        if threat_model is None:
            _only_workbench_classes(stored, path)
            threat_model = ThreatModel.from_dict(stored)
        elif stored is not None and int(stored.get("seq_len", threat_model.seq_len)) != threat_model.seq_len:
            raise ValueError(f"{path} was trained on sequences of {stored['seq_len']} tokens; the threat model's are "
                             f"{threat_model.seq_len}")
        difference = threat_model.pipeline.spec.difference(HashSpec.from_dict(record["hash_spec"]))
        if difference:
            raise ValueError(f"{path} was trained under another threat model: {difference}")
        other = sorted({name.split(".")[0] for name in saved["state_dict"] if not name.startswith("inverter.")})
        if other:  # e.g. a hybrid's evidence prior: this attack would silently run without it
            raise ValueError(f"{path} holds more than an inverter ({', '.join(other)}): evaluate it with lti test")
        if "inverter" in record:
            inverter = inverter_from_record(record["inverter"])
        vocab, positions = int(problem["vocab_size"]), int(problem["num_positions"])
        if positions % threat_model.seq_len:
            raise ValueError(f"{path} reads {positions} positions, not a whole number of {threat_model.seq_len}-token "
                             "sequences")
        # The embedding is the global model's (not saved with the inverter); the token counts only set the
        # output bias's initial value, which the state dict replaces.
        inverter.bind(InversionSpec(int(problem["num_features"]), positions, vocab,
                                    threat_model.target.embedding_matrix.detach().cpu(), torch.zeros(vocab)))
        state = {name[len("inverter."):]: value for name, value in saved["state_dict"].items()}
        try:
            inverter.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise ValueError(f"{path} does not fit its inverter: {str(error).splitlines()[0]}") from None
        return cls(inverter, threat_model, positions // threat_model.seq_len, path, record.get("setting", {}))

    @torch.no_grad()
    def predict(self, features: Tensor) -> Tensor:
        """(U, k) hashed updates -> (U, m*L) token ids (argmax per slot)."""
        return self.inverter(features.float()).argmax(-1)

    def reads(self, batch_size: int) -> bool:
        return batch_size == self.sequences

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction:
        start = time.perf_counter()
        tokens = self.predict(threat_model.pipeline.hasher(update.reshape(1, -1)))[0].view(batch_size, -1).tolist()
        return Reconstruction(tokens, [False] * batch_size, seconds=time.perf_counter() - start)


def _only_workbench_classes(content, path: str) -> None:
    """Refuse a stored threat model that names classes outside the workbench's data side (a checkpoint is data:
    building it must not import or run other code)."""
    if isinstance(content, dict):
        class_path = content.get("class_path")
        if class_path is not None and not str(class_path).startswith("datamodules."):
            raise ValueError(f"{path}'s threat model names {class_path!r}, not one of the workbench's classes (datamodules.*)")
        for value in content.values():
            _only_workbench_classes(value, path)
    elif isinstance(content, list):
        for value in content:
            _only_workbench_classes(value, path)


def inverter_from_record(record: dict) -> nn.Module:
    """An inverter from its config ({class_path, init_args}, as a checkpoint records it); only the workbench's
    own inverter classes (lti.*) are imported, whatever the checkpoint names."""
    from jsonargparse import ArgumentParser

    from lti.inverters import Inverter

    class_path = str(record.get("class_path", ""))
    if not class_path.startswith("lti."):
        raise ValueError(f"the checkpoint's inverter {class_path!r} is not one of the workbench's (lti.*)")
    parser = ArgumentParser(exit_on_error=False, default_env=False)
    parser.add_argument("--inverter", type=Inverter)
    try:
        return parser.instantiate_classes(parser.parse_object({"inverter": record})).inverter
    except Exception as error:  # jsonargparse names the option and what it expected
        raise ValueError(f"the checkpoint's inverter: {str(error).splitlines()[0]}") from None


class PointerAttack:
    """An `lti candidates fit` pointer bound to the audit's threat model: the span test's candidates of
    each update (`exact.span_evidence.CandidateEvidence`), ordered by the pointer, decoded by `rule`."""

    def __init__(self, path: str, pipeline: UpdatePipeline, seq_len: int, threat_model: str, threat_model_args: list[str],
                 rule: str = "argmax", lm_weight: float = 0.5, second_weight: float = 1.0) -> None:
        from exact.span_evidence import CandidateEvidence, SecondLayerEvidence, SpanEvidence
        from lti.candidates.weights import load_pointer

        self.pointer, trained_on = load_pointer(path, pipeline.target.embedding_matrix)
        if int(trained_on.get("seq_len", -1)) != seq_len:
            raise ValueError(f"attacks.pointer {path} reads sequences of {trained_on.get('seq_len')} tokens; the audit's are {seq_len}")
        if "hash_spec" in trained_on:  # the observed parameters and the global model's weights, as checkpoints record them
            difference = pipeline.spec.difference(HashSpec.from_dict(json.loads(trained_on["hash_spec"])))
            if difference:
                raise ValueError(f"attacks.pointer {path} was trained on candidates of another threat model than the "
                                 f"audit's: {difference}")
        elif (Path(trained_on.get("config", "")).resolve() != Path(threat_model).resolve()
              or json.loads(trained_on.get("overrides", "[]")) != list(threat_model_args)):
            # candidate files written before they recorded the hash spec: the config they were built from
            raise ValueError(f"attacks.pointer {path} was trained on candidates of {trained_on.get('config')} "
                             f"{trained_on.get('overrides')}, not of the audit's threat model")
        evidence = SpanEvidence(pipeline.target, list(pipeline.names), seq_len, seq_len)
        self.candidates = CandidateEvidence(evidence, int(trained_on["count"]))
        self.second = SecondLayerEvidence(pipeline.target, list(pipeline.names), seq_len) if rule == "second_layer" else None
        self.pipeline, self.rule, self.lm_weight, self.second_weight, self.path = pipeline, rule, lm_weight, second_weight, path

    name = "pointer"

    def reads(self, batch_size: int) -> bool:
        return batch_size == 1

    def attack(self, update: Tensor, threat_model: ThreatModel, batch_size: int) -> Reconstruction:
        start = time.perf_counter()
        tokens = self.predict(threat_model.pipeline.split(update.reshape(1, -1))).tolist()
        return Reconstruction(tokens, [False] * len(tokens), seconds=time.perf_counter() - start)

    @torch.no_grad()
    def predict(self, update: dict[str, Tensor]) -> Tensor:
        """{name: (U, *shape)} one-sequence updates -> (U, L) token ids."""
        from lti.candidates.decoding import decode_candidates

        found = self.candidates(update)
        # The pointer trained on coefficients stored in float16: it reads them rounded alike.
        logits = self.pointer(found.ids, found.scores, found.coefficients.half().float())
        spaces = None if self.second is None else self.second.input_spaces(update)
        return decode_candidates(found.ids, logits, self.rule, self.pipeline.target.model, self.lm_weight, 8,
                                 self.second, spaces, self.second_weight)


class RoundAttacks:
    """Runs the chosen attacks (`exact.interface.Attack`s, in report order) on one round's updates with the server's
    pipeline at that round's weights, and scores them against the clients' true sequences."""

    def __init__(self, pipeline: UpdatePipeline, decode: Callable[[list[int]], str], seq_len: int, lr: float,
                 attacks: list[Attack], samples: int, steps: int = 1) -> None:
        self.pipeline, self.decode, self.seq_len, self.lr, self.steps = pipeline, decode, seq_len, lr, steps
        self.threat = ThreatModel.from_pipeline(pipeline, seq_len)
        self.attacks = list(attacks)
        self.learned = next((a for a in self.attacks if isinstance(a, LearnedInverter)), None)
        self.pointer = next((a for a in self.attacks if isinstance(a, PointerAttack)), None)
        self.samples = samples

    def attack(self, sent: dict[str, Tensor], replies: dict[int, dict[str, Tensor]],
               batches: dict[int, Tensor]) -> dict[str, dict]:
        """{attack: scores} over the clients' updates of a round. `batches[c]`: (B, L) true ids of client c."""
        from tqdm.auto import tqdm

        load_adapter_state(self.pipeline, sent)
        names = list(self.pipeline.names)
        tallies: dict[str, Tally] = {}
        seconds: dict[str, float] = {}
        # A batched update takes minutes on a CPU: a bar per update, under the audit's bar per round.
        for kept, client in enumerate(tqdm(sorted(replies), desc="attacking updates", unit="update", leave=False)):
            update = observed_update(sent, replies[client], self.lr, names, self.steps)
            ids = batches[client]
            for attack in self.attacks:
                if not reads(attack, ids.shape[0]):
                    continue
                found = attack.attack(update, self.threat, ids.shape[0])
                seconds[attack.name] = seconds.get(attack.name, 0.0) + found.seconds
                tally = tallies.setdefault(attack.name, Tally())
                tally.add(score_batch(found.sequences, ids, None, self.decode, found.certified_update), client,
                          kept < self.samples)
                _diagnose(tally, attack, found, ids)
        out = {}
        for name, tally in tallies.items():
            out[name] = {**tally.row(), "samples": tally.samples}
            if tally.modes:
                out[name]["modes"] = tally.modes
            for key, value in tally.diagnostics.items():
                out[name][key] = sorted(value) if isinstance(value, set) else value
            out[name]["seconds_per_update"] = seconds[name] / max(1, len(replies))
        return out

    def probed(self) -> dict[str, Callable]:
        """{name: predict(observed updates) -> (U, L) token ids} of the attacks the staleness probe runs:
        the learned ones that read one-sequence updates."""
        attacks = {}
        if self.learned is not None and self.learned.sequences == 1:
            attacks["learned"] = lambda observed: self.learned.predict(observed.features)
        if self.pointer is not None:
            attacks["pointer"] = lambda observed: self.pointer.predict(self.pipeline.split(observed.update))
        return attacks

    @torch.no_grad()
    def probe(self, sent: dict[str, Tensor], ids: Tensor, chunk: int = 32) -> dict[str, dict]:
        """The learned attacks on the updates the server simulates for `ids` (N, L) held-out sequences, one
        per update, at this round's global weights: their accuracy there, i.e. how stale they are.
        {"learned": scores, "pointer": scores}, each only where that attack runs."""
        attacks = self.probed()
        if not attacks:
            return {}
        load_adapter_state(self.pipeline, sent)
        tallies = {name: Tally() for name in attacks}
        for start in range(0, ids.shape[0], chunk):
            batch = ids[start : start + chunk]
            generator = torch.Generator().manual_seed(start)
            observed = self.pipeline({"input_ids": batch[:, None]}, generator=generator, keep_update="pointer" in attacks)
            for name, predict in attacks.items():
                for row, truth in zip(predict(observed).tolist(), batch):
                    tallies[name].add(score_batch([row], truth[None], None, self.decode), -1, False)
        return {name: tally.row() for name, tally in tallies.items()}


def _diagnose(tally: Tally, attack: Attack, found: Reconstruction, ids: Tensor) -> None:
    """What the report prints beside an exact attack's scores: how DAGER ran (strict span tests, the relaxed best
    effort, or not at all) and why; the batched attack's bag recall and refit residual."""
    diagnostics = found.diagnostics
    if isinstance(attack, DagerAttack):
        mode = str(diagnostics.get("mode", "strict"))
        tally.modes[mode] = tally.modes.get(mode, 0) + 1
        for key in ("rank1", "dim"):
            if key in diagnostics:
                tally.diagnostics.setdefault(key, []).append(diagnostics[key])
        if "reason" in diagnostics:
            tally.diagnostics.setdefault("reasons", set()).add(str(diagnostics["reason"]))
    elif isinstance(attack, BatchedAttack):
        visible = set(ids[:, :-1].flatten().tolist())
        bag = diagnostics["bag"]
        tally.diagnostics.setdefault("bag_recall", []).append(len(visible & set(bag)) / max(1, len(visible)))
        tally.diagnostics.setdefault("bag_size", []).append(len(bag))
        if diagnostics["residual"] is not None:
            tally.diagnostics.setdefault("residual", []).append(diagnostics["residual"])
        mode = "certified" if found.certified_update else "best effort"
        tally.modes[mode] = tally.modes.get(mode, 0) + 1
        if diagnostics.get("second_opinion") is not None:  # searched again: was the second result kept?
            tally.diagnostics.setdefault("second_opinion", []).append(bool(diagnostics["second_opinion"]))
        tally.diagnostics.setdefault("budget_reached", []).append(bool(diagnostics.get("budget_reached")))
