"""`lti audit`: run the Flower federation, record every round, attack the rounds asked for, write the report.

The run folder (`out_dir`) holds, per round r, `rounds/r{r:03d}/`:
- `sent.safetensors`: the global adapter weights the server sent; `replies.safetensors`: what each client
  returned, as Flower delivered it (`c{client}/{name}`); `after.safetensors`: the aggregate;
- `batches.safetensors`: the clients' true token ids (for scoring; client text stays in this folder);
- `round.json`: utility and DP figures and the files' checksums; `attacks-<hash>.json`: the attacks' scores
  under one set of attack options (written last).
Every file is written to a temporary name and renamed, so a folder holds whole files only. A rerun with
the same options resumes: finished rounds are read back, the simulation continues from the last
aggregate, and only unattacked rounds are attacked.

What the folder holds is proven (`lti.audit.folder`): `audit.json` records the threat model's resolved
content and the hashes of its model and client data, and a rerun with another threat model, federation or
Flower DP is refused naming the first setting that differs; `--federation.rounds` may grow (the rounds
are added) or shrink (the report shows the first rounds). `round.json` records the sha256 of the round's
files, checked whenever they are read. The attacks' scores of each set of attack options are a file of
their own, `attacks-<hash of the options>.json`: a rerun with other options adds its scores beside the
earlier ones. One audit at a time writes the folder (the lock `lti fit` takes on its checkpoint folders),
and a start that fails before its first round leaves the folder as it was. The corpus' copies of the
clients' text (`$LTI_TEXT_CACHE_DIR`) go to `corpus_cache/` in the folder; the batched attack's whitening
statistics to `whitening/`, one file per model and auxiliary blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save

from datamodules.atomic_files import atomic_writer, orphaned_temp_files, write_text_atomically
from datamodules.machine import describe_machine
from lti.audit.folder import (
    canonical_sha256,
    compared_content,
    first_difference,
    plain,
    read_json,
    read_tensors,
    tensors_sha256,
)
from lti.audit.options import AuditOptions

#: `audit.json`'s format: 2 records the threat model's content and hashes.
FOLDER_FORMAT = 2
#: The folder under out_dir for the corpus' copies of the clients' text (`$LTI_TEXT_CACHE_DIR`).
TEXT_CACHE = "corpus_cache"
#: The batched attack's whitening statistics (server data: the global model's inputs on its auxiliary text),
#: one file per model and auxiliary blocks, so a rerun or a resumed audit does not compute them again.
WHITENING = "whitening"
#: The round files written with a checksum, in the order they are written.
ROUND_FILES = ("sent.safetensors", "replies.safetensors", "after.safetensors", "batches.safetensors")


class FolderNotWritable(ValueError):
    """`--out_dir` cannot be written (read-only, no permission): the command cannot run as given."""


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> str:
    """Writes the file atomically; returns its sha256."""
    data = save({k: v.contiguous() for k, v in tensors.items()})
    with atomic_writer(path) as file:
        file.write(data)
    return hashlib.sha256(data).hexdigest()


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
    def _identity(self) -> dict:
        """What this audit's folder must hold (`audit.json`): the threat model by content and hashes, the
        federation without its round count, Flower's DP."""
        federation = plain(self.options.federation)
        federation.pop("rounds")
        return {"format": FOLDER_FORMAT, "threat_model": self.options.threat_model,
                "threat_model_args": list(self.options.threat_model_args),
                "threat_model_content": self.content, "threat_model_sha256": canonical_sha256(compared_content(self.content)),
                "model_sha256": self.model_sha256, "client_data_sha256": self.client_data_sha256,
                "federation": federation, "flower_dp": plain(self.options.flower_dp)}

    def _claim_folder(self) -> None:
        identity = self._identity()
        marker = self.out / "audit.json"
        if not marker.exists():
            _write_json(identity, marker)
            return
        previous = read_json(marker, "it records which audit the folder's rounds belong to: choose another --out_dir, "
                                     "or delete it to take the folder's rounds as this audit's")
        if self.finished_rounds() == 0:  # a start that failed (before this version cleaned up): nothing to mix
            if _difference(previous, identity):
                self.say(f"note: {marker} belonged to a start that recorded no round; replaced by this audit's")
            _write_json(identity, marker)
            return
        difference = _difference(previous, identity)
        if difference:
            raise ValueError(f"{self.out} holds an audit of {difference}; choose another --out_dir")
        if "threat_model_content" not in previous:
            _write_json({**previous, **identity}, marker)
            self.say(f"note: {marker} was written before audit folders recorded the threat model's content; its "
                     "path, options and federation match this run's: the content of this run is recorded now")

    def _remove_orphans(self) -> None:
        """The temporary files of writes that a killed audit left (`datamodules.atomic_files`)."""
        folders = [self.out, *sorted(self.rounds_dir.glob("r*"))] if self.rounds_dir.is_dir() else [self.out]
        orphans = [orphan for folder in folders for orphan in orphaned_temp_files(folder)]
        for orphan in orphans:
            orphan.unlink(missing_ok=True)
        if orphans:
            self.say(f"note: removed {len(orphans)} partial file(s) that an interrupted audit left in {self.out}")

    def _build(self) -> None:
        from exact.dager import Dager, local_step_offsets
        from exact.interface import DagerAttack
        from lti.audit.attacks import LearnedInverter, PointerAttack, RoundAttacks
        from lti.audit.federation import client_pipeline
        from lti.audit.folder import instantiate_with_config

        if not Path(self.options.threat_model).is_file():
            raise ValueError(f"threat_model {self.options.threat_model} is not a file")
        self.say(f"threat model: {self.options.threat_model}")
        module, data, self.content = instantiate_with_config(self.options.threat_model, list(self.options.threat_model_args))
        data.prepare_data()
        data.setup("validate")
        self.data = data
        self.server = data.pipeline
        # The target model's weights with the LoRA adapters every client starts from (before any round).
        self.model_sha256 = tensors_sha256(self.server.target.state_dict().items())
        fed = self.options.federation
        self.clients = client_pipeline(self.server, fed.batch_size, fed.local_epochs, fed.minibatch_size, fed.lr)
        if data.packing != "blocks":
            raise ValueError(f"the audit needs data.packing: blocks (every token real); the threat model has {data.packing!r}")
        eval_ids, _ = data.blocks("evaluation")
        self.client_ids = eval_ids
        self.ranges = client_ranges(eval_ids.shape[0], self.options.federation.clients)
        aux_ids, _ = data.blocks("auxiliary")
        self.utility_ids = aux_ids[: self.options.utility_sequences]
        self.client_data_sha256 = tensors_sha256([("evaluation", eval_ids), ("utility", self.utility_ids)])
        learned = None
        self.notes: list[str] = []
        if self.options.attacks.checkpoint:
            learned = LearnedInverter.from_checkpoint(self.options.attacks.checkpoint, data.threat_model, module.inverter)
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
        # In the report's order. DAGER also tests its second layer along a FedAvg client's path of local steps.
        dager = Dager(**{f.name: getattr(self.options.attacks.dager_search, f.name)
                         for f in dataclasses.fields(self.options.attacks.dager_search)})
        attacks = ([DagerAttack(dager, trajectory=local_step_offsets(self.clients.client.local))]
                   if self.options.attacks.dager else [])
        if self.options.attacks.batched:
            attacks.append(self._batched_attack(aux_ids))
        attacks += [attack for attack in (learned, pointer) if attack is not None]
        self.attacks = RoundAttacks(self.server, lambda t: data.tokenizer.decode(t), data.seq_len, fed.lr, attacks,
                                    self.options.attacks.samples, self.clients.client.local_steps())
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

    def _batched_attack(self, aux_ids: torch.Tensor):
        """The batched LoRA attack, its whitening computed on the server's auxiliary text (cached in the run
        folder: server data only, keyed by the global model's fingerprint)."""
        from datamodules.federated.pipeline import target_fingerprint
        from exact.batched import SiteWhitening, adapter_sites
        from exact.interface import BatchedAttack

        attacks = self.options.attacks
        sites = adapter_sites(list(self.server.names))
        blocks = aux_ids[: attacks.whitening_blocks]
        fingerprint = target_fingerprint(self.server.target)
        path = self.out / WHITENING / f"{SiteWhitening.key(fingerprint, sites, blocks)}.safetensors"
        whitening = SiteWhitening.load_or_fit(path, self.server.target, sites, blocks, fingerprint, say=self.say)
        options, weights = attacks.batched_search, None
        if attacks.batched_scorer is not None:
            from exact.batched.scorer import ScorerWeights

            try:
                weights = ScorerWeights.load(attacks.batched_scorer, fingerprint, len(sites),
                                             self.options.federation.batch_size)
            except ValueError as error:  # e.g. the default config's scorer under another rank or model
                raise ValueError(f"attacks.batched_scorer: {error}; pass --attacks.batched_scorer null (or fit one in "
                                 "the audit: --attacks.batched_scorer null --attacks.batched_scorer_updates 8)") from None
        elif attacks.batched_scorer_updates > 0 and self.options.federation.local_steps() == 1:
            weights = self._fit_scorer(whitening, sites, aux_ids[attacks.whitening_blocks :], fingerprint)
        scorer = second = None
        if weights is not None:
            from exact.batched.scorer import describe_batch_sizes

            source = (f"{attacks.batched_scorer}" + (f", its weights fitted on updates of "
                                                     f"{describe_batch_sizes(weights.batch_sizes)}" if weights.batch_sizes else "")
                      if attacks.batched_scorer else
                      f"fitted on {attacks.batched_scorer_updates} updates of B = {self.options.federation.batch_size} "
                      "simulated from the server's auxiliary text")
            if attacks.batched_scorer_role == "replace":
                self.notes.append(f"The batched attack scores extensions with a learned scorer ({source}): one weight "
                                  f"per adapted layer and {weights.lm:.2f} for the global model's prior.")
                scorer = (weights.sites, weights.lm)
            else:
                self.notes.append(f"The batched attack searches again with a learned scorer ({source}) where the "
                                  f"refit residual of its hand-set search is above {options.second_opinion_above}, "
                                  "and keeps the result of lower residual.")
                second = (weights.sites, weights.lm)
        if options.time_budget is not None:
            self.notes.append(f"The batched attack's time budget: {options.time_budget:g} s an update, after which it "
                              "starts no further refinement pass, regrowth, restart or second search (the step in "
                              "progress and the refit finish); 'how it ran' says on how many updates it was reached.")
        # The least-squares check refits a FedSGD update by the sequences' own updates; a FedAvg client's mean
        # gradient along its path is not such a combination.
        return BatchedAttack(options, whitening=whitening, scorer=scorer, second_opinion=second,
                             check=self.options.federation.local_steps() == 1)

    def _fit_scorer(self, whitening, sites, blocks: torch.Tensor, fingerprint: str):
        """The batched search's learned scorer, fitted on updates of the clients' B the server simulates from its
        auxiliary blocks (cached in the run folder beside the whitening, keyed by what it was fitted on)."""
        from exact.batched.scorer import ScorerWeights, fit_scorer

        attacks, batch = self.options.attacks, self.options.federation.batch_size
        count = min(attacks.batched_scorer_updates * batch, blocks.shape[0])
        if count < batch:
            self.notes.append(f"The batched attack's learned scorer needs {batch} auxiliary blocks beyond the "
                              f"whitening's {attacks.whitening_blocks}; the server has {blocks.shape[0]}: every site "
                              "weighs 1.")
            return None
        blocks = blocks[:count]
        digest = hashlib.sha256(json.dumps([fingerprint, batch, attacks.batched_search.lm_weight,
                                            attacks.batched_search.picks_per_sequence, len(sites)]).encode())
        digest.update(blocks.cpu().contiguous().numpy().tobytes())
        path = self.out / WHITENING / f"scorer-{digest.hexdigest()[:24]}.safetensors"
        if path.exists():
            return ScorerWeights.load(path, fingerprint, len(sites))

        def observe(ids: torch.Tensor) -> dict[str, torch.Tensor]:
            gradient = self.clients({"input_ids": ids[None]}, keep_update=True).update
            by_name = self.clients.split(gradient)
            return {name: by_name[name][0].double() for name in self.server.names}

        start = ScorerWeights.hand_set(len(sites), attacks.batched_search.lm_weight)
        start.fingerprint = fingerprint
        weights = fit_scorer(self.server.target, sites, whitening, observe, blocks, batch, attacks.batched_scorer_updates,
                             start, attacks.batched_search.picks_per_sequence, say=self.say)
        weights.save(path)
        return weights

    # ---------------------------------------------------------------- the federation
    def _round_dir(self, r: int) -> Path:
        return self.rounds_dir / f"r{r:03d}"

    def finished_rounds(self) -> int:
        """Rounds 1..n whose records are whole (n = 0: none)."""
        n = 0
        while (self._round_dir(n + 1) / "round.json").exists():
            n += 1
        return n

    def _fix(self, r: int) -> str:
        return f"delete the folder {self._round_dir(r)} to run round {r} (and the rounds after it) again"

    def round_record(self, r: int) -> dict:
        return read_json(self._round_dir(r) / "round.json", self._fix(r))

    def round_file(self, r: int, name: str) -> dict[str, torch.Tensor]:
        """One of round r's tensor files, checked against the checksum its round.json recorded (a round
        recorded before checksums existed is read unchecked, said once)."""
        sums = self.round_record(r).get("sha256")
        if sums is None and not getattr(self, "_said_unchecked", False):
            self._said_unchecked = True
            self.say(f"warning: the rounds in {self.rounds_dir} were recorded without checksums (an older version): "
                     "their files are read unchecked")
        return read_tensors(self._round_dir(r) / name, None if sums is None else sums.get(name), self._fix(r))

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

        from lti.audit.federation import SerialGrid, adapter_state, make_client_app, observed_fedavg

        fed = self.options.federation
        done = self.finished_rounds()
        if done >= fed.rounds:
            return
        # Rounds recorded after the first missing or unfinished one belong to another sequence of global
        # models: they are run again from round done + 1, never kept beside (or continued from).
        later = sorted(p for p in self.rounds_dir.glob("r*") if p.is_dir() and p.name[1:].isdigit() and int(p.name[1:]) > done)
        for folder in later:
            shutil.rmtree(folder)
        if later and any(p.name != f"r{done + 1:03d}" for p in later):
            self.say(f"note: removed {', '.join(p.name for p in later)} from {self.rounds_dir}: recorded after round "
                     f"{done + 1}, which is missing or unfinished and runs again")
        if done == 0:
            initial = adapter_state(self.clients)  # every adapter the clients send, in their order
        else:
            saved = self.round_file(done, "after.safetensors")
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
        strategy = observed_fedavg(observe, grid.node_to_client, round_offset=done,
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
        tensors = {
            "sent.safetensors": sent,
            "replies.safetensors": {f"c{c}/{name}": v for c, state in replies.items() for name, v in state.items()},
            "after.safetensors": after,
            "batches.safetensors": {f"c{c}": self.client_data(c, r)["input_ids"][0] for c in replies},
        }
        sums = {name: _save_tensors(tensors[name], folder / name) for name in ROUND_FILES}
        record = {"round": r, "clients": sorted(replies), "utility_before": utility_before,
                  "utility_after": utility_after, "epsilon": epsilon_after(self.options, r), "sha256": sums}
        _write_json(record, folder / "round.json")  # last: the round is whole once it exists
        self.say(f"round {r}: global model's validation loss {record['utility_after']:.4f}")

    # ---------------------------------------------------------------- the attacks
    def attack_options(self) -> tuple[dict, str]:
        """The attack options a round's scores depend on (all but `rounds`, and the batched attack's extension
        cache, which changes its speed only) and their short hash, which names the scores' file:
        `attacks-<hash>.json`. The batched attack's time budget names another set only when there is one, so the
        scores of audits made before it existed are read as they are."""
        chosen = plain(self.options.attacks)
        chosen.pop("rounds", None)
        search = chosen.get("batched_search", {})
        search.pop("extension_cache_gib", None)
        if search.get("time_budget", 0) is None:
            search.pop("time_budget")
        return chosen, canonical_sha256(chosen)[:12]

    def stored_attacks(self, r: int) -> dict | None:
        """Round r's scores under the current attack options, or None (not attacked with them). A round
        attacked before the scores were kept per option set has them in `attacks.json`, used when its options match."""
        chosen, key = self.attack_options()
        fix = "delete it to attack the round again"
        path = self._round_dir(r) / f"attacks-{key}.json"
        if path.exists():
            return read_json(path, fix)
        legacy = self._round_dir(r) / "attacks.json"
        if legacy.exists():
            stored = read_json(legacy, fix)
            if stored.get("options") == chosen:
                return stored
        return None

    def attack_rounds(self) -> None:
        from tqdm.auto import tqdm

        chosen, key = self.attack_options()
        todo = [r for r in self.options.attacked_rounds() if self.stored_attacks(r) is None]
        for r in tqdm(todo, desc="attacking rounds", unit="round", disable=not todo):
            folder = self._round_dir(r)
            sent = self.round_file(r, "sent.safetensors")
            flat = self.round_file(r, "replies.safetensors")
            replies: dict[int, dict[str, torch.Tensor]] = {}
            for name, value in flat.items():
                client, parameter = name.split("/", 1)
                replies.setdefault(int(client[1:]), {})[parameter] = value
            batches = {int(k[1:]): v for k, v in self.round_file(r, "batches.safetensors").items()}
            start = time.perf_counter()
            results = self.attacks.attack(sent, replies, batches)
            probe = self.attacks.probe(sent, self.probe_ids) if len(self.probe_ids) else {}
            # A file per set of attack options: scores under other options stay as they were.
            _write_json({"round": r, "options": chosen, "attacks": results, "probe": probe,
                         "seconds": time.perf_counter() - start,
                         "machine": describe_machine(self.server.device)},
                        folder / f"attacks-{key}.json")

    def run(self) -> list[dict]:
        """Claims the folder (its lock, then its identity), runs the rounds not recorded, attacks the rounds
        not attacked with these options, writes the report. A start that fails before a round is recorded
        leaves the folder as it was."""
        from lti.checkpoint_folder import lock

        start = time.perf_counter()
        created = not self.out.exists()
        present = {name: (self.out / name).exists() for name in ("audit.json", "rounds", TEXT_CACHE, WHITENING)}
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            claim = lock(self.out, _in_use_message)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise FolderNotWritable(f"out_dir {self.out} cannot be written ({error.strerror}); choose another "
                                        "--out_dir") from None
            raise
        for note in claim.notes:
            self.say(note)
        environment = _point_caches(self.out)
        started = False
        try:
            self._remove_orphans()
            self._build()  # a threat model the audit cannot run is refused before anything is recorded
            self._claim_folder()
            self.simulate()
            started = True
            self.attack_rounds()
            records = self.records()
            self._report(records, time.perf_counter() - start)
            return records
        finally:
            _restore(environment)
            claim.release()
            if not started and self.finished_rounds() == 0:
                self._leave_as_found(created, present)

    def _leave_as_found(self, created: bool, present: dict[str, bool]) -> None:
        """Undo a start that recorded no round: a folder this run created is removed, otherwise what it added."""
        with contextlib.suppress(OSError):
            if created:
                shutil.rmtree(self.out)
                return
            for name, existed in present.items():
                path = self.out / name
                if not existed and path.is_dir():
                    shutil.rmtree(path)
                elif not existed:
                    path.unlink(missing_ok=True)

    def _report(self, records: list[dict], seconds: float) -> None:
        from datamodules.federated.protocols.lora import adapted_modules
        from lti.audit.report import write_report

        notes = list(self.notes)
        held = self.finished_rounds()
        if held > self.options.federation.rounds:
            notes.append(f"The folder holds {held} rounds; this report shows rounds 1–{self.options.federation.rounds} "
                         f"(--federation.rounds {self.options.federation.rounds}); a rerun with --federation.rounds "
                         f"{held} reports them all.")
            self.say(notes[-1])
        shape = {"L": self.data.seq_len, "lora_rank": self.server.client.rank,
                 "lora_modules": adapted_modules(self.clients.names)}
        write_report(self.out, self.options, records, self.attacks.learned, seconds, notes, self.probe_baseline,
                     self.attacks.pointer, shape, describe_machine(self.server.device))

    def records(self) -> list[dict]:
        out, asked = [], set(self.options.attacked_rounds())
        for r in range(1, self.options.federation.rounds + 1):
            record = self.round_record(r)
            record.pop("sha256", None)
            stored = self.stored_attacks(r) if r in asked else None
            record.update(stored if stored is not None else {"attacks": {}, "probe": {}})
            record.pop("options", None)
            if "token_acc" in (record.get("probe") or {}):  # a record of an audit before the pointer: the learned inverter's probe
                record["probe"] = {"learned": record["probe"]}
            out.append(record)
        return out


def _in_use_message(folder: Path, pid: int | None, host: str | None) -> str:
    from lti.checkpoint_folder import describe_owner

    return (f"audit folder {folder} is in use by {describe_owner(pid, host)}, a live `lti audit`; wait for it, "
            "or write elsewhere with --out_dir DIR")


#: Environment variables the audit sets for its run (unless the user did): where the corpus keeps copies of
#: the clients' text, and W&B's staging and cache folders.
_CACHES = {"LTI_TEXT_CACHE_DIR": TEXT_CACHE, "WANDB_DATA_DIR": "wandb", "WANDB_CACHE_DIR": "wandb/cache"}


def _point_caches(out: Path) -> dict[str, str | None]:
    environment = {variable: os.environ.get(variable) for variable in _CACHES}
    for variable, sub in _CACHES.items():
        if not os.environ.get(variable):
            os.environ[variable] = str((out / sub).absolute())
    return environment


def _restore(environment: dict[str, str | None]) -> None:
    for variable, value in environment.items():
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value


def _difference(previous: dict, current: dict) -> str | None:
    """What differs between the audit a folder holds (its `audit.json`) and this one, in words, or None.
    An older `audit.json` (no threat model content) is compared by the threat model's path and options."""
    if "threat_model_content" in previous:
        said = first_difference(compared_content(previous["threat_model_content"]), compared_content(current["threat_model_content"]))
        if said:
            return f"another threat model: {said}"
        for key, what in (("model_sha256", "the target model's weights or its initial LoRA adapters"),
                          ("client_data_sha256", "the clients' token ids (a corpus file changed?)")):
            if previous.get(key) != current[key]:
                return (f"another threat model: {what} differ (sha256 {str(previous.get(key))[:12]}… recorded, "
                        f"{current[key][:12]}… now)")
    else:
        for key in ("threat_model", "threat_model_args"):
            if previous.get(key) != current[key]:
                return f"another threat model: {key} was {previous.get(key)!r}, now {current[key]!r}"
    old, new = _same_run(previous), _same_run(current)
    for key, what in (("federation", "another federation"), ("flower_dp", "other Flower DP settings")):
        said = first_difference(old.get(key), new.get(key), key)
        if said:
            return f"{what}: {said}"
    return None


def _same_run(identity: dict) -> dict:
    """An audit's identity as compared for a resume: option groups completed with the defaults of options
    added since the folder was written (an older audit.json lacks them), a minibatch of None as all B, and
    no round count (rounds can be added)."""
    from dataclasses import asdict

    from lti.audit.options import FederationOptions, FlowerDPOptions

    out = dict(identity)
    for key, defaults in (("federation", FederationOptions()), ("flower_dp", FlowerDPOptions())):
        if isinstance(out.get(key), dict):
            out[key] = {**plain(asdict(defaults)), **out[key]}
    federation = out.get("federation")
    if isinstance(federation, dict):
        federation.pop("rounds", None)
        if federation.get("minibatch_size") is None:
            federation["minibatch_size"] = federation.get("batch_size")
    return out
