"""Benchmark: seconds of the search's forward passes, eager attention against fused (SDPA), at one position.

A search's time is its extensions' forward passes: every prefix of every sequence's beam extended by every bag
token, run from a copy of the prefixes' key/value cache (`exact.batched.search.Prefixes.extend`), through the
screen's first sites, then a shortlist through every site. Here one update's true prefixes at position
`--position` (each repeated `--beam` times, as a beam's rows) are extended by every bag token (the update's
distinct input tokens) through `--screen-sites` sites and through every site, `--repeats` times in each attention,
alternating (so a machine's drift falls on both), and the minimum and median seconds are printed with the
extensions' count, one JSON line. The extensions' inputs are checked to agree between the two attentions. The
auxiliary tail.

    python -m benchmarks.investigations.batched.extension_speed --batch-size 4 --position 8 \
        >> docs/results/audit/batched/auxiliary_tail/extension_speed.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch
from torch import Tensor, nn


def time_extensions(target: nn.Module, sites: list, prefixes: Tensor, tokens: Tensor, beam: int,
                    screen_sites: int, repeats: int) -> dict[str, dict[str, float]]:
    """{"eager" | "fused": {"screen_min", "screen_median", "all_min", "all_median": seconds}} of extending each of
    `prefixes` (B, p), as `beam` rows each, by every token of `tokens`; plus {"agreement": largest relative
    difference of the two attentions' site inputs}."""
    from exact.batched.search import Prefixes, fused_attention

    rows_of_beam = torch.arange(prefixes.shape[0]).repeat_interleave(beam)
    run_ids = prefixes[rows_of_beam]
    rows = torch.arange(run_ids.shape[0]).repeat_interleave(tokens.numel())
    extended_by = tokens.repeat(run_ids.shape[0])
    seconds: dict[str, dict[str, list[float]]] = {m: {"screen": [], "all": []} for m in ("eager", "fused")}
    inputs: dict[str, list[Tensor]] = {}
    for _ in range(repeats):
        for mode in ("eager", "fused"):
            with fused_attention(target) if mode == "fused" else nullcontext():
                run = Prefixes(target, sites, run_ids)
                began = time.perf_counter()
                run.extend(rows, extended_by, screen_sites)
                seconds[mode]["screen"].append(time.perf_counter() - began)
                began = time.perf_counter()
                inputs[mode] = run.extend(rows, extended_by)
                seconds[mode]["all"].append(time.perf_counter() - began)
    out: dict[str, dict[str, float]] = {
        mode: {f"{part}_{stat}": round(fn(values), 6) for part, values in parts.items()
               for stat, fn in (("min", min), ("median", statistics.median))}
        for mode, parts in seconds.items()}
    out["agreement"] = {"largest_relative_difference": max(
        float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(inputs["fused"], inputs["eager"]))}
    return out


def main(argv: list[str] | None = None) -> None:
    from benchmarks.investigations.batched.lora_batch import Setup
    from exact.batched import BatchedOptions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/audit/inverter_smollm2_lora.yaml")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--update", type=int, default=1, help="the update's index (its draw's seed), as lora_batch")
    parser.add_argument("--position", type=int, default=8, help="the prefixes' length")
    parser.add_argument("--beam", type=int, default=BatchedOptions.beam)
    parser.add_argument("--screen-sites", type=int, default=BatchedOptions.screen_sites)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whitening-cache", default="runs/whitening/smollm2_lora.safetensors")
    args = parser.parse_args(argv)
    bench = Setup(args.config, 512, args.whitening_cache)
    ids = bench.draw("auxiliary_tail", args.batch_size, args.update)
    tokens = ids[:, :-1].flatten().unique()
    result = time_extensions(bench.target, bench.sites, ids[:, : args.position], tokens, args.beam,
                             args.screen_sites, args.repeats)
    extensions = args.batch_size * args.beam * tokens.numel()
    print(json.dumps({"B": args.batch_size, "update": args.update, "position": args.position, "beam": args.beam,
                      "bag": tokens.numel(), "extensions": extensions, "screen_sites": args.screen_sites,
                      "threads": torch.get_num_threads(), **result}))


if __name__ == "__main__":
    main()
