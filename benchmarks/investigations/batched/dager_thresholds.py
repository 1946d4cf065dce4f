"""Investigation: DAGER's span-test thresholds on updates read off float32 returned weights, with and without
Flower's fixed clipping.

A server reads a client's update as (w - returned) / lr from the float32 weights it returns. Their rounding is
fixed in size, the client's step is not: clipped to a small norm, the step's rounding moves a true token's input
off the gradient's span by more than the paper's first- and second-layer thresholds (1e-3; its simulated
gradients have no such rounding). For each update (B = `--batch-size` held-out blocks, the draws of
`lora_batch`), without a defense and clipped to `--clip-norm`, DAGER runs at each threshold in `--thresholds`
(first and second layer alike); one JSON line per run: token accuracy, DAGER's mode and seconds, and
`--margins`: the true tokens' largest and median first-layer distance to the span and the nearest wrong token's.
The auxiliary tail by default: settings are chosen there.

    python -m benchmarks.investigations.batched.dager_thresholds --batch-size 1 --updates 8 \\
        --thresholds 1e-3 1e-2 3e-2 --margins --out docs/results/audit/dager_thresholds/auxiliary_tail_b1.jsonl
"""

from __future__ import annotations

import argparse

import torch


def first_layer_margins(dager, target, split: dict, ids: torch.Tensor, rank: int | None) -> dict:
    """The true visible tokens' largest and median distance to the first layer's span, and the nearest other
    token's (position-free inputs: a RoPE model's first layer)."""
    from exact.dager.span import span_basis

    layers = dager.layers(target)
    basis = span_basis(layers.first.input_space(split, dager.options.span.blocks), dager.options.span.rank_tol,
                       rank)
    vocabulary = layers.inputs.embedding.shape[0]
    distances = basis.distance(layers.inputs(torch.arange(vocabulary), None, torch.float64))
    true = sorted(set(ids[:, :-1].flatten().tolist()))
    others = torch.ones(vocabulary, dtype=torch.bool)
    others[true] = False
    return {"true_max": float(distances[true].max()), "true_median": float(distances[true].median()),
            "other_min": float(distances[others].min()), "rank": basis.rank}


def main(argv: list[str] | None = None) -> None:
    from benchmarks.investigations.batched.lora_batch import RowLog, Setup, dager_row
    from exact.dager import Dager

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/audit/inverter_smollm2_lora.yaml", help="the threat model")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--split", choices=["evaluation", "auxiliary_tail"], default="auxiliary_tail")
    parser.add_argument("--lr", type=float, default=0.05, help="the clients' learning rate (the audit's default)")
    parser.add_argument("--clip-norm", type=float, default=0.01, help="Flower's fixedclipping_mod's norm")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--margins", action="store_true", help="also the first layer's distances (B = 1's rank)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    bench = Setup(args.config, 256, "runs/whitening/smollm2_lora.safetensors")
    decode = lambda t: bench.data.tokenizer.decode(t)  # noqa: E731
    with RowLog(args.out) as log:
        for k in range(args.updates):
            ids = bench.draw(args.split, args.batch_size, k)
            for clip in (None, args.clip_norm):
                update, split = bench.observed(ids, args.lr, clip)
                for threshold in args.thresholds:
                    found = dager_row(update, bench.threat, args.batch_size, ids, decode, threshold=threshold)
                    log.write({"B": args.batch_size, "update": k, "split": args.split, "clip_norm": clip,
                               "threshold": threshold, "token_acc": found["token_acc"], "mode": found["mode"],
                               "seconds": found["seconds"]})
                if args.margins:
                    log.write({"B": args.batch_size, "update": k, "split": args.split, "clip_norm": clip,
                               "margins": first_layer_margins(Dager(), bench.target, split, ids,
                                                              args.batch_size * (ids.shape[1] - 1))})


if __name__ == "__main__":
    main()
