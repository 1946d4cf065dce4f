"""`lti candidates build|fit|evaluate`: the candidate-pointer attack's commands.

    lti candidates build --config configs/audit/inverter_smollm2_lora.yaml --split auxiliary --out runs/candidates/aux.safetensors
    lti candidates build --config configs/audit/inverter_smollm2_lora.yaml --split evaluation --limit 512 --out runs/candidates/eval.safetensors
    lti candidates fit --train '[runs/candidates/aux.safetensors]' --eval '[runs/candidates/eval.safetensors]' --out_dir runs/candidates/fit
    lti candidates evaluate --pointer runs/candidates/fit/pointer.safetensors --eval '[runs/candidates/eval.safetensors]' --decode '[argmax, lm]'
    # the second-layer check needs each update's second-layer gradient in the file: build with --second_layer

`build` simulates one update per block under the config's threat model (its target, client, defense)
and stores each update's candidates; `fit` trains the pointer on the training file's and evaluates on
the evaluation file's (held-out client text), writing `curve.csv`, checkpoints, the final weights
(`pointer.safetensors`) and `result.json` (the last evaluation, never the best) to --out_dir;
`evaluate` decodes a trained pointer's output with each rule of `lti.candidates.decoding`.

Each command's options are a dataclass of `lti.candidates.options`, parsed by jsonargparse
(`lti.command_line`): `fit` and `evaluate` also read them from `--config FILE` (`build`'s
`--config` is the threat model's `lti fit` config, as before). Lists are written `--eval '[a, b]'`;
the argparse spelling `--eval a b` still works, with one line on stderr.
"""

from __future__ import annotations

import json
import shlex
import sys
import time

from datamodules.atomic_files import write_text_atomically
from lti.candidates.options import BuildOptions, EvaluateOptions, FitOptions

#: The commands, their options and whether they read a `--config FILE` of them (`build`'s `--config`
#: names the threat model instead).
COMMANDS: dict[str, tuple[type, bool]] = {"build": (BuildOptions, False), "fit": (FitOptions, True),
                                          "evaluate": (EvaluateOptions, True)}


def _rows_to_evaluate(data, args: EvaluateOptions):
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


def _build(args: BuildOptions) -> None:
    from lti.candidates.evidence_file import build

    for path in build(args.config, args.split, args.out, args.count, args.limit, args.overrides, args.batch,
                      args.device, args.shards, args.overwrite, args.skip, args.second_layer):
        print(f"wrote {path}")


def _fit(args: FitOptions, argv: list[str]) -> None:
    from lti.candidates.module import fit

    print(json.dumps(fit(args, "lti candidates " + shlex.join(argv)), indent=2))


def _evaluate(args: EvaluateOptions, argv: list[str]) -> None:
    import torch

    from datamodules.metrics import rouge_f
    from exact.span_evidence import SecondLayerEvidence
    from lti.candidates.decoding import decode_candidates
    from lti.candidates.evidence_file import check_pointer_fits, load
    from lti.candidates.weights import load_pointer
    from lti.trainer_cli import instantiate

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
        write_text_atomically(args.out, json.dumps({"command": "lti candidates " + shlex.join(argv), "rows": rows}, indent=2) + "\n")


def _usage() -> str:
    width = max(map(len, COMMANDS))
    commands = "\n".join(f"  {name:<{width}}  {options.__doc__.splitlines()[0]}" for name, (options, _) in COMMANDS.items())
    return (f"usage: lti candidates {{{','.join(COMMANDS)}}} [options]\n\n{__doc__.splitlines()[0]}\n\n{commands}\n\n"
            "`lti candidates COMMAND --help` lists a command's options.")


def parse(argv: list[str]) -> tuple[str, BuildOptions | FitOptions | EvaluateOptions]:
    """`COMMAND --option value ...` -> the command and its options, checked; bad input: one line, exit 2."""
    from lti.command_line import parse_options

    if not argv or argv[0] in ("-h", "--help"):
        if argv:
            print(_usage())
            raise SystemExit(0)
        print(f"lti candidates: error: name a command: {', '.join(COMMANDS)} (`lti candidates --help`)", file=sys.stderr)
        raise SystemExit(2)
    command = argv[0]
    if command not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"lti candidates: error: unknown command '{command}'{hint}; the commands are {', '.join(COMMANDS)}",
              file=sys.stderr)
        raise SystemExit(2)
    options, config_file = COMMANDS[command]
    return command, parse_options(f"lti candidates {command}", options, argv[1:], error_prefix="lti candidates",
                                  config_file=config_file, positional="overrides" if command == "build" else None)


def main(argv: list[str]) -> None:
    command, args = parse(argv)
    try:
        if command == "build":
            _build(args)
        elif command == "fit":
            _fit(args, argv)
        else:
            _evaluate(args, argv)
    except (ValueError, FileNotFoundError) as error:
        print(f"lti candidates: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
