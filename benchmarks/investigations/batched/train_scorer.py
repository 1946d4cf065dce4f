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
    parser.add_argument("--examples", default=None,
                        help="a file of the collected examples: read when it exists (same options), else written, so "
                             "other fits of the same examples take seconds")
    parser.add_argument("--state", default="search", choices=["search", "refine"],
                        help="the examples fitted on: the joint search's deflation or a refinement pass's (every other "
                             "sequence whole; its fit is reported, no weights file written); both are collected and "
                             "reported")
    parser.add_argument("--add-to", default=None,
                        help="a scorer file whose sets for other batch sizes the output keeps beside the new fit")
    parser.add_argument("--compare", nargs="*", default=[],
                        help="scorer weights files whose held-out top-1 is reported beside the fit's")
    args = parser.parse_args(argv)
    for earlier in (Path(args.out), Path(args.out).with_suffix(".json")):  # a refinement-state fit writes the summary only
        if earlier.exists() and not args.overwrite:
            raise SystemExit(f"{earlier} exists (an earlier fit); choose another --out or pass --overwrite")

    from datamodules.atomic_files import write_text_atomically
    from exact.batched.bag import pick_budget, somp
    from exact.batched.scorer import (
        STATES,
        ScorerWeights,
        accuracy_at_one,
        describe,
        examples_by_state,
        fit_weights,
        load_scorers,
        nearest,
        save_scorers,
    )
    from exact.batched.search import SpanScorer
    from exact.batched.whitening import vocabulary_inputs

    bench = Setup(args.config, args.whitening_blocks, args.whitening_cache)
    dictionary = vocabulary_inputs(bench.target) @ bench.whitening.vocabulary

    def examples(blocks: torch.Tensor, batch: int, count: int, seed: int) -> list:
        out = {state: [] for state in STATES}
        for k in range(count):
            generator = torch.Generator().manual_seed(seed + 7919 * batch + k)
            ids = blocks[torch.randperm(blocks.shape[0], generator=generator)[:batch]]
            _, split = bench.observed(ids, args.lr)
            rows = [site.rows(split).double() for site in bench.sites]
            bag = somp(rows[0] @ bench.whitening.vocabulary, dictionary,
                       pick_budget(batch, ids.shape[1], args.picks_per_sequence)).tokens
            scorer = SpanScorer(rows, bench.whitening.sites)
            for state, found in examples_by_state(bench.target, bench.sites, scorer, bag, ids).items():
                out[state] += found
            print(f"B={batch} update {k + 1}/{count}: {len(out['search'])} examples per state", flush=True)
        return out

    began = time.perf_counter()
    key = {"config": args.config, "batch_sizes": args.batch_sizes, "updates": args.updates,
           "held_out_updates": args.held_out_updates, "lr": args.lr, "picks_per_sequence": args.picks_per_sequence,
           "whitening_blocks": args.whitening_blocks, "fingerprint": bench.fingerprint}
    if args.examples and Path(args.examples).exists():
        training, held_out = load_examples(args.examples, key)
    else:
        training, held_out = {state: [] for state in STATES}, {}
        for batch in args.batch_sizes:
            for state, found in examples(bench.training, batch, args.updates, 0).items():
                training[state] += found
            held_out[batch] = examples(bench.tail, batch, args.held_out_updates, 1_000_003)
        if args.examples:
            save_examples(args.examples, key, training, held_out)
    collected = time.perf_counter() - began
    start = ScorerWeights.hand_set(len(bench.sites), args.lm_weight)
    start.fingerprint = bench.fingerprint
    fitted = fit_weights(training[args.state], start, l2=args.l2)
    fitted.batch_sizes = tuple(args.batch_sizes)
    compared = {"hand_set": start, "fitted": fitted}
    others = {name: load_scorers(name, bench.fingerprint, len(bench.sites)) for name in args.compare}

    def weights_of(name: str, batch: int | None) -> ScorerWeights:
        """The fit, the hand-set weights, or a compared file's set for `batch` (nearest it; its first without one)."""
        if name in compared:
            return compared[name]
        return nearest(others[name], batch) if batch else others[name][0]
    summary = {"command": "python -m benchmarks.investigations.batched.train_scorer " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "batch_sizes": args.batch_sizes, "updates": args.updates, "fitted_on_state": args.state,
               "training_examples": len(training[args.state]), "collect_seconds": round(collected, 1),
               "fit_seconds": round(time.perf_counter() - began - collected, 1),
               "train_top1": {name: accuracy_at_one(training[args.state], weights_of(name, None))
                              for name in [*compared, *others]},
               # per B and state: the fraction of held-out extensions whose true token each scorer ranks first
               "held_out_top1": {str(b): {state: {"examples": len(e)} | {name: accuracy_at_one(e, weights_of(name, b))
                                                                        for name in [*compared, *others]}
                                          for state, e in by_state.items()} for b, by_state in held_out.items()},
               "weights": json.loads(describe(fitted))}
    out = Path(args.out)
    if args.state == "search":
        # Another file's sets for other batch sizes are kept (a set sharing a batch size with this fit is replaced),
        # so each B the attack reads takes the set fitted nearest it.
        kept = [g for g in (load_scorers(args.add_to, bench.fingerprint, len(bench.sites)) if args.add_to else [])
                if not set(g.batch_sizes) & set(fitted.batch_sizes)]
        if any(not g.batch_sizes for g in kept):
            raise SystemExit(f"{args.add_to} holds a set for any B, which cannot share a file with sets for given B")
        save_scorers(out, kept + [fitted])
        summary["file_batch_sizes"] = [list(g.batch_sizes) for g in kept + [fitted]]
    else:  # the attack's search reads a weights file: weights fitted on refinement's state are reported only
        print(f"fitted on the {args.state} state: the summary only, no weights file the search would read")
    write_text_atomically(out.with_suffix(".json"), json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def save_examples(path: str, key: dict, training: dict, held_out: dict) -> None:
    """The examples ({state: examples} for training, {B: {state: examples}} held out) as plain tensors, read back
    with weights_only=True; written atomically."""
    from datamodules.atomic_files import atomic_writer

    def pack(examples: list) -> dict:
        return {"terms": [e.terms for e in examples], "prior": [e.prior for e in examples],
                "true": torch.tensor([e.true for e in examples], dtype=torch.long)}

    with atomic_writer(path) as file:
        torch.save({"key": json.dumps(key, sort_keys=True),
                    "training": {state: pack(e) for state, e in training.items()},
                    "held_out": {str(b): {state: pack(e) for state, e in by_state.items()}
                                 for b, by_state in held_out.items()}}, file)


def load_examples(path: str, key: dict) -> tuple[dict, dict]:
    """The examples `save_examples` wrote; SystemExit (one line) when they were collected with other options."""
    from exact.batched.scorer import Example

    saved = torch.load(path, weights_only=True)
    if saved["key"] != json.dumps(key, sort_keys=True):
        raise SystemExit(f"{path} holds examples collected with other options ({saved['key']})")

    def unpack(packed: dict) -> list:
        return [Example(t, p, int(k)) for t, p, k in zip(packed["terms"], packed["prior"], packed["true"])]

    return ({state: unpack(e) for state, e in saved["training"].items()},
            {int(b): {state: unpack(e) for state, e in by_state.items()} for b, by_state in saved["held_out"].items()})


if __name__ == "__main__":
    main()
