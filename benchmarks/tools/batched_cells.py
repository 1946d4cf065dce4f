"""The batched attack's table of cells (batch size, defense, protocol, rank, sequence length): for each cell the
batched attack with and without its learned scorer, DAGER on the same updates, and the stronger, from the JSON
lines `benchmarks.investigations.batched.lora_batch` writes; prints the table docs/audit.md quotes.

    python -m benchmarks.tools.batched_cells docs/results/audit/batched/cells.json

The manifest lists the cells in order: {"cells": [{"cell": name, "B": batch size, "batched": [files],
"dager": [files]}, ...]}, files relative to the manifest's folder; a cell's rows are those of its B, a later
file's row replacing an earlier one's of the same update. DAGER is scored on the updates the batched attack read
(`lora_batch --attacks dager` on the same draws, refused where a pair's split, length or protocol differ); where it
ran on some of them, the table says on how many, and names no stronger attack. "hand-set": the batched attack's
hand-set search alone (without its learned second opinion); "no scorer" where the rows ran without one.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.tools.batched_curve import rows_by_batch

#: The draw and the client's protocol a row was measured under (a row written before a field existed ran its default):
#: the batched attack's and DAGER's rows of one update are paired only where these agree.
SETTING = {"split": "evaluation", "L": None, "clip_norm": None, "local_epochs": 1, "local_dp_epsilon": None,
           "overrides": {}}


def cell_rows(folder: Path, files: list[str], batch: int) -> dict[int, dict]:
    """{update: row} of batch size `batch` in `files` (a later file's row of the same update replaces an earlier one;
    `batched_curve.rows_by_batch`)."""
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise SystemExit(f"{folder / missing[0]} does not exist (run lora_batch for it, or take it off the manifest)")
    rows = rows_by_batch([str(folder / name) for name in files], batched_only=False).get(batch, [])
    return {int(row["update"]): row for row in rows}


def setting(row: dict) -> dict:
    return {key: row.get(key, default) for key, default in SETTING.items()}


def hand_set_accuracy(row: dict) -> float | None:
    """The hand-set search's token accuracy on an update (the attack without its learned scorer): the kept result's,
    unless the learned second opinion was kept, whose other result is the hand-set one; None where the attack ran
    without a second opinion (then it is the hand-set search)."""
    if row.get("scorer"):
        raise SystemExit(f"update {row['update']}'s row searched with a learned scorer first (--scorer): its hand-set "
                         "search was not run")
    if not row.get("second_opinion_file"):
        return None
    return row["other_token_acc"] if row.get("second_opinion") else row["token_acc"]


def summary(cell: dict, folder: Path) -> dict:
    """One cell's means over its updates (percent), the batched attack's and DAGER's on the same updates."""
    rows = {k: r for k, r in cell_rows(folder, cell["batched"], int(cell["B"])).items() if "token_acc" in r}
    if not rows:
        raise SystemExit(f"cell {cell['cell']!r}: no B = {cell['B']} rows in {', '.join(cell['batched'])}")
    updates = sorted(rows)
    ordered = [rows[k] for k in updates]
    mean = lambda values: 100 * statistics.fmean(values)  # noqa: E731
    hand_set = [hand_set_accuracy(r) for r in ordered]
    out = {"cell": cell["cell"], "B": int(cell["B"]), "L": int(ordered[0]["L"]), "updates": len(updates),
           "token_acc": mean(r["token_acc"] for r in ordered),
           "hand_set": None if None in hand_set else mean(hand_set),
           "rouge1": mean(r["rouge1"] for r in ordered), "rouge2": mean(r["rouge2"] for r in ordered),
           "exact": mean(r["exact"] for r in ordered), "certified": sum(bool(r["certified"]) for r in ordered),
           "seconds": statistics.median(r["seconds"] for r in ordered), "dager": None, "dager_updates": 0}
    dager = {k: r for k, r in cell_rows(folder, cell.get("dager", []), int(cell["B"])).items() if "dager" in r}
    paired = [k for k in updates if k in dager]
    for k in paired:
        if setting(dager[k]) != setting(rows[k]):
            raise SystemExit(f"cell {cell['cell']!r}, update {k}: DAGER's row was drawn under {setting(dager[k])}, the "
                             f"batched attack's under {setting(rows[k])}")
    if paired:
        out["dager"] = mean(dager[k]["dager"]["token_acc"] for k in paired)
        out["dager_seconds"] = statistics.median(dager[k]["dager"]["seconds"] for k in paired)
        out["dager_updates"] = len(paired)
    return out


def table(summaries: list[dict]) -> str:
    lines = ["| cell | B | L | updates | DAGER (s / update) | batched, hand-set | **batched** (default) | ROUGE-1 / 2 | "
             "exact seq. | certified | s / update (median) | stronger |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if s["dager"] is None:
            dager, stronger = "not run", "—"
        else:
            part = "" if s["dager_updates"] == s["updates"] else f", {s['dager_updates']} of {s['updates']} updates"
            dager = f"{s['dager']:.1f} ({s['dager_seconds']:.0f} s{part})"
            stronger = "—" if part else ("batched" if s["token_acc"] >= s["dager"] else "DAGER")
        hand_set = "no scorer" if s["hand_set"] is None else f"{s['hand_set']:.1f}"
        lines.append(f"| {s['cell']} | {s['B']} | {s['L']} | {s['updates']} | {dager} | {hand_set} | "
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
