"""Investigation: what refinement passes propose, against the truth.

Runs `lora_batch` (its arguments, after `--proposals FILE`) with every refinement pass logged: one JSON line a pass
(B, update, and per sequence: whether the pass proposed it unchanged, the first position where the proposal differs
from the current sequence, the first wrong position of the current sequence and of the proposal, each against the
true sequence it matches best). This is how a pass from the start was seen to trade right prefixes for wrong ones
where the other sequences are partly wrong (docs/audit.md, "Resumed refinement").

    python -m benchmarks.investigations.batched.refine_proposals --proposals \\
        docs/results/audit/batched/auxiliary_tail/b8_refine_proposals.jsonl -- --split auxiliary_tail \\
        --batch-sizes 8 --updates 1 --second-opinion checkpoints/audit/batched_scorer_smollm2_lora.safetensors \\
        --out runs/refine_proposals/b8.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first input position (the last token is a label) where `a` and `b` differ, or None."""
    return next((p for p in range(len(a) - 1) if a[p] != b[p]), None)


def proposal_record(current: list[int], proposed: list[int], truth: list[list[int]]) -> dict:
    """One sequence of a pass: what the pass proposed against what it had, both against the best-matching truth."""
    best = max(truth, key=lambda t: sum(x == y for x, y in zip(t[:-1], current[:-1])))
    changed = first_difference(current, proposed)
    return {"same": changed is None, "first_diff": changed, "first_wrong": first_difference(current, best),
            "new_first_wrong": first_difference(proposed, best)}


def main(argv: list[str] | None = None) -> None:
    import exact.batched.attack as attack_module
    from benchmarks.investigations.batched import lora_batch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proposals", required=True, help="JSONL file: one line per refinement pass (appended)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="lora_batch's arguments, after --")
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    log = Path(args.proposals)
    log.parent.mkdir(parents=True, exist_ok=True)
    drawn: dict = {}
    draw, refine = lora_batch.Setup.draw, attack_module.refine_sequences

    def recorded_draw(self, split, batch, k):
        ids = draw(self, split, batch, k)
        drawn.update(ids=ids.tolist(), update=k)
        return ids

    def recorded_refine(target, sites, scorer, bag, sequences, *rest_args, **kwargs):
        proposed = refine(target, sites, scorer, bag, sequences, *rest_args, **kwargs)
        line = {"B": len(sequences), "update": drawn["update"],
                "sequences": [proposal_record(c, p, drawn["ids"]) for c, p in zip(sequences, proposed)]}
        with log.open("a") as file:  # a line a pass, as they come (a long run's log survives its interruption)
            file.write(json.dumps(line) + "\n")
        return proposed

    lora_batch.Setup.draw, attack_module.refine_sequences = recorded_draw, recorded_refine
    try:
        lora_batch.main(rest)
    finally:
        lora_batch.Setup.draw, attack_module.refine_sequences = draw, refine


if __name__ == "__main__":
    main()
