"""`lti audit`: run the Flower federation, record every round, attack the rounds asked for, write the report.

The run folder (`out_dir`) holds, per round r, `rounds/r{r:03d}/`:
- `sent.safetensors`: the global adapter weights the server sent; `replies.safetensors`: what each client
  returned, as Flower delivered it (`c{client}/{name}`); `after.safetensors`: the aggregate;
- `batches.safetensors`: the clients' true token ids (for scoring; client text stays in this folder);
- `round.json`: utility and DP figures; `attacks.json`: the attacks' scores (written last).
Every file is written to a temporary name and renamed, so a folder holds whole files only. A rerun with
the same options resumes: finished rounds are read back, the simulation continues from the last
aggregate, and only unattacked rounds are attacked.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from lti.atomic_files import atomic_writer, write_text_atomically
from lti.audit.options import AuditOptions

#: The options that fix what a run folder holds: a rerun with other values is refused, not mixed in.
RUN_KEYS = ("threat_model", "threat_model_args", "federation", "flower_dp")


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with atomic_writer(path) as file:
        file.write(save({k: v.contiguous() for k, v in tensors.items()}))


def _write_json(value, path: Path) -> None:
    write_text_atomically(path, json.dumps(value, indent=1, sort_keys=True) + "\n")


def client_ranges(total: int, clients: int) -> list[range]:
    """Consecutive, disjoint ranges of the evaluation split's samples, one per client: the split's
    documents lie in consecutive samples, so each client holds its own documents (a document may cross
    one boundary)."""
    if total < clients:
        raise ValueError(f"the evaluation split has {total} samples, fewer than federation.clients={clients}")
    edges = [round(i * total / clients) for i in range(clients + 1)]
    return [range(edges[i], edges[i + 1]) for i in range(clients)]


def client_batch_indices(own: range, batch_size: int, client: int, round_: int, seed: int) -> torch.Tensor:
    """The B samples client `client` trains on in round `round_` (drawn from its own, without repeats)."""
    if batch_size > len(own):
        raise ValueError(f"client {client} holds {len(own)} samples, fewer than federation.batch_size={batch_size}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + client * 10_007 + round_)
    return torch.tensor(own)[torch.randperm(len(own), generator=generator)[:batch_size]]


def flower_mods(options: AuditOptions) -> list:
    from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod

    dp = options.flower_dp
    if dp.mode == "local_dp":
        # Local DP: any two inputs of a client give clipped updates at most 2C apart (the sensitivity).
        return [LocalDpMod(dp.clipping_norm, 2 * dp.clipping_norm, dp.epsilon, dp.delta)]
    if dp.mode == "fixed_clipping":
        return [fixedclipping_mod]
    return []


def epsilon_after(options: AuditOptions, rounds: int) -> float | None:
    """The (epsilon, delta)-DP of a client's data after `rounds` rounds under Flower's DP, else None.

    local_dp: each round is an (epsilon, delta) Gaussian mechanism on the client's update; basic composition
    over the rounds it took part in (every round here). fixed_clipping: the noisy aggregate is a Gaussian
    mechanism with the noise multiplier over every client's clipped update (user-level), every client
    sampled every round; opacus's RDP accountant at `delta`. The server sees the clipped updates before the
    noise: this epsilon bounds what the *released model* leaks, not what the server reads.
    """
    dp = options.flower_dp
    if dp.mode == "local_dp":
        return dp.epsilon * rounds
    if dp.mode == "fixed_clipping":
        from opacus.accountants import RDPAccountant

        accountant = RDPAccountant()
        for _ in range(rounds):
            accountant.step(noise_multiplier=dp.noise_multiplier, sample_rate=1.0)
        return float(accountant.get_epsilon(dp.delta))
    return None


class Audit:
    """One audit run: built from `AuditOptions`, run with `run()`; returns the report's records."""

    def __init__(self, options: AuditOptions, say=None) -> None:
        options.check()
        self.options = options
        if say is None:
            from tqdm.auto import tqdm

            say = tqdm.write  # lines between the progress bars, not through them
        self.say = say
        self.out = Path(options.out_dir)
        self.rounds_dir = self.out / "rounds"

    # ---------------------------------------------------------------- set-up
    def _claim_folder(self) -> None:
        identity = {key: _plain(getattr(self.options, key)) for key in RUN_KEYS}
        marker = self.out / "audit.json"
        if marker.exists():
            previous = json.loads(marker.read_text())
            previous, current = _same_run(previous), _same_run(identity)
            if previous != current:
                changed = sorted(k for k in current if previous.get(k) != current[k])
                raise ValueError(f"{self.out} holds an audit with other {', '.join(changed)}; choose another out_dir")
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            _write_json(identity, marker)

    def _build(self) -> None:
        from exact.dager import local_step_offsets
        from lti.audit.attacks import LearnedInverter, PointerAttack, RoundAttacks
        from lti.audit.federation import client_pipeline
        from lti.trainer_cli import instantiate

        if not Path(self.options.threat_model).is_file():
            raise ValueError(f"threat_model {self.options.threat_model} is not a file")
        self.say(f"threat model: {self.options.threat_model}")
        module, data = instantiate(self.options.threat_model, list(self.options.threat_model_args))
        data.prepare_data()
        data.setup("validate")
        self.data = data
        self.server = data.pipeline
        fed = self.options.federation
        self.clients = client_pipeline(self.server, fed.batch_size, fed.local_epochs, fed.minibatch_size, fed.lr)
        if data.packing != "blocks":
            raise ValueError(f"the audit needs data.packing: blocks (every token real); the threat model has {data.packing!r}")
        eval_ids, _ = data.blocks("evaluation")
        self.client_ids = eval_ids
        self.ranges = client_ranges(eval_ids.shape[0], self.options.federation.clients)
        aux_ids, _ = data.blocks("auxiliary")
        self.utility_ids = aux_ids[: self.options.utility_sequences]
        learned = None
        self.notes: list[str] = []
        if self.options.attacks.checkpoint:
            learned = LearnedInverter(module, data, self.options.attacks.checkpoint)
            if learned.sequences != self.options.federation.batch_size:
                self.notes.append(f"The learned inverter was trained on updates of {learned.sequences} sequence(s); "
                                  f"the clients send {self.options.federation.batch_size}: it is not run on them.")
            if learned.sequences != 1:
                self.notes.append("The staleness probe simulates one-sequence updates; this inverter reads "
                                  f"{learned.sequences}: no probe.")
        pointer = None
        if self.options.attacks.pointer:
            pointer = PointerAttack(self.options.attacks.pointer, self.server, data.seq_len, self.options.threat_model,
                                    list(self.options.threat_model_args), self.options.attacks.pointer_decode,
                                    self.options.attacks.pointer_lm_weight, self.options.attacks.pointer_second_weight)
            if self.options.federation.batch_size != 1:
                self.notes.append(f"The candidate pointer reads updates of one sequence; the clients send "
                                  f"{self.options.federation.batch_size}: it runs on the staleness probe only.")
        if self.options.flower_dp.mode == "fixed_clipping":
            self.notes.append("Under fixed clipping the server reads every clipped update before Flower adds noise to "
                              "the aggregate: ε bounds what the released model leaks, not what the server reads.")
        if fed.local_steps() > 1:
            self.notes.append(f"The clients run FedAvg: {fed.local_steps()} local SGD steps (lr {fed.lr}) per round; the "
                              "server attacks their mean gradient (w - returned) / (steps * lr), DAGER also along the "
                              "clients' path. The staleness probe simulates the threat model's one-step updates.")
        self.attacks = RoundAttacks(self.server, lambda t: data.tokenizer.decode(t), data.seq_len,
                                    fed.lr, self.options.attacks.dager, learned, self.options.attacks.samples, pointer,
                                    self.clients.client.local_steps(), local_step_offsets(self.clients.client.local))
        # Spread over the whole split, so over every client's documents.
        probe = min(self.options.attacks.probe_sequences, eval_ids.shape[0])
        self.probe_ids = eval_ids[torch.linspace(0, eval_ids.shape[0] - 1, probe).long()] if probe else eval_ids[:0]
        self.probe_baseline: float | None = None
        if self.attacks.probed() and len(self.probe_ids):
            # What the probe's accuracy is read against: an attack that reads nothing and guesses each
            # position's most frequent token in the server's data.
            majority = data.majority_tokens[: self.probe_ids.shape[1]].to(self.probe_ids.device, self.probe_ids.dtype)
            self.probe_baseline = float((self.probe_ids == majority).float().mean())
            self.notes.append(f"Staleness probe: {len(self.probe_ids)} held-out sequences spread over the clients' "
                              f"documents; the per-position majority token of the server's data scores "
                              f"{100 * self.probe_baseline:.1f}% on them (the baseline of the probe column).")
        for note in self.notes:
            self.say(note)

    # ---------------------------------------------------------------- the federation
    def _round_dir(self, r: int) -> Path:
        return self.rounds_dir / f"r{r:03d}"

    def finished_rounds(self) -> int:
        """Rounds 1..n whose records are whole (n = 0: none)."""
        n = 0
        while (self._round_dir(n + 1) / "round.json").exists():
            n += 1
        return n

    def client_data(self, client: int, round_: int) -> dict[str, torch.Tensor]:
        b = self.options.federation.batch_size
        picked = client_batch_indices(self.ranges[client], b, client, round_, self.options.federation.seed)
        return {"input_ids": self.client_ids[picked][None]}

    @torch.no_grad()
    def utility(self, state: dict[str, torch.Tensor]) -> float:
        """Mean next-token loss of the global model (these adapters) on the server's utility sequences."""
        from datamodules.federated.protocols.base import model_mode
        from datamodules.targets.base import next_token_loss
        from lti.audit.federation import load_adapter_state

        load_adapter_state(self.server, state)
        target = self.server.target
        with model_mode(target, "eval"):
            # Every sequence has the same length: the mean of the per-sequence means is the per-token mean.
            losses = [next_token_loss(target(ids), ids) for ids in self.utility_ids.split(16)]
        return float(torch.cat(losses).mean())

    def simulate(self) -> None:
        """Run the Flower rounds not yet recorded, recording each round as it ends."""
        from flwr.app import ArrayRecord, MetricRecord
        from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping
        from tqdm.auto import tqdm

        from lti.audit.federation import ObservedFedAvg, SerialGrid, adapter_state, make_client_app

        fed = self.options.federation
        done = self.finished_rounds()
        if done >= fed.rounds:
            return
        if done == 0:
            initial = adapter_state(self.clients)  # every adapter the clients send, in their order
        else:
            saved = load_file(str(self._round_dir(done) / "after.safetensors"))
            # safetensors returns its keys sorted ("layers.10" before "layers.2"); Flower's DP mods refuse a
            # reply whose keys are not in the order they were sent: send them in the clients' order.
            initial = {name: saved[name] for name in self.clients.names}
            self.say(f"resuming after round {done}")
        replies: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        sent_by_round: dict[int, dict[str, torch.Tensor]] = {}

        def observe(round_: int, client: int, sent: ArrayRecord, reply: ArrayRecord) -> None:
            sent_by_round[round_] = sent.to_torch_state_dict()
            replies.setdefault(round_, {})[client] = reply.to_torch_state_dict()

        utilities: dict[int, float] = {}

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            absolute = server_round + done
            state = arrays.to_torch_state_dict()
            utilities[absolute] = self.utility(state)
            if server_round > 0:  # the round's aggregate: the round is whole, record it
                if absolute not in sent_by_round:
                    raise RuntimeError(f"round {absolute} was aggregated without the server seeing its client "
                                       "updates (a Flower strategy wrapper dropped them)")
                self._record_round(absolute, sent_by_round.pop(absolute), replies.pop(absolute), state,
                                   utilities[absolute - 1], utilities[absolute])
                bar.update(1)
            return MetricRecord({"validation-loss": utilities[absolute]})

        bar = tqdm(total=fed.rounds, initial=done, desc="federated rounds", unit="round")
        app = make_client_app(self.clients, self.client_data, fed.lr, flower_mods(self.options))
        grid = SerialGrid(app, fed.clients)
        strategy = ObservedFedAvg(observe, grid.node_to_client, round_offset=done,
                                  min_train_nodes=fed.clients, min_available_nodes=fed.clients)
        if self.options.flower_dp.mode == "fixed_clipping":
            dp = self.options.flower_dp
            strategy = DifferentialPrivacyClientSideFixedClipping(strategy, dp.noise_multiplier, dp.clipping_norm,
                                                                  num_sampled_clients=fed.clients)
        # Flower logs every message at INFO; the bar and the per-round line say what matters here.
        flower_logger = logging.getLogger("flwr")
        level = flower_logger.level
        flower_logger.setLevel(logging.WARNING)
        try:
            with grid.serving():
                strategy.start(grid=grid, initial_arrays=ArrayRecord(torch_state_dict=initial),
                               num_rounds=fed.rounds - done, evaluate_fn=evaluate)
        finally:
            flower_logger.setLevel(level)
            bar.close()

    def _record_round(self, r: int, sent: dict, replies: dict, after: dict, utility_before: float,
                      utility_after: float) -> None:
        folder = self._round_dir(r)
        folder.mkdir(parents=True, exist_ok=True)
        _save_tensors(sent, folder / "sent.safetensors")
        _save_tensors({f"c{c}/{name}": v for c, state in replies.items() for name, v in state.items()},
                      folder / "replies.safetensors")
        _save_tensors(after, folder / "after.safetensors")
        batches = {f"c{c}": self.client_data(c, r)["input_ids"][0] for c in replies}
        _save_tensors(batches, folder / "batches.safetensors")
        record = {"round": r, "clients": sorted(replies), "utility_before": utility_before,
                  "utility_after": utility_after, "epsilon": epsilon_after(self.options, r)}
        _write_json(record, folder / "round.json")
        self.say(f"round {r}: global model's validation loss {record['utility_after']:.4f}")

    # ---------------------------------------------------------------- the attacks
    def attack_rounds(self) -> None:
        from tqdm.auto import tqdm

        # A round is attacked again when the attack options differ from those its scores were computed with.
        chosen = _plain(self.options.attacks)
        chosen.pop("rounds", None)
        todo = []
        for r in self.options.attacked_rounds():
            path = self._round_dir(r) / "attacks.json"
            if not path.exists() or json.loads(path.read_text()).get("options") != chosen:
                todo.append(r)
        for r in tqdm(todo, desc="attacking rounds", unit="round", disable=not todo):
            folder = self._round_dir(r)
            sent = load_file(str(folder / "sent.safetensors"))
            flat = load_file(str(folder / "replies.safetensors"))
            replies: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in flat.items():
                client, name = key.split("/", 1)
                replies.setdefault(int(client[1:]), {})[name] = value
            batches = {int(k[1:]): v for k, v in load_file(str(folder / "batches.safetensors")).items()}
            start = time.perf_counter()
            results = self.attacks.attack(sent, replies, batches)
            probe = self.attacks.probe(sent, self.probe_ids) if len(self.probe_ids) else {}
            _write_json({"round": r, "options": chosen, "attacks": results, "probe": probe,
                         "seconds": time.perf_counter() - start}, folder / "attacks.json")

    def run(self) -> list[dict]:
        from lti.audit.report import write_report

        start = time.perf_counter()
        self._build()  # a threat model the audit cannot run is refused before anything is written
        self._claim_folder()
        self.simulate()
        self.attack_rounds()
        records = self.records()
        write_report(self.out, self.options, records, self.attacks.learned, time.perf_counter() - start, self.notes,
                     self.probe_baseline, self.attacks.pointer)
        return records

    def records(self) -> list[dict]:
        out, asked = [], set(self.options.attacked_rounds())
        for r in range(1, self.options.federation.rounds + 1):
            folder = self._round_dir(r)
            record = json.loads((folder / "round.json").read_text())
            attacks = folder / "attacks.json"
            attacked = attacks.exists() and r in asked
            record.update(json.loads(attacks.read_text()) if attacked else {"attacks": {}, "probe": {}})
            record.pop("options", None)
            if "token_acc" in (record.get("probe") or {}):  # a record of an audit before the pointer: the learned inverter's probe
                record["probe"] = {"learned": record["probe"]}
            out.append(record)
        return out


def _same_run(identity: dict) -> dict:
    """An audit's identity as compared for a resume: option groups completed with the defaults of options
    added since the folder was written (an older audit.json lacks them), a minibatch of None as all B."""
    from dataclasses import asdict

    from lti.audit.options import FederationOptions, FlowerDPOptions

    out = dict(identity)
    for key, defaults in (("federation", FederationOptions()), ("flower_dp", FlowerDPOptions())):
        if isinstance(out.get(key), dict):
            out[key] = {**asdict(defaults), **out[key]}
    federation = out.get("federation")
    if isinstance(federation, dict) and federation.get("minibatch_size") is None:
        federation["minibatch_size"] = federation.get("batch_size")
    return out


def _plain(value):
    from dataclasses import asdict, is_dataclass

    if is_dataclass(value):
        return asdict(value)
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)
