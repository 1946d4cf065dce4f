"""Table 2 of the LTI paper next to ours, from the learning-curve CSVs of `lti fit` runs.

    python -m benchmarks.tools.paper_table --out docs/results/paper_reproduction \
        --cell lti_p none runs/reproduction/lti_p/curve.csv "lti fit --config configs/reproduction/lti_p.yaml ..."

Each `--cell ATTACK DEFENSE CURVE COMMAND` adds one measured cell: its numbers are the curve's last
row (the run's final evaluation; never the best row, which would be selection on the evaluation
split). Writes `table2.csv` (attack, defense, token_acc, rouge1, rouge2, rougeL as fractions, steps,
wall_minutes, command, and the paper's values), a copy of every curve as
`curves/ATTACK_DEFENSE.csv`, and `curves/ATTACK_DEFENSE.png` (held-out token accuracy against steps and
against wall-clock minutes, with the paper's value as a line). Cells without a run are listed with
empty numbers.
"""

from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path

#: Wu et al. (UAI 2023), Table 2: token accuracy / ROUGE-1 / ROUGE-2 / ROUGE-L in %.
PAPER = {
    ("lti", "none"): (89.61, 86.13, 79.53, 86.11), ("lti_p", "none"): (91.14, 89.43, 85.11, 89.41),
    ("lti", "sign"): (71.15, 63.17, 43.51, 63.11), ("lti_p", "sign"): (88.06, 84.66, 76.46, 84.64),
    ("lti", "prune"): (66.79, 58.31, 37.58, 58.21), ("lti_p", "prune"): (86.19, 82.56, 73.04, 82.50),
    ("lti", "gauss"): (82.08, 76.55, 63.38, 76.52), ("lti_p", "gauss"): (90.25, 87.39, 81.94, 87.34),
}
METRICS = {"token_acc": "val/lti/token_acc", "rouge1": "val/lti/rouge1", "rouge2": "val/lti/rouge2", "rougeL": "val/lti/rougeL"}
COLUMNS = ["attack", "defense", "token_acc", "rouge1", "rouge2", "rougeL", "steps", "wall_minutes", "command",
           "paper_token_acc", "paper_rouge1", "paper_rouge2", "paper_rougeL"]


def read_curve(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"learning curve {str(path)!r} has no rows")
    return rows


def plot(rows: list[dict], paper_accuracy: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]
    minutes = [float(r["wall_minutes"]) for r in rows]
    accuracy = [100 * float(r[METRICS["token_acc"]]) for r in rows]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for axis, x, label in ((axes[0], steps, "training steps (batch 64)"), (axes[1], minutes, "wall-clock minutes")):
        axis.plot(x, accuracy, marker="o", markersize=3, label="this workbench")
        axis.axhline(paper_accuracy, color="gray", linestyle="--", label=f"paper ({paper_accuracy:.1f}%, 281,400 steps)")
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("held-out token accuracy (%)")
    axes[0].legend(loc="lower right")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cell", nargs=4, action="append", default=[], metavar=("ATTACK", "DEFENSE", "CURVE", "COMMAND"))
    args = parser.parse_args()

    (args.out / "curves").mkdir(parents=True, exist_ok=True)
    measured = {}
    for attack, defense, curve, command in args.cell:
        if (attack, defense) not in PAPER:
            raise ValueError(f"cell ({attack}, {defense}) is not in Table 2; attacks: lti, lti_p; defenses: none, sign, prune, gauss")
        rows = read_curve(Path(curve))
        name = f"{attack}_{defense}"
        shutil.copyfile(curve, args.out / "curves" / f"{name}.csv")
        plot(rows, PAPER[attack, defense][0], f"{attack.upper().replace('_', '-')}, defense {defense}: WikiText validation, 1,000 blocks",
             args.out / "curves" / f"{name}.png")
        last = rows[-1]
        measured[attack, defense] = {
            **{key: round(float(last[column]), 4) for key, column in METRICS.items()},
            "steps": int(last["step"]), "wall_minutes": round(float(last["wall_minutes"]), 1), "command": command,
        }
    with (args.out / "table2.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        for (attack, defense), paper in PAPER.items():
            writer.writerow({"attack": attack, "defense": defense, **measured.get((attack, defense), {}),
                             **{f"paper_{k}": round(v / 100, 4) for k, v in zip(METRICS, paper)}})
    for (attack, defense), cell in measured.items():
        print(f"{attack:>6} {defense:>6}: token acc {100 * cell['token_acc']:.2f}% (paper {PAPER[attack, defense][0]:.2f}%), "
              f"{cell['steps']} steps, {cell['wall_minutes']} min")


if __name__ == "__main__":
    main()
