"""The grid's outputs: `matrix.json`, `matrix.csv`, `matrix.md` (tables), `*.png` (plots), and one W&B
run holding them all."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from lti.matrix.grid import METRICS, Entry, Grid


def markdown_escape(text: str) -> str:
    """`text` as the content of one markdown table cell: one line, its pipes and backslashes escaped, and
    no `<...>` (e.g. "<class 'NoneType'>") that a renderer would take for an HTML tag."""
    text = " ".join(str(text).split()).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _cell_text(record: dict | None) -> str:
    if record is None:
        return ""
    if record["status"] != "ok":
        return markdown_escape(f"{record['status']}: {record.get('reason', '')}")
    m = record["metrics"]
    shown = [f"{100 * m[k]:.1f}" if m.get(k) is not None else "-" for k in ("token_acc", "rouge1")]
    extra = [f"{k} {100 * m[k]:.1f}" for k in m if k not in METRICS and k != "baseline_token_acc" and m[k] is not None]
    return " / ".join(shown) + (f" ({', '.join(extra)})" if extra else "")


def write_outputs(grid: Grid, records: list[dict]) -> None:
    out = grid.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(records, indent=2) + "\n")
    with open(out / "matrix.csv", "w", newline="") as handle:
        extra = sorted({k for r in records for k in (r.get("metrics") or {}) if k not in METRICS})
        writer = csv.writer(handle)
        writer.writerow(["protocol", "defense", "attack", "status", *METRICS, *extra, "epsilon", "seconds", "reason"])
        for r in records:
            m = r.get("metrics") or {}
            writer.writerow([r["protocol"], r["defense"], r["attack"], r["status"], *(m.get(k) for k in (*METRICS, *extra)),
                             r.get("epsilon"), r.get("seconds"), r.get("reason", "")])
    (out / "matrix.md").write_text(markdown_table(grid, records))
    plots = write_plots(grid, records)
    log_to_wandb(grid, records, plots)


def markdown_table(grid: Grid, records: list[dict]) -> str:
    by_key = {(r["protocol"], r["defense"], r["attack"]): r for r in records}
    attacks = [a.name for a in grid.attacks if any(r["attack"] == a.name for r in records)]
    lines = ["Cells: token accuracy / ROUGE-1 (%) on held-out clients; extra metrics in brackets.", "",
             "| " + " | ".join(["protocol", "defense", "epsilon", *attacks, "baseline"]) + " |",
             "|---|---|---|" + "---|" * (len(attacks) + 1)]
    for p in grid.protocols:
        for d in grid.defenses:
            row = [by_key.get((p.name, d.name, a)) for a in attacks]
            if not any(row):
                continue
            eps = next((r.get("epsilon") for r in row if r and r.get("epsilon") is not None), None)
            base = next((r["metrics"].get("baseline_token_acc") for r in row if r and r.get("metrics")), None)
            lines.append(f"| {p.name} | {d.name} | {'' if eps is None else f'{eps:.3g}'} | "
                         + " | ".join(_cell_text(r) for r in row)
                         + f" | {'' if base is None else f'{100 * base:.1f}'} |")
    for attack in (a for a in grid.attacks if a.name in attacks):
        lines += ["", *headline_table(grid, attack, by_key)]
    return "\n".join(lines) + "\n"


def headline_table(grid: Grid, attack: Entry, by_key: dict[tuple[str, str, str], dict]) -> list[str]:
    """One attack's headline metric (%) as protocols x defenses: blank = not run yet."""
    defenses = [d.name for d in grid.defenses]
    lines = [f"**{attack.name}: {attack.headline} (%)**", "",
             "| protocol | " + " | ".join(defenses) + " |", "|---|" + "---|" * len(defenses)]
    for p in grid.protocols:
        row = [by_key.get((p.name, d, attack.name)) for d in defenses]
        if not any(row):
            continue
        texts = []
        for record in row:
            value = None if record is None else (record.get("metrics") or {}).get(attack.headline)
            texts.append("" if record is None else f"{100 * value:.1f}" if value is not None
                         else "n/a" if record["status"] == "n/a" else record["status"] if record["status"] != "ok" else "-")
        lines.append(f"| {p.name} | " + " | ".join(texts) + " |")
    return lines


def write_plots(grid: Grid, records: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r["status"] == "ok"]
    attacks = [a.name for a in grid.attacks if any(r["attack"] == a.name for r in ok)]
    protocols = [p.name for p in grid.protocols if any(r["protocol"] == p.name for r in ok)]
    defenses = [d.name for d in grid.defenses if any(r["defense"] == d.name for r in ok)]
    paths = []
    if not ok:
        return paths
    columns = min(4, len(protocols))  # one panel per protocol, wrapped into rows of four
    rows = -(-len(protocols) // columns)
    for metric in ("rouge1", "token_acc"):
        fig, axes = plt.subplots(rows, columns, figsize=(max(3.2, 0.9 * len(defenses) + 1.5) * columns, 3.4 * rows),
                                 squeeze=False, sharey=True)
        width = 0.8 / max(1, len(attacks))
        for ax in axes.flat[len(protocols):]:
            ax.set_visible(False)
        for ax, protocol in zip(axes.flat, protocols):
            for i, attack in enumerate(attacks):
                values = []
                for d in defenses:
                    r = next((r for r in ok if (r["protocol"], r["defense"], r["attack"]) == (protocol, d, attack)), None)
                    values.append(float("nan") if r is None or r["metrics"].get(metric) is None else 100 * r["metrics"][metric])
                ax.bar([x + i * width for x in range(len(defenses))], values, width, label=attack)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(defenses))], defenses, rotation=30, ha="right")
            ax.set_title(protocol)
            ax.set_ylim(0, 100)
        for row in axes:
            row[0].set_ylabel(f"{metric} (%)")
        axes.flat[0].legend(fontsize=8)
        fig.tight_layout()
        path = grid.out_dir / f"{metric}_by_defense.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    noisy = [r for r in ok if r.get("noise") is not None]
    if noisy:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for protocol in protocols:
            for attack in attacks:
                points = sorted((r["noise"], 100 * r["metrics"]["rouge1"]) for r in noisy
                                if r["protocol"] == protocol and r["attack"] == attack and r["metrics"].get("rouge1") is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", label=f"{attack} ({protocol})")
        for r in noisy:  # annotate epsilon where the accountant gave one
            if r.get("epsilon") is not None and r["attack"] == attacks[0]:
                ax.annotate(f"eps={r['epsilon']:.3g}", (r["noise"], 100 * (r["metrics"].get("rouge1") or 0)), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("noise (DP-SGD noise multiplier / Gaussian sigma)")
        ax.set_ylabel("ROUGE-1 (%)")
        ax.set_title("privacy vs recovery")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = grid.out_dir / "privacy_utility.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def log_to_wandb(grid: Grid, records: list[dict], plots: list[Path]) -> None:
    if grid.wandb.get("mode") == "disabled":
        return
    import wandb

    run = wandb.init(project=grid.wandb.get("project", "lti"), mode=grid.wandb.get("mode", "offline"),
                     name=grid.wandb.get("name", f"matrix-{grid.out_dir.name}"), dir=str(grid.out_dir), reinit=True)
    columns = ["protocol", "defense", "attack", "status", *METRICS, "epsilon", "reason"]
    rows = [[r["protocol"], r["defense"], r["attack"], r["status"], *((r.get("metrics") or {}).get(k) for k in METRICS),
             r.get("epsilon"), r.get("reason", "")] for r in records]
    run.log({"matrix": wandb.Table(columns=columns, data=rows), **{p.stem: wandb.Image(str(p)) for p in plots}})
    run.finish()
