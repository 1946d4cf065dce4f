"""`lti candidates build|fit`: the candidate-pointer attack's two commands.

    lti candidates build --config configs/audit/inverter_smollm2_lora.yaml --split auxiliary --out runs/candidates/aux.safetensors
    lti candidates build --config configs/audit/inverter_smollm2_lora.yaml --split evaluation --limit 512 --out runs/candidates/eval.safetensors
    lti candidates fit --train runs/candidates/aux.safetensors --eval runs/candidates/eval.safetensors --out_dir runs/candidates/fit
    lti candidates evaluate --pointer runs/candidates/fit/pointer.safetensors --eval runs/candidates/eval.safetensors --decode argmax lm
    # the second-layer check needs each update's second-layer gradient in the file: build with --second_layer

`build` simulates one update per block under the config's threat model (its target, client, defense)
and stores each update's candidates; `fit` trains the pointer on the training file's and evaluates on
the evaluation file's (held-out client text), writing `curve.csv`, checkpoints, the final weights
(`pointer.safetensors`) and `result.json` (the last evaluation, never the best) to --out_dir;
`evaluate` decodes a trained pointer's output with each rule of `lti.candidates.decoding`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from lti.atomic_files import write_text_atomically
from lti.candidates.decoding import DECODERS


def _at_least(args: argparse.Namespace, minimum: int, *names: str) -> None:
    """Refuses integer options below `minimum` (None: not given, allowed)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ValueError(f"--{name} {value} must be >= {minimum}")


def _check_build(args: argparse.Namespace) -> None:
    _at_least(args, 1, "count", "limit", "batch", "shards")
    _at_least(args, 0, "skip")


def _check_fit(args: argparse.Namespace) -> None:
    _at_least(args, 1, "max_steps", "val_every", "batch_size", "hidden", "layers", "heads")
    _at_least(args, 0, "holdout")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if not (math.isfinite(args.dropout) and 0 <= args.dropout < 1):
        raise ValueError(f"--dropout {args.dropout} must be in [0, 1)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr {args.lr} must be finite and > 0")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ValueError(f"--weight_decay {args.weight_decay} must be finite and >= 0")


def _check_evaluate(args: argparse.Namespace) -> None:
    _at_least(args, 1, "tail", "limit", "beam")
    bad = [w for w in (*args.lm_weight, *args.second_weight) if not (math.isfinite(w) and w >= 0)]
    if bad:
        raise ValueError(f"--lm_weight and --second_weight must be finite and >= 0, not {bad[0]}")


def _rows_to_evaluate(data, args: argparse.Namespace):
    """The blocks `--tail` and `--limit` select; a count beyond the files' blocks is refused (it would
    silently evaluate fewer blocks than asked, or, for --tail, blocks the pointer may have trained on)."""
    files = ", ".join(args.eval)
    if args.tail is not None:
        if args.tail > len(data):
            raise ValueError(f"--tail {args.tail}: {files} hold(s) {len(data)} blocks")
        data = data.tail(args.tail)
    if args.limit is not None:
        if args.limit > len(data):
            left = f"the last {args.tail} of {files}" if args.tail is not None else files
            raise ValueError(f"--limit {args.limit}: {left} hold(s) {len(data)} blocks")
        data = data.head(args.limit)
    return data


def _build(args: argparse.Namespace) -> None:
    from lti.candidates.evidence_file import build

    _check_build(args)

    for path in build(args.config, args.split, args.out, args.count, args.limit, args.overrides, args.batch,
                      args.device, args.shards, args.overwrite, args.skip, args.second_layer):
        print(f"wrote {path}")


def _fit(args: argparse.Namespace, argv: list[str]) -> None:
    from lti.candidates.module import fit

    _check_fit(args)
    print(json.dumps(fit(args, "lti candidates " + " ".join(argv)), indent=2))


def _evaluate(args: argparse.Namespace, argv: list[str]) -> None:
    import torch

    from datamodules.metrics import rouge_f
    from exact.span_evidence import SecondLayerEvidence
    from lti.candidates.decoding import decode_candidates
    from lti.candidates.evidence_file import check_pointer_fits, load
    from lti.candidates.weights import load_pointer
    from lti.trainer_cli import instantiate

    _check_evaluate(args)
    data = _rows_to_evaluate(load(args.eval), args)
    if not len(data):
        raise ValueError(f"no blocks to evaluate in {', '.join(args.eval)}")
    meta = data.metadata
    _, threat = instantiate(meta["config"], json.loads(meta["overrides"]))
    target = threat.pipeline.target
    pointer, trained_on = load_pointer(args.pointer, target.embedding_matrix)
    check_pointer_fits(data, trained_on, args.tail or 0, args.eval[0])
    second = None
    if "second_layer" in args.decode:
        if data.second_spaces is None:
            raise ValueError("decoding rule second_layer reads each update's second-layer gradient: build every "
                             "--eval file with --second_layer")
        second = SecondLayerEvidence(target, list(threat.pipeline.names), int(meta["seq_len"]))
    with torch.no_grad():
        logits = torch.cat([pointer(data.ids[i : i + 256], data.scores[i : i + 256], data.coefficients[i : i + 256])
                            for i in range(0, len(data), 256)])
    rows = []
    settings = [(rule, weight, check) for rule in args.decode
                for weight in (args.lm_weight if rule in ("lm", "second_layer") else [None])
                for check in (args.second_weight if rule == "second_layer" else [None])]
    for rule, weight, check in settings:
        start = time.perf_counter()
        preds = decode_candidates(data.ids, logits, rule, target.model, weight or 0.0, args.beam, second,
                                  data.second_spaces, check or 0.0)
        scores = [rouge_f(p, r) for p, r in zip(threat.decode(preds), threat.decode(data.truth))]
        row = {"decode": rule, "lm_weight": weight, "second_weight": check,
               "beam": args.beam if weight is not None else None,
               "blocks": len(data), "split": meta["split"], "token_acc": float((preds == data.truth).float().mean()),
               "exact_sequences": float((preds == data.truth).all(1).float().mean()),
               **{k: sum(s[k] for s in scores) / len(scores) for k in scores[0]},
               "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        write_text_atomically(args.out, json.dumps({"command": "lti candidates " + " ".join(argv), "rows": rows}, indent=2) + "\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lti candidates", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="simulate updates and store their span-test candidates")
    b.add_argument("--config", required=True, help="an `lti fit` config: its threat model makes the updates")
    b.add_argument("--split", default="auxiliary", help="the DataModule split whose blocks become updates")
    b.add_argument("--out", required=True, help="the .safetensors file to write")
    b.add_argument("--count", type=int, default=32, help="candidates per update (K)")
    b.add_argument("--limit", type=int, default=None, help="only LIMIT blocks (the split's first, after --skip)")
    b.add_argument("--skip", type=int, default=0, help="start at the split's block SKIP (e.g. a fit's held-out tail)")
    b.add_argument("--second_layer", action="store_true",
                   help="also store each update's second-layer gradient (for the second_layer decoding rule)")
    b.add_argument("--batch", type=int, default=64, help="updates simulated at once")
    b.add_argument("--device", default="cpu")
    b.add_argument("--shards", type=int, default=1, help="split the output into this many files")
    b.add_argument("--overwrite", action="store_true", help="replace existing files of the same names")
    b.add_argument("overrides", nargs="*", help="`lti fit` overrides of the config (after --)")
    f = sub.add_parser("fit", help="train the pointer and evaluate it on held-out candidates")
    f.add_argument("--train", nargs="+", required=True, help="training candidate files (the server's text)")
    f.add_argument("--eval", nargs="+", required=True, help="evaluation candidate files (held-out client text)")
    f.add_argument("--out_dir", required=True)
    f.add_argument("--max_steps", type=int, default=10_000)
    f.add_argument("--max_time", default=None, help="DD:HH:MM:SS: stop earlier")
    f.add_argument("--val_every", type=int, default=500)
    f.add_argument("--batch_size", type=int, default=128)
    f.add_argument("--hidden", type=int, default=256)
    f.add_argument("--layers", type=int, default=4)
    f.add_argument("--heads", type=int, default=4)
    f.add_argument("--dropout", type=float, default=0.1)
    f.add_argument("--lr", type=float, default=3e-4)
    f.add_argument("--weight_decay", type=float, default=0.01)
    f.add_argument("--accelerator", default="cpu")
    f.add_argument("--precision", default="32-true")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--ckpt_path", default=None, help="resume from this checkpoint")
    f.add_argument("--overwrite", action="store_true", help="replace an earlier run's files in --out_dir")
    f.add_argument("--holdout", type=int, default=0,
                   help="keep the training files' last HOLDOUT blocks out of training (to choose decoding settings on)")
    e = sub.add_parser("evaluate", help="score a trained pointer on candidate files, decoding rule by rule")
    e.add_argument("--pointer", required=True, help="pointer.safetensors from `lti candidates fit`")
    e.add_argument("--eval", nargs="+", required=True, help="candidate files to score")
    e.add_argument("--tail", type=int, default=None,
                   help="only the files' last TAIL blocks (a fit's --holdout; at most the files' blocks)")
    e.add_argument("--limit", type=int, default=None, help="then only the first LIMIT blocks (at most those left)")
    e.add_argument("--decode", nargs="+", default=["argmax"], choices=DECODERS)
    e.add_argument("--lm_weight", nargs="+", type=float, default=[0.5], help="weights of the global model's log-probability (lm)")
    e.add_argument("--second_weight", nargs="+", type=float, default=[1.0],
                   help="weights of the second-layer span test's score (second_layer)")
    e.add_argument("--beam", type=int, default=8)
    e.add_argument("--out", default=None, help="a JSON file of the rows")
    return p


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    try:
        if args.command == "build":
            _build(args)
        elif args.command == "fit":
            _fit(args, argv)
        else:
            _evaluate(args, argv)
    except (ValueError, FileNotFoundError) as error:
        print(f"lti candidates: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
