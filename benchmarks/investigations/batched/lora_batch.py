"""Investigation: batched LoRA updates (B sequences averaged) read by whitened bag recovery and the all-site
span search (`exact.batched`), through the float32 weights a Flower client returns.

For each B: `--updates` client updates of B held-out blocks (the evaluation split, or the auxiliary split's
last blocks, which the whitening never reads: the split to choose settings on), each a FedSGD step
w - lr * g returned in float32 and read back as (w - returned) / lr in float64, as the audit's server
does. Reports bag recall (distinct visible tokens found), token accuracy (sequences matched as the
metrics do), ROUGE-1/2, exact sequences and seconds per update; one JSON line per update as it ends.
`--attacks dager` (or `batched dager`): DAGER on the same updates, its scores in each row's `dager`.

    python -m benchmarks.investigations.batched.lora_batch --batch-sizes 1 2 4 8 16 --updates 8 \
        --out docs/results/audit/batched/eval.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch

from datamodules.machine import describe_machine
from exact.batched import BatchedOptions
from exact.batched.search import SCREEN_PRECISIONS

TAIL = 2048


class Setup:
    """The threat model, its splits, the whitening, and the server's view of a client's update."""

    def __init__(self, config: str, whitening_blocks: int, whitening_cache: str,
                 overrides: list[str] | None = None) -> None:
        from datamodules.federated.pipeline import target_fingerprint
        from exact.batched.sites import adapter_sites
        from lti.trainer_cli import instantiate

        _, self.data = instantiate(config, overrides or [])
        self.data.prepare_data()
        self.data.setup("validate")
        self.server = self.data.pipeline
        self.target = self.server.target
        aux, _ = self.data.blocks("auxiliary")
        self.evaluation, _ = self.data.blocks("evaluation")
        #: The auxiliary split's last blocks: never read by the whitening or the scorer; settings are chosen on it.
        self.tail = aux[-TAIL:]
        self.whitening_blocks = min(whitening_blocks, aux.shape[0] - TAIL)
        #: Blocks the learned scorer may train on: the auxiliary split between the whitening's and the tail.
        self.training = aux[self.whitening_blocks : -TAIL]
        self.names = list(self.server.names)
        self.sites = adapter_sites(self.names)
        self.fingerprint = target_fingerprint(self.target)
        self._whitening_source = (whitening_cache, aux[: self.whitening_blocks])
        self._clients: dict[tuple[int, float, int], object] = {}

    @functools.cached_property
    def whitening(self):
        """The server's whitening (fitted on the auxiliary split's first blocks, cached), made when first needed: DAGER
        alone never reads it."""
        from exact.batched.whitening import SiteWhitening

        cache, blocks = self._whitening_source
        return SiteWhitening.load_or_fit(cache, self.target, self.sites, blocks, self.fingerprint)

    @property
    def threat(self):
        """The server's threat model around its pipeline (what the audit's attacks take)."""
        from datamodules.threat_model import ThreatModel

        return ThreatModel.from_pipeline(self.server, self.data.seq_len)

    def clients(self, batch: int, lr: float, local_epochs: int):
        """The clients' pipeline of B = `batch` sequences and `local_epochs` local steps at `lr` (made once)."""
        from lti.audit.federation import client_pipeline

        key = (batch, lr, local_epochs)
        if key not in self._clients:
            self._clients[key] = client_pipeline(self.server, batch, local_epochs=local_epochs, lr=lr)
        return self._clients[key]

    def trajectory(self, batch: int, lr: float, local_epochs: int) -> tuple[float, ...]:
        """DAGER's offsets of the clients' local steps (() for FedSGD), as the audit gives them."""
        from exact.dager.attack import local_step_offsets

        return local_step_offsets(self.clients(batch, lr, local_epochs).client.local)

    def draw(self, split: str, batch: int, k: int) -> torch.Tensor:
        """Update k's B blocks (B, L) of `split` ("evaluation" or "auxiliary_tail"): every batched investigation's
        draw (seed 7919 B + k, also the seed of the client's own randomness in `observed`)."""
        held_out = self.evaluation if split == "evaluation" else self.tail
        generator = torch.Generator().manual_seed(7919 * batch + k)
        return held_out[torch.randperm(held_out.shape[0], generator=generator)[:batch]]

    def simulate(self, sequences: list[list[int]]) -> torch.Tensor:
        """The update each sequence alone gives (the server's own simulation, one sequence per update)."""
        return self.server({"input_ids": torch.tensor(sequences)[:, None]}, keep_update=True).update

    def observed(self, ids: torch.Tensor, lr: float, clip_norm: float | None = None, local_epochs: int = 1,
                 local_dp: tuple[float, float] | None = None,
                 seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The client's step on `ids` (B, L) returned in float32 and read back by the server:
        (flat update, {name: gradient}).

        `local_epochs` > 1: FedAvg, that many local SGD steps on the batch at `lr` (the audit's
        `--federation.local_epochs`). `clip_norm`: the weight change clipped to that norm first, as Flower's
        `fixedclipping_mod` clips what a client returns. `local_dp` = (epsilon, delta): Flower's `LocalDpMod`
        on top of that clipping (sensitivity 2 * clip_norm, as the audit gives it), through Flower's own
        clipping and noise functions, the noise drawn from `seed`."""
        import numpy as np

        from lti.audit.attacks import observed_update
        from lti.audit.federation import adapter_state

        clients = self.clients(ids.shape[0], lr, local_epochs)
        sent = adapter_state(clients)
        computed = clients({"input_ids": ids[None]}, keep_update=True).update[0]
        # FedSGD's update is the gradient; FedAvg's is already the weight change w_start - w_end.
        step = lr * computed if local_epochs == 1 else computed
        if clip_norm is not None and local_dp is None:
            step = step * min(1.0, clip_norm / float(step.double().norm()))
        returned, start = {}, 0
        for name, shape in clients.spec.parameters:
            size = int(torch.tensor(shape).prod())
            returned[name] = (sent[name].float() - step[start : start + size].view(shape)).float()
            start += size
        if local_dp is not None:
            from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_clip_model_update

            if clip_norm is None:
                raise ValueError("local DP needs --clip-norm (LocalDpMod's clipping norm)")
            epsilon, delta = local_dp
            arrays = [returned[name].numpy().copy() for name, _ in clients.spec.parameters]
            compute_clip_model_update(arrays, [sent[name].float().numpy() for name, _ in clients.spec.parameters],
                                      clip_norm)
            np.random.seed(seed)  # Flower draws from numpy's global generator
            add_gaussian_noise_inplace(arrays, 2 * clip_norm * np.sqrt(2 * np.log(1.25 / delta)) / epsilon)
            returned = {name: torch.from_numpy(np.asarray(a, dtype=np.float32))
                        for (name, _), a in zip(clients.spec.parameters, arrays)}
        update = observed_update(sent, returned, lr, self.names, steps=local_epochs)  # the mean gradient, as the audit
        return update, {name: grads[0].double() for name, grads in self.server.split(update[None]).items()}


def batch_token_accuracy(sequences: list[list[int]], ids: torch.Tensor, decode) -> float:
    """The fraction of the true tokens `ids` (B, L) that `sequences` hold at their positions."""
    from datamodules.metrics import score_batch

    scores = score_batch(sequences, ids, None, decode)
    return scores["correct"] / scores["tokens"]


def result_row(found, ids: torch.Tensor, decode, seconds: float) -> dict:
    """What one attacked update measured (the fields every batched investigation writes): bag recall (distinct
    visible tokens found), token accuracy, ROUGE-1/2, exact sequences, the refit and its seconds; the result not
    kept, when a second search ran, scored too."""
    from datamodules.metrics import score_batch

    scores = score_batch(found.sequences, ids, None, decode)
    visible = set(ids[:, :-1].flatten().tolist())
    row = {"bag_size": len(found.bag), "bag_recall": len(visible & set(found.bag)) / len(visible),
           "token_acc": scores["correct"] / scores["tokens"], "rouge1": scores["rouge1"], "rouge2": scores["rouge2"],
           "exact": scores["exact_fraction"], "seconds": seconds, "residual": found.residual,
           "certified": found.certified, "phase_seconds": {k: round(v, 2) for k, v in found.seconds.items()},
           "second_opinion": found.second_opinion, "kept_per_pass": found.kept_per_pass,
           "regrown": [[doubtful, kept] for doubtful, kept in found.regrown],
           "restarted": [[tried, taken] for tried, taken in found.restarted], "extensions": found.extensions,
           "budget_reached": found.budget_reached}
    # Token accuracy after each step of the search kept (its last tokens the LM's guesses, before the refit's labels).
    row["trace"] = [[step, round(at, 2), batch_token_accuracy(sequences, ids, decode)] for step, at, sequences in found.trace]
    if found.other is not None:  # what the choice between the two searches gained or lost
        row["other_token_acc"] = batch_token_accuracy(found.other.sequences, ids, decode)
        row["other_residual"] = found.other.residual
    return row


def dager_row(update: torch.Tensor, threat, batch: int, ids: torch.Tensor, decode, trajectory: tuple = (),
              threshold: float | None = None) -> dict:
    """DAGER (the audit's: `DagerAttack`'s default options, or both span thresholds at `threshold`) on the same update
    the batched attack read: its scores, mode, thresholds and seconds, as the batched attack's are written."""
    from datamodules.metrics import score_batch
    from exact.dager import Dager
    from exact.interface import DagerAttack

    dager = None if threshold is None else Dager().with_options(span={"l1_threshold": threshold,
                                                                      "l2_threshold": threshold})
    attack = DagerAttack(dager, trajectory=trajectory)
    found = attack.attack(update, threat, batch)
    scores = score_batch(found.sequences, ids, None, decode, found.certified_update)
    span = attack.dager.options.span
    return {"token_acc": scores["correct"] / scores["tokens"], "rouge1": scores["rouge1"], "rouge2": scores["rouge2"],
            "exact": scores["exact_fraction"], "certified": found.certified_update,
            "mode": str(found.diagnostics.get("mode", "strict")), "seconds": round(found.seconds, 2),
            "l1_threshold": span.l1_threshold, "l2_threshold": span.l2_threshold}


def merged_row(found, update: torch.Tensor, simulate, ids: torch.Tensor, decode) -> dict | None:
    """What merging the two searches (`exact.batched.attack.merge_searches`) would have read, measured beside the
    attack's own result (which it does not change); None when one search ran."""
    if found.other is None:
        return None
    from exact.batched.attack import merge_searches

    began = time.perf_counter()
    sequences, residual, swaps = merge_searches(update, simulate, found.sequences, found.other.sequences)
    return {"token_acc": batch_token_accuracy(sequences, ids, decode), "residual": residual, "swaps": swaps,
            "seconds": round(time.perf_counter() - began, 2)}


class RowLog:
    """One JSON line per measured update, appended to `path` (its folder made), flushed and printed as each ends,
    every row stamped with this process's `run` id (a rerun of an update is told apart from an earlier one in the
    same file; the progress points of `progress_writer` carry the same id) and the machine its seconds were measured
    on (`datamodules.machine`: two machines of one name differ in speed; `device`: the one the work runs on, which
    names a GPU). A row's own `run` or `machine` field, if it has one, is kept. The file is opened at the first row, so
    a run that fails before it (a model that does not fit in memory) leaves no empty file. Use as a context manager."""

    def __init__(self, path: str | Path, device: torch.device | str | None = None) -> None:
        self.path = Path(path)
        self.run = f"{time.strftime('%Y-%m-%dT%H:%M:%S')}-{os.getpid()}"
        self.machine = describe_machine(device)
        self._file = None

    def __enter__(self) -> RowLog:
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()

    def write(self, row: dict) -> None:
        line = json.dumps({"run": self.run, "machine": self.machine, **row})
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(line + "\n")
        self._file.flush()
        print(line, flush=True)


def progress_writer(path: str | None, batch: int, update: int, split: str, ids: torch.Tensor, decode,
                    run: str = ""):
    """An attack's `on_step` appending each step's token accuracy to the JSONL file `path` as it comes (None: no
    file, no callback). `run` names this process's run, so a rerun of an update is told apart from an earlier
    one in the same file. A write that fails warns and lets the attack go on."""
    if path is None:
        return None
    import warnings

    Path(path).parent.mkdir(parents=True, exist_ok=True)

    def write(step: str, seconds: float, sequences: list[list[int]]) -> None:
        point = {"B": batch, "update": update, "split": split, "run": run, "step": step,
                 "seconds": round(seconds, 2), "token_acc": batch_token_accuracy(sequences, ids, decode)}
        try:
            with open(path, "a") as log:
                log.write(json.dumps(point) + "\n")
        except OSError as error:
            warnings.warn(f"progress file {path}: {error}; the attack goes on", stacklevel=2)

    return write


def batched_fields(attack, args, options: BatchedOptions, weights, other, split: dict, batch: int, k: int,
                   ids: torch.Tensor, update: torch.Tensor, simulate, decode, run: str) -> dict:
    """The batched attack on update `k`: its scores (`result_row`), the merge of its two searches, and the settings
    it ran with, as a row's fields."""
    checked = args.label_candidates > 0
    began = time.perf_counter()
    found = attack.attack(split, batch, ids.shape[1], simulate if checked else None, update,
                          on_step=progress_writer(args.progress, batch, k, args.split, ids, decode, run))
    seconds = time.perf_counter() - began
    return {"lm_weight": weights.lm if weights else options.lm_weight,
            "beam": args.beam, "pick_budget": options.pick_budget(batch, ids.shape[1]),
            **result_row(found, ids, decode, seconds),
            "label_candidates": args.label_candidates, "refine": options.refine_passes(batch, checked=checked),
            "refine_beam": options.refine_beam, "refine_shortlist": options.refine_shortlist,
            "refine_screen_sites": options.refine_screen_sites, "refine_scorer": options.refine_scorer,
            "refine_resume": options.refine_resume, "refine_in_turn": options.refine_in_turn,
            "restart_first_tokens": options.restarts(batch) if checked else 0,
            "regrow": options.regrow_attempts(batch) if checked else 0,
            "screen_sites": args.screen_sites, "shortlist": args.shortlist,
            "first_site_shortlist": options.first_site_cut(args.shortlist, batch),
            "screen_precision": args.screen_precision, "extension_cache_gib": args.extension_cache_gib,
            "scorer": args.scorer, "scorer_batch_sizes": list(weights.batch_sizes) if weights else None,
            "second_opinion_batch_sizes": list(other.batch_sizes) if other else None,
            "second_opinion_file": args.second_opinion, "time_budget": options.time_budget,
            "merged": merged_row(found, update, simulate, ids, decode)}  # None: one search ran


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/audit/inverter_smollm2_lora.yaml", help="the threat model")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--first-update", type=int, default=0, help="the first update's index (its draw's seed)")
    parser.add_argument("--split", choices=["evaluation", "auxiliary_tail"], default="evaluation")
    parser.add_argument("--lr", type=float, default=0.05, help="the clients' learning rate (the audit's default)")
    parser.add_argument("--clip-norm", type=float, default=None,
                        help="clip each client's weight change to this norm (Flower's fixedclipping_mod; the audit's DP "
                             "table uses 0.01); with --local-dp-epsilon, LocalDpMod's clipping norm")
    parser.add_argument("--local-epochs", type=int, default=1,
                        help="local SGD steps on the batch (> 1: FedAvg, as --federation.local_epochs)")
    parser.add_argument("--local-dp-epsilon", type=float, default=None,
                        help="Flower's LocalDpMod with this epsilon per round, clipping at --clip-norm")
    parser.add_argument("--local-dp-delta", type=float, default=1e-5)
    parser.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                        help="an override of the threat model config, as lti fit takes it "
                             "(e.g. --set data.client.init_args.rank 16, --set data.seq_len 32)")
    parser.add_argument("--picks-per-sequence", type=int, default=BatchedOptions.picks_per_sequence,
                        help="bag recovery's budget per sequence (default: the sequence length)")
    parser.add_argument("--lm-weight", type=float, default=0.5)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--refine", type=int, default=BatchedOptions.refine,
                        help="passes of refinement at most (default: 2B with the refit, which ends them at the first that "
                             "keeps none; B / 2 without; at least 2)")
    parser.add_argument("--regrow", type=int, default=BatchedOptions.regrow,
                        help="attempts at regrowing the sequences the refit explains least, jointly "
                             "(default: B / 4, at least 1)")
    parser.add_argument("--refine-beam", type=int, default=BatchedOptions.refine_beam,
                        help="prefixes kept per sequence in refinement (default: --beam)")
    parser.add_argument("--refine-shortlist", type=int, default=BatchedOptions.refine_shortlist,
                        help="extensions per sequence scored by every site in refinement (default: --shortlist)")
    parser.add_argument("--refine-screen-sites", type=int, default=BatchedOptions.refine_screen_sites,
                        help="sites of refinement's screen (default: --screen-sites)")
    parser.add_argument("--refine-scorer", default=BatchedOptions.refine_scorer, choices=["search", "hand_set"],
                        help="the weights refinement scores with when the search has a learned scorer")
    parser.add_argument("--refine-resume", action="store_true",
                        help="refinement passes resume each sequence after the prefix the screen confirms (a pass from "
                             "the start when one keeps none)")
    parser.add_argument("--restart-first-tokens", type=int, default=BatchedOptions.restart_first_tokens,
                        help="when a regrowth is refused, the doubtful sequences grown again from this many other "
                             "first tokens each (default: 4 above B = 4; 0: none)")
    parser.add_argument("--refine-in-turn", action="store_true",
                        help="refinement passes regrow the sequences one at a time, each against the others as they "
                             "stand (kept or not before the next)")
    parser.add_argument("--label-candidates", type=int, default=16,
                        help="last tokens chosen by the least-squares refit among the LM's top k (0: no refit)")
    parser.add_argument("--screen-sites", type=int, default=BatchedOptions.screen_sites,
                        help="sites that screen every extension (0: no screening)")
    parser.add_argument("--shortlist", type=int, default=BatchedOptions.shortlist,
                        help="extensions per sequence scored by every site after the screen")
    parser.add_argument("--first-site-shortlist", type=int, default=BatchedOptions.first_site_shortlist,
                        help="extensions per sequence the first site alone keeps before the screen (default: twice "
                             "the shortlist at B <= 4, none above; 0: none)")
    parser.add_argument("--screen-precision", default=BatchedOptions.screen_precision, choices=SCREEN_PRECISIONS,
                        help="the screen's forward pass precision (bfloat16: a copy of the model with bfloat16 weights)")
    parser.add_argument("--extension-cache-gib", type=float, default=BatchedOptions.extension_cache_gib,
                        help="memory for extensions' site inputs reused by later steps of an attack (0: none)")
    parser.add_argument("--scorer", default=None, help="learned scorer weights (train_scorer's output); "
                        "their prior weight replaces --lm-weight")
    parser.add_argument("--second-opinion", default=None,
                        help="learned scorer weights searched again with when the refit residual is above "
                             "--second-opinion-above (the lower residual's result is kept)")
    parser.add_argument("--second-opinion-above", type=float, default=BatchedOptions.second_opinion_above)
    parser.add_argument("--time-budget", type=float, default=BatchedOptions.time_budget,
                        help="seconds per update after which no refinement pass, regrowth, restart or second search "
                             "starts (default: none)")
    parser.add_argument("--attacks", nargs="+", choices=["batched", "dager"], default=["batched"],
                        help="the attacks run on each update: the batched attack (its scores at the row's top level) "
                             "and DAGER (the audit's, default options; its scores in the row's `dager`)")
    parser.add_argument("--dager-threshold", type=float, default=None,
                        help="DAGER's first- and second-layer span thresholds (default: the audit's, "
                             "exact.dager.options.RETURNED_FLOAT32; the table's DAGER columns ran at the paper's 1e-3)")
    parser.add_argument("--whitening-blocks", type=int, default=512, help="auxiliary blocks the whitening reads")
    parser.add_argument("--whitening-cache", default="runs/whitening/smollm2_lora.safetensors")
    parser.add_argument("--out", required=True, help="JSONL file: one line per update")
    parser.add_argument("--progress", default=None,
                        help="JSONL file: one line per step of each attack as it is reached (B, update, step, seconds, "
                             "token accuracy), so a long update's curve survives its interruption")
    args = parser.parse_args(argv)

    from exact.batched import BatchedLoRA
    from exact.batched.scorer import ScorerWeights

    overrides = [item for key, value in args.set for item in (f"--{key}", value)]
    bench = Setup(args.config, args.whitening_blocks, args.whitening_cache, overrides)
    local_dp = None if args.local_dp_epsilon is None else (args.local_dp_epsilon, args.local_dp_delta)
    decode = lambda t: bench.data.tokenizer.decode(t)  # noqa: E731
    options = BatchedOptions(picks_per_sequence=args.picks_per_sequence, lm_weight=args.lm_weight, beam=args.beam,
                             label_candidates=max(1, args.label_candidates), refine=args.refine,
                             refine_beam=args.refine_beam, refine_shortlist=args.refine_shortlist,
                             refine_screen_sites=args.refine_screen_sites, refine_scorer=args.refine_scorer,
                             refine_resume=args.refine_resume, refine_in_turn=args.refine_in_turn,
                             restart_first_tokens=args.restart_first_tokens, regrow=args.regrow,
                             screen_sites=args.screen_sites, shortlist=args.shortlist,
                             first_site_shortlist=args.first_site_shortlist,
                             screen_precision=args.screen_precision, extension_cache_gib=args.extension_cache_gib,
                             second_opinion_above=args.second_opinion_above, time_budget=args.time_budget)

    def weights_for(path: str | None, batch: int) -> ScorerWeights | None:
        """A scorer file's weights for updates of `batch` sequences (the set fitted nearest it)."""
        return None if path is None else ScorerWeights.load(path, bench.fingerprint, len(bench.sites), batch)

    simulate = bench.simulate
    with RowLog(args.out) as log:
        for batch in args.batch_sizes:
            weights, other = weights_for(args.scorer, batch), weights_for(args.second_opinion, batch)
            attack = (BatchedLoRA(bench.target, bench.names, bench.whitening, options,
                                  scorer=(weights.sites, weights.lm) if weights else None,
                                  second_opinion=(other.sites, other.lm) if other else None)
                      if "batched" in args.attacks else None)  # DAGER alone needs no whitening
            for k in range(args.first_update, args.first_update + args.updates):
                ids = bench.draw(args.split, batch, k)
                update, split = bench.observed(ids, args.lr, args.clip_norm, args.local_epochs, local_dp,
                                               seed=7919 * batch + k)
                row = {"B": batch, "L": ids.shape[1], "update": k, "split": args.split}
                if "batched" in args.attacks:
                    row.update(batched_fields(attack, args, options, weights, other, split, batch, k, ids,
                                              update, simulate, decode, log.run))
                if "dager" in args.attacks:
                    row["dager"] = dager_row(update, bench.threat, batch, ids, decode,
                                             bench.trajectory(batch, args.lr, args.local_epochs), args.dager_threshold)
                row.update({"clip_norm": args.clip_norm, "local_epochs": args.local_epochs,
                            "local_dp_epsilon": args.local_dp_epsilon,
                            "local_dp_delta": args.local_dp_delta if args.local_dp_epsilon is not None else None,
                            "overrides": dict(args.set)})
                log.write(row)


if __name__ == "__main__":
    main()
