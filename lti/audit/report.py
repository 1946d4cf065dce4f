"""The audit's report folder: `report.md`, `report.json`, the leakage-over-rounds and privacy-utility
plots, and (optionally) the same numbers in W&B (offline, inside the report folder)."""

from __future__ import annotations

import json
from pathlib import Path

from datamodules.atomic_files import atomic_writer, write_text_atomically
from datamodules.machine import machine_line
from lti.audit.options import AuditOptions

ATTACK_NAMES = {"dager": "DAGER (lora_A span test)",
                "batched": "batched LoRA attack (whitened bag, all-layer span search)", "learned": "learned inverter (LTI)",
                "pointer": "candidate pointer (span bag, learned order)"}


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _best(record: dict) -> float | None:
    values = [a["token_acc"] for a in record["attacks"].values()]
    return max(values) if values else None


def _save_figure(figure, path: Path) -> None:
    with atomic_writer(path) as file:
        figure.savefig(file, format="png", dpi=120, bbox_inches="tight")


def plot_leakage(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.5, 3.5))
    rounds = [r["round"] for r in records]
    for name in sorted({a for r in records for a in r["attacks"]}):
        points = [(r["round"], 100 * r["attacks"][name]["token_acc"]) for r in records if name in r["attacks"]]
        axis.plot(*zip(*points), marker="o", label=ATTACK_NAMES.get(name, name) + ", clients' updates")
    for name in ("learned", "pointer"):
        probe = [(r["round"], 100 * r["probe"][name]["token_acc"]) for r in records if name in (r.get("probe") or {})]
        if probe:
            axis.plot(*zip(*probe), marker="s", linestyle="--", label=f"{ATTACK_NAMES[name]}, held-out probe")
    axis.set_xlabel("round")
    axis.set_ylabel("token accuracy (%)")
    axis.set_xticks(rounds)
    axis.set_ylim(0, 100)
    axis.legend(fontsize=7)
    axis.set_title("leakage over rounds")
    _save_figure(figure, path)
    plt.close(figure)


def plot_privacy_utility(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.5, 3.5))
    points = [(r["utility_after"], 100 * _best(r), r["round"]) for r in records if _best(r) is not None]
    if points:
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        for x, y, r in points:
            axis.annotate(f"r{r}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axis.set_xlabel("global model's validation loss after the round (utility; lower is better)")
    axis.set_ylabel("best attack's token accuracy (%)")
    axis.set_title("privacy vs utility")
    _save_figure(figure, path)
    plt.close(figure)


def write_report(out: Path, options: AuditOptions, records: list[dict], learned, seconds: float,
                 notes: list[str] = (), probe_baseline: float | None = None, pointer=None,
                 shape: dict | None = None, machine: dict | None = None) -> None:
    """report.md, report.json and the two plots under `out` (and W&B if asked); `probe_baseline`: the
    per-position majority's token accuracy on the staleness probe's sequences (None: no probe); `shape`: the
    updates' sequence length and adapters ({"L", "lora_rank", "lora_modules": the adapted modules' names}), stated
    beside B; `machine`: this invocation's (`datamodules.machine.describe_machine`), beside its wall time. Rounds
    whose attacks ran on another machine or setting (a resumed audit), or before machines were recorded, are named."""
    fed, dp = options.federation, options.flower_dp
    lines = [
        "# Audit report",
        "",
        f"Threat model: `{options.threat_model}`"
        + (f" with `{' '.join(options.threat_model_args)}`" if options.threat_model_args else "")
        + f"; {fed.clients} Flower clients × {fed.rounds} rounds, "
        f"B = {fed.batch_size} sequence{'s' if fed.batch_size != 1 else ''}"
        + (f" of L = {shape['L']} tokens per update, LoRA r = {shape['lora_rank']} on {', '.join(shape['lora_modules'])}, "
           if shape else " per update, ")
        + (f"FedSGD step lr = {fed.lr}" if fed.local_steps() == 1 else
           f"FedAvg: {fed.local_steps()} local SGD steps at lr = {fed.lr}") + f"; Flower DP: {dp.mode}"
        + ("" if dp.mode == "none" else f" (clipping norm {dp.clipping_norm}"
           + (f", ε = {dp.epsilon} per round, δ = {dp.delta})" if dp.mode == "local_dp"
              else f", noise multiplier {dp.noise_multiplier} on the aggregate)")) + ".",
        f"Learned inverter: `{learned.checkpoint}`." if learned is not None else "Learned inverter: none.",
        f"Candidate pointer: `{pointer.path}`, decoded by {pointer.rule}"
        + (f" (global model's log-probability weighted {pointer.lm_weight})." if pointer.rule == "lm" else
           f" (global model's log-probability weighted {pointer.lm_weight}, second-layer span test's score weighted "
           f"{pointer.second_weight})." if pointer.rule == "second_layer" else ".")
        if pointer is not None else "Candidate pointer: none.",
        f"Wall time of this invocation: {seconds / 60:.1f} min"
        + (f", on {machine_line(machine)}." if machine is not None else "."),
        *_other_machines(records, machine),
        *notes,
        "",
        "Token accuracy, ROUGE-1/2 (F, %) and exact sequences (%) of each attack on the clients' updates of the round;",
        "'probe': a learned attack on updates the server simulates for held-out client sequences at the",
        "round's global weights (its staleness); utility: the global model's validation loss after the round.",
        "",
        "| round | attack | token acc | ROUGE-1 | ROUGE-2 | exact | probe acc | val. loss | ε | how it ran |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        probe = record.get("probe") or {}
        # An attack that ran on the probe only (its updates are not the clients' B) still gets its row.
        attacks = {**record["attacks"], **{name: None for name in probe if name not in record["attacks"]}}
        for name, scores in (attacks or {"(not attacked)": None}).items():
            eps = record.get("epsilon")
            cells = ["–"] * 4 if scores is None else [_pct(scores["token_acc"]), _pct(scores["rouge1"]),
                                                      _pct(scores["rouge2"]), _pct(scores["exact_fraction"])]
            lines.append(f"| {record['round']} | {ATTACK_NAMES.get(name, name)} | " + " | ".join(cells)
                         + f" | {_pct(probe[name]['token_acc']) if name in probe else '–'}"
                         + f" | {record['utility_after']:.4f} | {'–' if eps is None else f'{eps:.2f}'}"
                         + f" | {_how(scores)} |")
    lines += ["", "![leakage over rounds](leakage_over_rounds.png) ![privacy vs utility](privacy_utility.png)", "",
              "## Reconstructions", ""]
    for record in records:
        for name, scores in record["attacks"].items():
            for sample in scores.get("samples", []):
                lines.append(f"- round {record['round']}, client {sample['client']}, {ATTACK_NAMES.get(name, name)}: "
                             f"`{_one_line(sample['reconstruction'])}` ← `{_one_line(sample['reference'])}`")
    write_text_atomically(out / "report.md", "\n".join(lines) + "\n")
    write_text_atomically(out / "report.json", json.dumps({"rounds": records, "seconds": seconds, "machine": machine,
                                                          "notes": list(notes),
                                                          "probe_baseline": probe_baseline,
                                                          "setting": {"B": fed.batch_size, **(shape or {})}},
                                                         indent=1) + "\n")
    plot_leakage(records, out / "leakage_over_rounds.png")
    plot_privacy_utility(records, out / "privacy_utility.png")
    if options.wandb:
        _log_wandb(out, records)


def _other_machines(records: list[dict], machine: dict | None) -> list[str]:
    """One line per machine other than `machine` that attacked some rounds (their seconds are that machine's), and one
    for rounds attacked before the audit recorded machines."""
    elsewhere: dict[str, list[int]] = {}
    unrecorded = []
    for record in records:
        if not record.get("attacks"):
            continue
        if "machine" not in record:
            unrecorded.append(record["round"])
        elif record["machine"] != machine:
            elsewhere.setdefault(machine_line(record["machine"]), []).append(record["round"])
    lines = [f"Round{'s' if len(rounds) > 1 else ''} {_rounds(rounds)} attacked on another machine or setting: {line}."
             for line, rounds in elsewhere.items()]
    if unrecorded:
        lines.append(f"Round{'s' if len(unrecorded) > 1 else ''} {_rounds(unrecorded)} attacked before audits recorded "
                     "their machine.")
    return lines


def _rounds(rounds: list[int]) -> str:
    return ", ".join(str(r) for r in rounds)


def _how(scores: dict | None) -> str:
    """DAGER's modes over the round's updates (strict span tests, relaxed best effort, degenerate) and
    the first-layer span's rank against the width."""
    if not scores or "modes" not in scores:
        return ""
    modes = ", ".join(f"{mode} {count}" for mode, count in sorted(scores["modes"].items()))
    ranks = scores.get("rank1")
    if ranks and scores.get("dim"):
        modes += f"; layer-1 span rank {min(ranks)}–{max(ranks)} of {scores['dim'][0]}"
    recall = scores.get("bag_recall")
    if recall:
        modes += f"; bag recall {100 * sum(recall) / len(recall):.0f}% ({min(scores['bag_size'])}–{max(scores['bag_size'])} tokens)"
    residual = scores.get("residual")
    if residual:
        modes += f"; refit residual {min(residual):.1e}–{max(residual):.1e}"
    second = scores.get("second_opinion")
    if second:
        modes += f"; searched again with the learned scorer on {len(second)} (its result kept on {sum(second)})"
    budget = scores.get("budget_reached")
    if budget and any(budget):
        modes += f"; time budget reached on {sum(budget)} of {len(budget)}"
    return modes


def _one_line(text: str) -> str:
    return text.replace("\n", " ⏎ ").replace("`", "'")


def _log_wandb(out: Path, records: list[dict]) -> None:
    import wandb

    run = wandb.init(project="lti", name=f"audit-{out.name}", dir=str(out), mode="offline", reinit="finish_previous")
    try:
        for record in records:
            metrics = {"round": record["round"], "utility/validation_loss": record["utility_after"]}
            if record.get("epsilon") is not None:
                metrics["privacy/epsilon"] = record["epsilon"]
            for name, scores in record["attacks"].items():
                for key in ("token_acc", "rouge1", "rouge2", "exact_fraction"):
                    metrics[f"{name}/{key}"] = scores[key]
            for name, scores in (record.get("probe") or {}).items():
                metrics[f"{name}/probe_token_acc"] = scores["token_acc"]
            run.log(metrics)
    finally:
        run.finish()
