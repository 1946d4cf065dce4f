"""The batched LoRA attack's curve: token accuracy against the batch size B, one point per update and the
mean per B, from the JSON lines `benchmarks.investigations.batched.lora_batch` writes; prints the table
docs/audit.md quotes.

    python -m benchmarks.tools.batched_curve docs/results/audit/batched/eval_v2.jsonl \
        docs/results/audit/batched/eval_v3_regrow.jsonl --out docs/results/audit/batched/accuracy_vs_batch.png

A later file's row replaces an earlier one's of the same B and update. `--trace-out`: a second figure, each
update's token accuracy after every step of the attack (search, refinement passes, regrowth) against the seconds
since it began, from the rows that hold a trace; `--progress` adds the updates of `lora_batch --progress` files
whose row was never written (an update stopped before its end). `--budgets T ...`: what a time budget
(`BatchedOptions.time_budget`) of T seconds would have read, from the traces (below).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path


def rows_by_batch(paths: list[str], batched_only: bool = True) -> dict[int, list[dict]]:
    """The batched attack's rows per B, in the order read; a row of the same B and update as an earlier one replaces
    it, so a later file (today's settings on some of the updates) updates the rows of an earlier one. Rows of DAGER
    alone (`lora_batch --attacks dager`) are left out unless `batched_only` is False."""
    out: dict[int, dict] = {}
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines()):
            if line.strip():
                row = json.loads(line)
                if batched_only and "token_acc" not in row:
                    continue
                key = row["update"] if "update" in row else (path, number)
                out.setdefault(int(row["B"]), {})[key] = row
    return {batch: list(rows.values()) for batch, rows in sorted(out.items())}


def table(by_batch: dict[int, list[dict]]) -> str:
    lines = ["| B | updates | bag recall | token acc | ROUGE-1 | ROUGE-2 | exact seq. | certified updates | "
             "residual (median) | s / update (median) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for batch, rows in by_batch.items():
        mean = lambda key: 100 * statistics.fmean(r[key] for r in rows)  # noqa: E731
        residuals = [r["residual"] for r in rows if r.get("residual") is not None]
        residual = f"{statistics.median(residuals):.3f}" if residuals else "—"
        lines.append(f"| {batch} | {len(rows)} | {mean('bag_recall'):.1f} | **{mean('token_acc'):.1f}** | "
                     f"{mean('rouge1'):.1f} | {mean('rouge2'):.1f} | {mean('exact'):.1f} | "
                     f"{sum(bool(r.get('certified')) for r in rows)} / {len(rows)} | {residual} | "
                     f"{statistics.median(r['seconds'] for r in rows):.0f} |")
    return "\n".join(lines)


def _finish(figure, axes, legend: str, path: str) -> None:
    """The token-accuracy axis both figures share, and the figure written atomically to `path`."""
    axes.set_ylabel("token accuracy (%)")
    axes.set_ylim(0, 100)
    axes.grid(alpha=0.3)
    axes.legend(loc=legend, fontsize=8)
    figure.tight_layout()
    out = Path(path)
    temporary = out.with_name(f".{out.name}.tmp.png")
    figure.savefig(temporary, dpi=120)
    temporary.replace(out)


def progress_rows(paths: list[str]) -> dict[int, list[dict]]:
    """Traced rows per B from `lora_batch --progress` files (one line per step, as the attack reached it), for
    updates whose row was never written (stopped before the end): of each (B, split, update), the last run's steps
    in order, the first search's and the second's (steps "second_...") as two rows."""
    last: dict[tuple, str] = {}
    points = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                point = json.loads(line)
                update = (int(point["B"]), point.get("split", "evaluation"), point["update"])
                last[update] = point.get("run", "")
                points.append((update, point))
    out: dict[int, dict[tuple, dict]] = {}
    for (batch, split, update), point in points:
        if point.get("run", "") != last[(batch, split, update)]:
            continue
        search = "second" if point["step"].startswith("second_") else "first"
        row = out.setdefault(batch, {}).setdefault((split, update, search), {
            "update": update, "split": split, "search": search, "trace": []})
        row["trace"].append([point["step"].removeprefix("second_"), point["seconds"], point["token_acc"]])
    return {batch: list(rows.values()) for batch, rows in sorted(out.items())}


@dataclass
class FirstSearch:
    """One update's first search, as a time budget would cut it: its trace ([step, seconds, accuracy] points in
    order) and, where no second search followed, the update's end (token accuracy after the refit's labels, its
    seconds), which every budget past the trace reads; None where a second search ran or the end is unknown."""

    trace: list
    end: tuple[float, float] | None = None


def accuracy_at_budget(search: FirstSearch, budget: float) -> tuple[float, float] | None:
    """(token accuracy, seconds) of an update under a time budget: the step in progress when the budget is spent
    finishes, so the first point at or after it (before the refit's labels; the simulation of the search's sequences
    runs between the search's point and the first budget check, so a budget spent in that gap stops at the search's
    point, not the next). Past the trace: the update's end if no second search followed, else None (the second
    search would have started, and the trace does not say what it read)."""
    for _, seconds, accuracy in search.trace:
        if seconds >= budget:
            return accuracy, seconds
    return search.end


def first_searches(by_batch: dict[int, list[dict]], progress: dict[int, list[dict]]) -> dict[int, list[FirstSearch]]:
    """Each update's first search per B: a row's (as `--trace-out` draws it) when its kept search was the first, its
    end when no second search ran; else its progress file's (which holds both searches: the end is unknown). Rows run
    under a budget of their own are left out (a budget past theirs would read more than they did)."""
    out: dict[int, dict[tuple, FirstSearch]] = {}
    skipped: set[tuple] = set()
    for batch, rows in by_batch.items():
        for row in rows:
            key = (row.get("split", "evaluation"), row.get("update"))
            if row.get("budget_reached"):
                skipped.add((batch, *key))
            elif row.get("trace") and not row.get("second_opinion"):
                end = (row["token_acc"], row["seconds"]) if row.get("second_opinion") is None else None
                out.setdefault(batch, {})[key] = FirstSearch(row["trace"], end)
    for batch, rows in progress.items():
        for row in rows:
            key = (row["split"], row["update"])
            if row["search"] == "first" and key not in out.get(batch, {}) and (batch, *key) not in skipped:
                out.setdefault(batch, {})[key] = FirstSearch(row["trace"])
    return {batch: list(searches.values()) for batch, searches in sorted(out.items())}


def budget_table(searches_by_batch: dict[int, list[FirstSearch]], budgets: list[float]) -> str:
    """Per B and budget, the mean token accuracy at the budget over the updates it can be read for
    (`accuracy_at_budget`), with the median seconds at the cut (the step in progress overruns the budget; the refit
    adds its own seconds after it)."""
    lines = ["| B | budget (s) | updates | token acc at the budget | s at the cut (median) |", "|---|---|---|---|---|"]
    for batch, searches in searches_by_batch.items():
        for budget in budgets:
            cut = [point for point in (accuracy_at_budget(t, budget) for t in searches) if point is not None]
            if cut:
                lines.append(f"| {batch} | {budget:g} | {len(cut)} of {len(searches)} | "
                             f"{100 * statistics.fmean(a for a, _ in cut):.1f} | "
                             f"{statistics.median(s for _, s in cut):.0f} |")
    return "\n".join(lines)


def trace_figure(by_batch: dict[int, list[dict]], path: str) -> int:
    """Each traced row's accuracy after every step against its seconds (one line per update, a colour per B);
    returns how many rows were drawn (none: no figure)."""
    traced = [(batch, row) for batch, rows in by_batch.items() for row in rows if row.get("trace")]
    if not traced:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.6))
    colours = {batch: f"C{i}" for i, batch in enumerate(sorted({b for b, _ in traced}))}
    for batch, row in traced:
        seconds = [at for _, at, _ in row["trace"]]
        accuracy = [100 * acc for _, _, acc in row["trace"]]
        axes.plot(seconds, accuracy, marker=".", color=colours[batch], alpha=0.6)
    for batch, colour in colours.items():
        axes.plot([], [], color=colour, label=f"B = {batch}")
    axes.set_xlabel("seconds since the attack began")
    _finish(figure, axes, "lower right", path)
    plt.close(figure)
    return len(traced)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", default=[], help="JSONL files of lora_batch")
    parser.add_argument("--progress", action="append", default=[], metavar="FILE",
                        help="a lora_batch --progress file (repeatable): its updates join the trace figure (an update "
                             "with a row is drawn from the row)")
    parser.add_argument("--out", default=None, help="the figure (.png); none: the table only")
    parser.add_argument("--trace-out", default=None,
                        help="a figure (.png) of each traced update's accuracy after every step against its seconds")
    parser.add_argument("--budgets", type=float, nargs="+", default=[], metavar="T",
                        help="time budgets (seconds): the mean accuracy each would have read, from the first search's "
                             "trace of every update (`first_searches`)")
    args = parser.parse_args(argv)
    by_batch = rows_by_batch(args.rows)
    if not by_batch and not args.progress:
        raise SystemExit("no rows in " + ", ".join(args.rows) if args.rows else "give lora_batch rows or --progress")
    if by_batch:
        print(table(by_batch))
    if args.out and by_batch:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(5, 3.2))
        for batch, rows in by_batch.items():
            axes.scatter([batch] * len(rows), [100 * r["token_acc"] for r in rows], color="tab:blue", alpha=0.4, s=14)
        batches = list(by_batch)
        axes.plot(batches, [100 * statistics.fmean(r["token_acc"] for r in by_batch[b]) for b in batches],
                  marker="o", color="tab:blue", label="batched LoRA attack (mean)")
        axes.set_xscale("log", base=2)
        axes.set_xticks(batches, [str(b) for b in batches])
        axes.set_xlabel("sequences per update (B)")
        _finish(figure, axes, "lower left", args.out)
        print(f"figure: {args.out}")
    if args.trace_out:
        traced = {batch: list(rows) for batch, rows in by_batch.items()}
        for batch, rows in progress_rows(args.progress).items():
            known = {(r.get("split", "evaluation"), r.get("update")) for r in traced.get(batch, [])}
            traced.setdefault(batch, []).extend(r for r in rows if (r["split"], r["update"]) not in known)
        drawn = trace_figure(dict(sorted(traced.items())), args.trace_out)
        print(f"trace figure: {args.trace_out} ({drawn} updates)" if drawn else "no row holds a trace: no trace figure")
    if args.budgets:
        print(budget_table(first_searches(by_batch, progress_rows(args.progress)), args.budgets))


if __name__ == "__main__":
    main()
