"""How much of a LoRA update of B sequences the span test's candidates still hold (why the pointer reads B = 1 only).

For B = 1, 2, 4 one-step updates of an `lti fit` config's threat model (SmolLM2, LoRA r = 8 on q/v: 16 span
directions for 15 B token inputs), the share of the visible tokens (all but each sequence's label-only
last) among the K candidates closest to the first layer's span, and the second-layer score (the
`second_layer` decoding's -log(distance + 1e-4), span capped at its 2r directions) of the true prefixes
against random ones:

    python -m benchmarks.investigations.candidates.batch_ceiling --threat-model configs/audit/inverter_smollm2_lora.yaml
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threat-model", required=True, help="an `lti fit` config with a RoPE LoRA target")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--counts", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--out", default=None, help="a JSON file of the rows")
    args = parser.parse_args(argv)
    from datamodules.atomic_files import write_text_atomically
    from exact.span_evidence import CandidateEvidence, SecondLayerEvidence, SpanEvidence
    from lti.trainer_cli import instantiate

    rows = []
    for b in args.batch_sizes:
        _, data = instantiate(args.threat_model, ["--data.client.init_args.local.init_args.samples_per_update", str(b)])
        data.setup("fit")
        pipeline, length = data.pipeline, data.seq_len
        blocks = data.blocks("evaluation")[0]
        if len(blocks) < args.updates * b:
            raise SystemExit(f"--updates {args.updates} of B = {b} need {args.updates * b} blocks; the split has {len(blocks)}")
        ids = blocks[: args.updates * b].view(args.updates, b, length)
        update = pipeline.split(pipeline({"input_ids": ids}, keep_update=True).update)
        evidence = SpanEvidence(pipeline.target, list(pipeline.names), b * length, length)
        row = {"batch_size": b, "updates": args.updates}
        for k in args.counts:
            found = CandidateEvidence(evidence, k)(update)
            visible = ids[:, :, :-1].reshape(args.updates, -1)
            row[f"visible_tokens_in_top_{k}"] = float(torch.stack([torch.isin(visible[u], found.ids[u]).float().mean()
                                                                   for u in range(args.updates)]).mean())
        second = SecondLayerEvidence(pipeline.target, list(pipeline.names), length)
        second.visible = b * (length - 1)  # the span's rank cap: every visible input of the batch
        ranges = second.ranges(second.input_spaces(update))
        torch.manual_seed(0)
        for name, tokens in (("true", ids), ("random", torch.randint(0, ids.max().item() + 1, ids.shape))):
            scores = []
            for s in range(b):
                cache = None
                for p in range(length - 1):
                    score, cache = second.extend(tokens[:, s, p], p, ranges, cache)
                    scores.append(score[:, 0])
            row[f"second_layer_score_{name}"] = float(torch.stack(scores).mean())
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        command = "python -m benchmarks.investigations.candidates.batch_ceiling " + " ".join(argv if argv is not None else sys.argv[1:])
        write_text_atomically(args.out, json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
