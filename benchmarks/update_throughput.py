"""Client-update throughput of the LTI target (Transformer3 defaults): per-sample gradient paths compared.

Variants (each in its own subprocess, so that its peak memory is its own):

  loop       FedSGDClient(implementation="loop"): one forward/backward per sequence (the reference)
  fast       FedSGDClient(implementation="vmap"): dispatches to the Transformer3 engine
  vmap       the generic torch.func.vmap path, forced (per_example_gradients_vmap)
  fast-grad  the engine alone, per-sample gradients only (no defense, no hashing)
  ceiling    a plain batched backward of the mean loss (mean gradient only, head on the first L-1
             positions): what one update costs when nobody needs per-sample gradients
  post       the pipeline's work after the gradients, alone (finite check, defense, hashing of the
             (U, D) updates), on fixed per-sample gradients: the part of loop / fast / vmap that no
             gradient engine can speed up

loop / fast / vmap run the whole `UpdatePipeline` (per-sample gradients, defense, feature hashing).
A last subprocess checks the per-sample gradients of fast and vmap against the loop on the same batch.

    python -m benchmarks.update_throughput --device cpu --batch 64 --repeats 3 --rounds 3 --defense none

On a shared machine the load changes while the benchmark runs, so the variants run in `--rounds`
interleaved rounds (each round: every variant once, in a rotated order, `--repeats` timed calls
each); the table gives the median and the best of all timed calls of a variant.

Peak memory: CPU, ru_maxrss of the worker (peak resident set, whole process) and its increase over
the state right before the first timed call; CUDA, torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import datamodules.federated.engines.next_token as engine_module
from datamodules.federated import FedSGDClient, UpdatePipeline
from datamodules.federated.defenses import DPSGD, GaussianNoise, NoDefense, Sign, TopKPruning
from datamodules.federated.engines.next_token import (
    per_example_gradients,
    per_example_gradients_loop,
    per_example_gradients_vmap,
)
from datamodules.targets.base import next_token_loss
from datamodules.targets.transformer3 import Transformer3

VARIANTS = ("loop", "fast", "vmap", "fast-grad", "ceiling", "post")
DEFENSES = {
    "none": NoDefense,
    "sign": Sign,
    "prune": lambda: TopKPruning(0.99),
    "gaussian": lambda: GaussianNoise(0.01),
    "dpsgd": lambda: DPSGD(clip_norm=1.0, noise_multiplier=0.1),
}
SEQ_LEN = 16


def build(args, implementation: str = "vmap"):
    device = torch.device(args.device)
    target = Transformer3()  # the LTI paper's target, default sizes
    pipeline = UpdatePipeline(
        target, client=FedSGDClient(mode="train", implementation=implementation), defense=DEFENSES[args.defense]()
    ).to(device)  # moves the target and the hasher's bin table
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.batch, 1, SEQ_LEN), generator=generator).to(device)
    return target, pipeline, ids


def ceiling_step(target: Transformer3, names: list[str], ids: torch.Tensor) -> torch.Tensor:
    """Mean gradient of the batch's mean loss by one ordinary batched backward (observed params only)."""
    params = dict(target.named_parameters())
    observed = [params[name] for name in names]
    target.train()
    with torch.enable_grad():
        for p in observed:
            p.requires_grad_(True)
        try:
            hidden = target.body(ids)
            logits = target.head(hidden[:, :-1])  # the last position predicts nothing
            loss = next_token_loss(logits, ids).mean()
            grads = torch.autograd.grad(loss, observed)
        finally:
            for p in observed:
                p.requires_grad_(False)
    return torch.cat([g.reshape(-1) for g in grads])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def memory_now(device: str) -> float:
    """MB: peak resident set so far (CPU) or currently allocated (CUDA)."""
    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def worker(args) -> dict:
    variant = args.worker
    if variant == "vmap":
        # Force the generic path: the next-token loss looks `per_example_gradients` up in its engine
        # module at call time, so in this (throw-away) worker process we point that name at the vmap
        # implementation.
        engine_module.per_example_gradients = per_example_gradients_vmap
    target, pipeline, ids = build(args, implementation="loop" if variant == "loop" else "vmap")
    flat = ids.view(-1, SEQ_LEN)
    generator = torch.Generator(device=args.device).manual_seed(1)
    if variant in ("loop", "fast", "vmap"):
        step = lambda: pipeline({"input_ids": ids}, generator=generator).features  # noqa: E731
    elif variant == "fast-grad":
        target.train()
        step = lambda: per_example_gradients(target, pipeline.names, flat)  # noqa: E731
    elif variant == "ceiling":
        step = lambda: ceiling_step(target, pipeline.names, flat)  # noqa: E731
    else:
        per_example = per_example_gradients(target, pipeline.names, flat).view(args.batch, 1, -1)

        def step():  # the steps of UpdatePipeline.forward after the per-sample gradients
            assert torch.isfinite(per_example).all()
            return pipeline.hasher(pipeline.defense(per_example, generator))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = memory_now(args.device)
    step()  # warm-up (allocator, kernels); counts towards the peak
    sync(args.device)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        sync(args.device)
        times.append(time.perf_counter() - start)
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = memory_now(args.device)
    return {"variant": variant, "times": times, "peak_mb": peak, "delta_mb": peak - before, "dim": pipeline.observed_dim}


def check(args) -> dict:
    """Max relative difference (max |a - b| / max |b|) of the per-sample gradients against the loop."""
    target, pipeline, ids = build(args)
    flat = ids.view(-1, SEQ_LEN)
    target.train()  # dropout is 0 in the default model, so the paths are comparable
    with torch.enable_grad():
        reference = per_example_gradients_loop(target, pipeline.names, flat)
        out = {}
        for name, fn in (("fast", per_example_gradients), ("vmap", per_example_gradients_vmap)):
            diff = (fn(target, pipeline.names, flat) - reference).abs().max() / reference.abs().max()
            out[name] = diff.item()
    return out


def run_child(args, role: str) -> dict:
    command = [
        sys.executable, "-m", "benchmarks.update_throughput", "--device", args.device, "--batch", str(args.batch),
        "--repeats", str(args.repeats), "--rounds", "1", "--defense", args.defense, "--worker", role,
    ]
    # Run from the repository root, where `-m benchmarks.update_throughput` resolves to this file.
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[1])
    if result.returncode != 0:
        raise RuntimeError(f"worker {role} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=64, help="client updates per call (one sequence each)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant and round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants")
    parser.add_argument("--defense", choices=tuple(DEFENSES), default="none")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--worker", choices=(*VARIANTS, "check"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available")
    if args.worker == "check":
        print(json.dumps(check(args)))
        return
    if args.worker:
        print(json.dumps(worker(args)))
        return

    runs: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    for round_index in range(args.rounds):
        shift = round_index % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            runs[variant].append(run_child(args, variant))
    rows = {}
    for variant, results in runs.items():
        times = [t for result in results for t in result["times"]]
        seconds = statistics.median(times)
        rows[variant] = {
            "seconds": seconds, "best": min(times), "updates_per_s": args.batch / seconds, "dim": results[0]["dim"],
            "peak_mb": max(r["peak_mb"] for r in results), "delta_mb": max(r["delta_mb"] for r in results),
        }
    diffs = run_child(args, "check")
    threads = torch.get_num_threads()
    print(
        f"Transformer3 defaults, observed D = {next(iter(rows.values()))['dim']:,}, batch {args.batch} updates x 1 "
        f"sequence x {SEQ_LEN} tokens, defense {args.defense}, device {args.device}, torch {torch.__version__}, "
        f"{threads} threads, median of {args.rounds} rounds x {args.repeats} calls"
    )
    memory = "peak GPU MB (max allocated)" if args.device == "cuda" else "peak RSS MB (increase)"
    print()
    print(f"| variant | includes | s / call (median, best) | updates/s | {memory} |")
    print("|---|---|---|---|---|")
    includes = {
        "loop": "per-sample loop + defense + hashing",
        "fast": "engine (vmap dispatch) + defense + hashing",
        "vmap": "generic vmap path + defense + hashing",
        "fast-grad": "engine, per-sample gradients only",
        "ceiling": "batched backward, mean gradient only",
        "post": "pipeline after the gradients: finite check + defense + hashing",
    }
    for variant, row in rows.items():
        mem = f"{row['peak_mb']:.0f}" if args.device == "cuda" else f"{row['peak_mb']:.0f} (+{row['delta_mb']:.0f})"
        print(
            f"| {variant} | {includes[variant]} | {row['seconds']:.3f} ({row['best']:.3f}) | "
            f"{row['updates_per_s']:.1f} | {mem} |"
        )
    print()

    def ratio(a: str, b: str) -> str:
        if a in rows and b in rows:
            return f"{rows[a]['updates_per_s'] / rows[b]['updates_per_s']:.2f}x"
        return "n/a"

    print(f"fast / ceiling = {ratio('fast', 'ceiling')} (target >= 0.8x); fast / loop = {ratio('fast', 'loop')} (target >= 1.5x)")
    print(f"fast-grad / ceiling = {ratio('fast-grad', 'ceiling')}; fast-grad / loop = {ratio('fast-grad', 'loop')}; fast / vmap = {ratio('fast', 'vmap')}")
    print(f"max relative difference vs loop (max|a-b| / max|b|): fast {diffs['fast']:.2e}, vmap {diffs['vmap']:.2e}")
    if any(not math.isfinite(v) for v in diffs.values()):
        raise SystemExit("non-finite difference")


if __name__ == "__main__":
    main()
