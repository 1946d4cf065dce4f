"""Same behaviour as another commit? Short `lti fit` runs in a worktree of `--baseline` and in this
checkout, compared metric by metric and weight by weight.

    python -m benchmarks.tools.behaviour_equivalence --baseline 5b386b5 [--steps 20] [--out runs/equivalence]

Runs (each `--steps` training steps, one validation on 128 held-out samples):
  quickstart         configs/quickstart.yaml (text, FedSGD, no defense)
  fedavg_dpsgd       + configs/protocols/fedavg.yaml + configs/defenses/dpsgd.yaml
  vision_fedavg      configs/vision/lti_digits.yaml + configs/vision/protocols/fedavg.yaml
  reproduction_lti_p configs/reproduction/lti_p.yaml on the embedded corpus (offline; the config names WikiText)
Prints a markdown table: the largest metric difference and the largest weight difference per run.
The baseline runs from its own tree (`PYTHONPATH` points at the worktree), so it may use its own
config names. Slow refactors are checked here; the unit tests check each piece against a reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]  # benchmarks/tools/ -> the repository root
RUNS = {
    "quickstart": ["--config", "configs/quickstart.yaml", "--data.eval_samples", "128"],
    "fedavg_dpsgd": ["--config", "configs/quickstart.yaml", "--config", "configs/protocols/fedavg.yaml",
                     "--config", "configs/defenses/dpsgd.yaml", "--data.eval_samples", "128"],
    "vision_fedavg": ["--config", "configs/vision/lti_digits.yaml", "--config", "configs/vision/protocols/fedavg.yaml"],
    # The paper-reproduction recipe (LTI-P: pseudo-data, cosine schedule, sampled softmax, bf16), offline: the
    # embedded corpus instead of the WikiText files it is given on the command line; its curve in the run folder.
    "reproduction_lti_p": ["--config", "configs/reproduction/lti_p.yaml", "--data.corpus", "datamodules.text.EmbeddedCorpus",
                           "--data.eval_samples", "128", "--curve.path", "{folder}/curve.csv"],
}


def fit(tree: Path, run: str, steps: int, out: Path) -> Path:
    folder = out / run
    run_args = [arg.format(folder=folder) for arg in RUNS[run]]
    args = [sys.executable, "-m", "lti.cli", "fit", *run_args, "--trainer.max_steps", str(steps),
            "--trainer.val_check_interval", str(steps), "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(folder),
            "--checkpoint.dirpath", str(folder / "ckpt")]
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "disabled"}
    # A fit refuses a checkpoint folder holding an earlier run's checkpoints; this tool's runs are fresh
    # each time (an option to say so would be unknown to an older baseline).
    shutil.rmtree(folder / "ckpt", ignore_errors=True)
    with open(out / f"{run}.log", "w") as log:
        subprocess.run(args, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return folder


def compare(old: Path, new: Path) -> tuple[float, float]:
    metrics = [json.loads((f / "val_metrics.json").read_text())["metrics"] for f in (old, new)]
    metric_diff = max(abs(metrics[0][k] - metrics[1][k]) for k in metrics[0]
                      if isinstance(metrics[0][k], float) and "seconds" not in k)
    weights = [torch.load(f / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")["state_dict"] for f in (old, new)]
    if set(weights[0]) != set(weights[1]):
        raise SystemExit(f"the checkpoints hold different tensors: {sorted(set(weights[0]) ^ set(weights[1]))}")
    weight_diff = max((weights[0][k].double() - weights[1][k].double()).abs().max().item() for k in weights[0])
    return metric_diff, weight_diff


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="commit to compare with")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "equivalence")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        worktree = Path(scratch) / "baseline"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(worktree), args.baseline], cwd=REPO, check=True)
        try:
            print(f"| run ({args.steps} steps) | largest metric difference | largest weight difference |")
            print("|---|---|---|")
            for run in args.runs:
                folders = []
                for name, tree in (("baseline", worktree), ("head", REPO)):
                    out = args.out / name
                    out.mkdir(parents=True, exist_ok=True)
                    folders.append(fit(tree, run, args.steps, out))
                metric_diff, weight_diff = compare(*folders)
                print(f"| {run} | {metric_diff:.3g} | {weight_diff:.3g} |", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
