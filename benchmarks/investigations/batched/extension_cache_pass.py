"""Investigation: what the extension cache (`exact.batched.search.ExtensionCache`) saves in one refinement pass.

One update of B sequences (the auxiliary tail by default: settings are chosen there), the joint search once, then
the same refinement pass four times in one process, each timed: without the cache, with an empty cache (it fills),
with that cache full (the same pass again: every extension held, the best case), and without the cache again
(bracketing the machine's drift). Prints one JSON line: the seconds of each, the extensions computed and reused,
and whether every pass regrew the same sequences.

    python -m benchmarks.investigations.batched.extension_cache_pass --batch-size 8 --update 1 \\
        --out docs/results/audit/batched/auxiliary_tail/extension_cache_pass.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    from benchmarks.investigations.batched.lora_batch import Setup
    from exact.batched import BatchedLoRA, BatchedOptions
    from exact.batched.search import ExtensionCache, SpanScorer, grow_sequences, refine_sequences

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/audit/inverter_smollm2_lora.yaml")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--update", type=int, default=1, help="the update's index (its draw's seed), as lora_batch")
    parser.add_argument("--split", choices=["evaluation", "auxiliary_tail"], default="auxiliary_tail")
    parser.add_argument("--cache-gib", type=float, default=6.0)
    parser.add_argument("--whitening-cache", default="runs/whitening/smollm2_lora.safetensors")
    parser.add_argument("--out", required=True, help="JSONL file: one line per run")
    args = parser.parse_args(argv)

    bench = Setup(args.config, 512, args.whitening_cache)
    batch = args.batch_size
    ids = bench.draw(args.split, batch, args.update)
    _, update = bench.observed(ids, 0.05, seed=7919 * batch + args.update)
    options = BatchedOptions()
    attack = BatchedLoRA(bench.target, bench.names, bench.whitening, options)
    rows = [site.rows(update).double() for site in attack.sites]
    bag = attack.bag(update, rows, batch, ids.shape[1])
    scorer = SpanScorer(rows, bench.whitening.sites)
    began = time.perf_counter()
    sequences, _ = grow_sequences(bench.target, attack.sites, scorer, bag, batch, ids.shape[1], options.lm_weight,
                                  beam=options.beam, screen_sites=options.screen_sites, shortlist=options.shortlist)
    row = {"B": batch, "update": args.update, "split": args.split, "search_seconds": round(time.perf_counter() - began, 1)}
    cache = ExtensionCache(int(args.cache_gib * 2**30))
    results = []
    for name, used in (("without", None), ("filling", cache), ("full", cache), ("without_again", None)):
        before = (cache.computed, cache.reused)
        began = time.perf_counter()
        results.append(refine_sequences(bench.target, attack.sites, scorer, bag, sequences, options.lm_weight,
                                        cache=used, **attack._refinement(batch)))
        row[f"{name}_seconds"] = round(time.perf_counter() - began, 1)
        if used is not None:
            row[f"{name}_extensions"] = {"computed": cache.computed - before[0], "reused": cache.reused - before[1]}
    row["same_sequences"] = all(r == results[0] for r in results)
    row["cache_gib_held"] = round(cache.bytes / 2**30, 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as log:
        log.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
