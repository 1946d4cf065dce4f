"""The batched attack's table of cells (batch size, defense, protocol, rank, sequence length): for each cell the
batched attack with and without its learned scorer, DAGER on the same updates, and the stronger, from the JSON
lines `benchmarks.investigations.batched.lora_batch` writes; prints the table docs/audit.md quotes.

    python -m benchmarks.tools.batched_cells docs/results/audit/batched/cells.json

The manifest lists the cells in order: {"cells": [{"cell": name, "B": batch size, "batched": [files],
"dager": [files]}, ...]}, files relative to the manifest's folder; a cell's rows are those of its B, a later
file's row replacing an earlier one's of the same update. DAGER is scored on the updates the batched attack read
(`lora_batch --attacks dager` on the same draws), and only where it ran on all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def cell_rows(folder: Path, files: list[str], batch: int, dager: bool = False) -> dict[int, dict]:
    """{update: row} of batch size `batch` in `files` (later files replace earlier rows); `dager`: DAGER's scores
    (each row's `dager`) instead of the batched attack's."""
    out: dict[int, dict] = {}
    for name in files:
        if not (folder / name).is_file():
            raise SystemExit(f"{folder / name} does not exist (run lora_batch for it, or take it off the manifest)")
        for line in (folder / name).read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if int(row["B"]) != batch:
                continue
            if dager:
                if "dager" in row:
                    out[int(row["update"])] = row["dager"]
            elif "token_acc" in row:
                out[int(row["update"])] = row
    return out


def hand_set_accuracy(row: dict) -> float:
    """The hand-set search's token accuracy on an update (the attack without its learned scorer): the kept result's,
    unless the learned second opinion was kept, whose other result is the hand-set one."""
    return row["other_token_acc"] if row.get("second_opinion") else row["token_acc"]


def summary(cell: dict, folder: Path) -> dict:
    """One cell's means over its updates (percent), the batched attack's and DAGER's."""
    rows = cell_rows(folder, cell["batched"], int(cell["B"]))
    if not rows:
        raise SystemExit(f"cell {cell['cell']!r}: no B = {cell['B']} rows in {', '.join(cell['batched'])}")
    updates = sorted(rows)
    ordered = [rows[k] for k in updates]
    mean = lambda values: 100 * statistics.fmean(values)  # noqa: E731
    out = {"cell": cell["cell"], "B": int(cell["B"]), "L": int(ordered[0]["L"]), "updates": len(updates),
           "token_acc": mean(r["token_acc"] for r in ordered), "hand_set": mean(hand_set_accuracy(r) for r in ordered),
           "rouge1": mean(r["rouge1"] for r in ordered), "rouge2": mean(r["rouge2"] for r in ordered),
           "exact": mean(r["exact"] for r in ordered), "certified": sum(bool(r["certified"]) for r in ordered),
           "seconds": statistics.median(r["seconds"] for r in ordered), "dager": None}
    dager = cell_rows(folder, cell.get("dager", []), int(cell["B"]), dager=True)
    if dager and all(k in dager for k in updates):
        out["dager"] = mean(dager[k]["token_acc"] for k in updates)
        out["dager_seconds"] = statistics.median(dager[k]["seconds"] for k in updates)
    return out


def table(summaries: list[dict]) -> str:
    lines = ["| cell | B | L | updates | DAGER | batched, hand-set | **batched** (default) | ROUGE-1 / 2 | exact seq. | "
             "certified | s / update (median) | stronger |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        dager = "not run" if s["dager"] is None else f"{s['dager']:.1f}"
        stronger = "batched" if s["dager"] is None or s["token_acc"] >= s["dager"] else "DAGER"
        lines.append(f"| {s['cell']} | {s['B']} | {s['L']} | {s['updates']} | {dager} | {s['hand_set']:.1f} | "
                     f"**{s['token_acc']:.1f}** | {s['rouge1']:.1f} / {s['rouge2']:.1f} | {s['exact']:.1f} | "
                     f"{s['certified']} / {s['updates']} | {s['seconds']:,.0f} | {stronger} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", help="JSON: the cells and their lora_batch files")
    args = parser.parse_args(argv)
    path = Path(args.manifest)
    manifest = json.loads(path.read_text())
    print(table([summary(cell, path.parent) for cell in manifest["cells"]]))


if __name__ == "__main__":
    main()
