"""Several `lti fit` learning curves on one figure: held-out token accuracy (and the attack-free
baseline) against training steps, or against training updates seen (`--x samples`, log scale: runs of
other batch sizes on one axis).

    python -m benchmarks.tools.compare_curves --out docs/results/paper_reproduction/sequences --name update_size \
        --curve "1 sequence" runs/reproduction/lti/curve.csv \
        --curve "2 sequences" runs/reproduction/lti_sequences_2/curve.csv \
        --curve "4 sequences" runs/reproduction/lti_sequences_4/curve.csv

Writes `OUT/NAME.png` and a copy of every curve as `OUT/NAME_<label>.csv` (label lower-cased, spaces
as underscores), and prints each curve's last row (the run's final evaluation, never its best).
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from benchmarks.tools.paper_table import METRICS, read_curve


def metric(row: dict, name: str) -> float:
    """An `lti fit` curve's `val/lti/NAME`, or `val/NAME` of an `lti candidates fit` curve."""
    return float(row[METRICS[name]] if METRICS[name] in row else row[f"val/{name}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--curve", nargs=2, action="append", required=True, metavar=("LABEL", "CSV"))
    parser.add_argument("--title", default="")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="draw each curve's attack-free baseline (--no-baseline: one figure of many runs stays legible)")
    parser.add_argument("--x", choices=["step", "samples"], default="step",
                        help="x axis: training steps, or training updates seen (`samples`: runs of other batch sizes)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6.5, 4))
    palette = plt.cm.tab20.colors if len(args.curve) > 10 else plt.cm.tab10.colors  # a colour per curve
    for index, (label, path) in enumerate(args.curve):
        rows = read_curve(Path(path))
        steps = [int(r[args.x]) for r in rows]
        line, = axis.plot(steps, [100 * metric(r, "token_acc") for r in rows], marker="o", markersize=3, label=label,
                          color=palette[index % len(palette)])
        if args.baseline and "val/baseline/token_acc" in rows[0]:
            axis.plot(steps, [100 * float(r["val/baseline/token_acc"]) for r in rows], linestyle=":", color=line.get_color(),
                      label=f"{label}: baseline")
        copy = args.out / f"{args.name}_{re.sub(r'[^a-z0-9]+', '_', label.lower()).strip('_')}.csv"
        if copy.resolve() != Path(path).resolve():  # redrawing a figure from its own copies
            shutil.copyfile(path, copy)
        last = rows[-1]
        baseline = f"{100 * float(last['val/baseline/token_acc']):.2f}%" if "val/baseline/token_acc" in last else "not logged"
        print(f"{label:>14}: token acc {100 * metric(last, 'token_acc'):.2f}% (baseline "
              f"{baseline}), ROUGE-1 {100 * metric(last, 'rouge1'):.2f}%, "
              f"step {last['step']}, {float(last['wall_minutes']):.1f} min")
    axis.set_xlabel("training steps" if args.x == "step" else "training updates seen")
    if args.x == "samples":
        axis.set_xscale("log")
    axis.set_ylabel("held-out token accuracy (%)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    if args.title:
        axis.set_title(args.title)
    figure.tight_layout()
    figure.savefig(args.out / f"{args.name}.png", dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
