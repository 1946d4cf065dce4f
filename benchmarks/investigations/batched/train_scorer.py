"""Investigation: fit the batched search's learned scorer (`exact.batched.scorer`) on updates the server
simulates from its own auxiliary text, and compare it with the hand-set weights on held-out examples.

Training updates are B blocks of the auxiliary split between the whitening's blocks and its tail; the
held-out examples come from the tail (never read by the whitening or the fit). Prints, per B, the
fraction of extensions whose true token scores highest with the hand-set and the fitted weights, and
writes the weights (safetensors, atomic) and a JSON summary beside them.

    python -m benchmarks.investigations.batched.train_scorer --batch-sizes 4 8 --updates 12 \
        --out runs/scorer/smollm2_lora.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.investigations.batched.lora_batch import Setup


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/audit/inverter_smollm2_lora.yaml", help="the threat model")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--updates", type=int, default=12, help="training updates per B")
    parser.add_argument("--held-out-updates", type=int, default=3, help="tail updates per B to compare on")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lm-weight", type=float, default=0.5, help="the hand-set prior weight (the start)")
    parser.add_argument("--l2", type=float, default=1e-2)
    parser.add_argument("--picks-per-sequence", type=int, default=None,
                        help="bag recovery's picks per sequence (default: the sequence length)")
    parser.add_argument("--whitening-blocks", type=int, default=512)
    parser.add_argument("--whitening-cache", default="runs/whitening/smollm2_lora.safetensors")
    parser.add_argument("--out", required=True, help="the weights (.safetensors); a .json summary goes beside")
    parser.add_argument("--overwrite", action="store_true", help="replace weights already at --out")
    args = parser.parse_args(argv)
    if Path(args.out).exists() and not args.overwrite:
        raise SystemExit(f"{args.out} exists (an earlier fit); choose another --out or pass --overwrite")

    from exact.batched.bag import pick_budget, somp
    from exact.batched.scorer import ScorerWeights, accuracy_at_one, describe, extension_examples, fit_weights
    from exact.batched.search import SpanScorer
    from exact.batched.whitening import vocabulary_inputs
    from lti.atomic_files import write_text_atomically

    bench = Setup(args.config, args.whitening_blocks, args.whitening_cache)
    dictionary = vocabulary_inputs(bench.target) @ bench.whitening.vocabulary

    def examples(blocks: torch.Tensor, batch: int, count: int, seed: int) -> list:
        out = []
        for k in range(count):
            generator = torch.Generator().manual_seed(seed + 7919 * batch + k)
            ids = blocks[torch.randperm(blocks.shape[0], generator=generator)[:batch]]
            _, split = bench.observed(ids, args.lr)
            rows = [site.rows(split).double() for site in bench.sites]
            bag = somp(rows[0] @ bench.whitening.vocabulary, dictionary,
                       pick_budget(batch, ids.shape[1], args.picks_per_sequence)).tokens
            scorer = SpanScorer(rows, bench.whitening.sites)
            out += extension_examples(bench.target, bench.sites, scorer, bag, ids)
            print(f"B={batch} update {k + 1}/{count}: {len(out)} examples", flush=True)
        return out

    began = time.perf_counter()
    training, held_out = [], {}
    for batch in args.batch_sizes:
        training += examples(bench.training, batch, args.updates, 0)
        held_out[batch] = examples(bench.tail, batch, args.held_out_updates, 1_000_003)
    collected = time.perf_counter() - began
    start = ScorerWeights.hand_set(len(bench.sites), args.lm_weight)
    start.fingerprint = bench.fingerprint
    fitted = fit_weights(training, start, l2=args.l2)
    summary = {"command": "python -m benchmarks.investigations.batched.train_scorer " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "batch_sizes": args.batch_sizes, "updates": args.updates, "training_examples": len(training),
               "collect_seconds": round(collected, 1), "fit_seconds": round(time.perf_counter() - began - collected, 1),
               "train_top1": {"hand_set": accuracy_at_one(training, start), "fitted": accuracy_at_one(training, fitted)},
               "held_out_top1": {str(b): {"hand_set": accuracy_at_one(e, start), "fitted": accuracy_at_one(e, fitted),
                                          "examples": len(e)} for b, e in held_out.items()},
               "weights": json.loads(describe(fitted))}
    out = Path(args.out)
    fitted.save(out)
    write_text_atomically(out.with_suffix(".json"), json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
