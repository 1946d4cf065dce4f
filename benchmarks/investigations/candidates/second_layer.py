"""What each part of the `second_layer` decoding contributes, and DAGER on the same updates (design page §10).

On candidate evidence built with `lti candidates build --second_layer`, the trained pointer's logits are
decoded four ways, each a beam search over the same candidates (width 8): the pointer with the global
model's prior (`lm`); the same plus the second-layer span test (`second_layer`); the test and the prior
without the pointer (its logits set to zero: what a server gets without learning); the pointer and the
test without the prior (`visible_token_acc`: the accuracy over the positions the second-layer test reads, all but
the last). With `--dager`, DAGER runs on each block's update, simulated again under the
file's threat model (deterministic at B = 1 without dropout: the update the candidates came from):

    python -m benchmarks.investigations.candidates.second_layer --pointer POINTER.safetensors \\
        --eval runs/candidates/eval512.safetensors --lm-weight 0.25 --second-weight 1.0 --dager --out rows.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from datamodules.metrics import ScoreTotals, score_batch

#: the decodings compared: (short name, row name)
WAYS = {"lm": "pointer + prior (lm)", "second_layer": "pointer + prior + second-layer test (second_layer)",
        "no_pointer": "prior + second-layer test, no pointer", "no_prior": "pointer + second-layer test, no prior"}


def is_the_files_update(spaces: torch.Tensor, stored: torch.Tensor, seq_len: int) -> bool:
    """Whether a block's second-layer gradient (d, width), simulated again, is the one stored in the file,
    up to float32 noise: the file's was computed in a batch, this one alone (other kernels, other thread
    splits; on another processor other SIMD sums), so the two differ in their last bits. Each entry sums
    over the block's positions and the hidden width d (the forward and backward passes' reductions); the
    difference is measured against the matrix's largest entry (an entry near zero keeps the rounding
    error of the large terms it came from: `rtol` on it failed CI on an AMD EPYC, issue 43). Another
    token or sequence moves the gradient by ~1e6 units of that noise."""
    from datamodules.float_noise import same_up_to_float_noise

    return same_up_to_float_noise(spaces, stored, terms=seq_len * spaces.shape[0])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pointer", required=True)
    parser.add_argument("--eval", nargs="+", required=True, help="candidate files built with --second_layer")
    parser.add_argument("--lm-weight", type=float, default=0.25)
    parser.add_argument("--second-weight", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--decodings", nargs="*", default=list(WAYS), choices=list(WAYS),
                        help="which of the four decodings to run (default: all)")
    parser.add_argument("--dager", action="store_true", help="also DAGER on each block's simulated update")
    parser.add_argument("--out", default=None, help="a JSON file of the rows")
    args = parser.parse_args(argv)

    from datamodules.atomic_files import write_text_atomically
    from exact.dager import Dager
    from exact.span_evidence import SecondLayerEvidence
    from lti.candidates.decoding import decode_candidates
    from lti.candidates.evidence_file import check_pointer_fits, load
    from lti.candidates.weights import load_pointer
    from lti.trainer_cli import instantiate

    data = load(args.eval)
    if args.limit:
        data = data.head(args.limit)
    if data.second_spaces is None:
        raise SystemExit(f"{args.eval[0]} holds no second-layer gradients: build it with --second_layer")
    meta = data.metadata
    _, threat = instantiate(meta["config"], json.loads(meta["overrides"]))
    pipeline = threat.pipeline
    target = pipeline.target
    pointer, trained_on = load_pointer(args.pointer, target.embedding_matrix)
    try:
        check_pointer_fits(data, trained_on, 0, args.eval[0])  # only blocks the pointer did not train on
    except ValueError as error:
        raise SystemExit(str(error)) from None
    second = SecondLayerEvidence(target, list(pipeline.names), int(meta["seq_len"]))
    with torch.no_grad():
        logits = torch.cat([pointer(data.ids[i : i + 256], data.scores[i : i + 256], data.coefficients[i : i + 256])
                            for i in range(0, len(data), 256)])
    lm, w, s = target.model, args.lm_weight, args.second_weight
    decode = threat.tokenizer.decode
    ways = {
        "lm": (logits, "lm", w, 0.0),
        "second_layer": (logits, "second_layer", w, s),
        "no_pointer": (torch.zeros_like(logits), "second_layer", w, s),
        "no_prior": (logits, "second_layer", 0.0, s),
    }
    rows = []

    def report(name: str, totals: ScoreTotals, seconds: float, visible: float) -> None:
        row = {"decoding": name, "blocks": len(data), **{k: v for k, v in totals.means().items() if k != "samples"},
               "visible_token_acc": visible, "seconds": round(seconds, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)

    for way in args.decodings:
        pointer_logits, rule, lm_weight, second_weight = ways[way]
        name, start = WAYS[way], time.perf_counter()
        preds = decode_candidates(data.ids, pointer_logits, rule, lm, lm_weight, 8, second, data.second_spaces, second_weight)
        totals = ScoreTotals()
        for pred, truth in zip(preds.tolist(), data.truth):
            totals.add(score_batch([pred], truth[None], None, decode))
        visible = float((preds[:, :-1] == data.truth[:, :-1]).float().mean())  # the positions the test reads
        report(name, totals, time.perf_counter() - start, visible)
    if args.dager:
        dager, totals, start, hits = Dager(), ScoreTotals(), time.perf_counter(), 0
        for i, truth in enumerate(data.truth):
            update = pipeline.split(pipeline({"input_ids": truth[None, None]}, keep_update=True).update)
            spaces = second.input_spaces(update)[0]
            if not is_the_files_update(spaces, data.second_spaces[i], int(meta["seq_len"])):
                raise SystemExit(f"block {i}: the update simulated again is not the one the file's candidates came from")
            result = dager.attack(target, {k: v[0] for k, v in update.items()}, batch_size=1, max_length=truth.shape[0])
            totals.add(score_batch(result.sequences, truth[None], None, decode, result.exact))
            found = result.sequences[0] if result.sequences else []
            hits += sum(int(a == b) for a, b in zip(found, truth[:-1].tolist()))
        report("DAGER", totals, time.perf_counter() - start, hits / (len(data) * (data.truth.shape[1] - 1)))
    if args.out:
        write_text_atomically(args.out, json.dumps({"command": "python -m benchmarks.investigations.candidates.second_layer "
                                                    + " ".join(argv if argv is not None else sys.argv[1:]),
                                                    "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
