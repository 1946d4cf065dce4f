"""`lti matrix` on the command line: runs, resumes, submits, follows (`--status`), collects
(`--collect`) or plans (`--dry_run`) a grid."""

from __future__ import annotations

import argparse
import sys

from lti.matrix.grid import cell_id, cell_list, load_grid, select_cells
from lti.matrix.launchers import LAUNCHERS
from lti.matrix.records import import_records
from lti.matrix.resources import RESOURCE_KEYS, parse_resource_flags
from lti.matrix.runner import collect, grid_status, plan_grid, run_grid


def _print_status(rows: list[dict]) -> None:
    width = max((len(r["cell"]) for r in rows), default=4)
    for row in rows:
        print(f"{row['cell']:<{width}}  {row['status']:<8}  {row['job_id'] or '-':<10}  {row['detail']}")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "n/a", "failed", "running", "queued", "submitted", "pending")}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no cells selected")


def main(argv: list[str] | None = None) -> None:
    """`lti matrix ...`. Exits 2 on bad input (one line per problem), 1 when a selected cell failed (the table is
    written first, and the count said), 130 on Ctrl-C (one line; finished cells keep their records)."""
    try:
        _main(argv)
    except KeyboardInterrupt:
        # A launcher has stopped what it started (lti.matrix.launchers); every finished cell's record is
        # whole on disk (written aside and renamed), so the tables can be built from them.
        print("lti matrix: interrupted; the finished cells keep their records (`--collect` builds the tables "
              "from them, a rerun resumes the rest)", file=sys.stderr)
        raise SystemExit(130) from None


def _main(argv: list[str] | None) -> None:
    from lti import matrix  # the package docstring's first paragraph describes the command

    parser = argparse.ArgumentParser(prog="lti matrix", description=matrix.__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="resources (--resource [learned.|exact.]KEY=VALUE, or the grid's resources: block):\n"
                                            + "\n".join(f"  {k:<12} {help}" for k, (_, help) in RESOURCE_KEYS.items())
                                            + "\n\nexit status: 0 done, 1 a selected cell failed, 2 bad input "
                                              "(e.g. a cell's arguments), 130 interrupted")
    parser.add_argument("--grid", required=True, help="grid YAML (see configs/matrix/)")
    parser.add_argument("--out_dir", help="where cells, tables and plots go (default: the grid's out_dir)")
    for axis in ("attack", "protocol", "defense"):
        parser.add_argument(f"--{axis}s", nargs="+", metavar=axis.upper(), help=f"only these {axis}s' cells")
    parser.add_argument("--resume_from", metavar="MATRIX_JSON",
                        help="count the finished cells of an earlier table (matrix.json) as done where their arguments match")
    parser.add_argument("--launcher", choices=list(LAUNCHERS),
                        help="where cells run: inline (this process, one at a time), local (a process per cell, "
                             "submitit), slurm (a SLURM job per cell, submitit; returns once submitted). Default: local")
    parser.add_argument("--inline", action="store_true", help="the same as --launcher inline")
    parser.add_argument("--max_parallel", type=int, default=1,
                        help="cells at once with --launcher local; each gets cores / max_parallel CPU threads "
                             "unless --resource cpus=N says otherwise")
    parser.add_argument("--resource", action="append", default=[], metavar="[KIND.]KEY=VALUE",
                        help="a resource for every cell, or only learned/exact ones (see below); repeatable")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--collect", action="store_true",
                        help="build the tables and plots from the cells finished so far; run nothing")
    action.add_argument("--status", action="store_true",
                        help="list the cells as done / running / failed / pending, with job ids; run nothing")
    action.add_argument("--dry_run", action="store_true",
                        help="print the lti commands of the selected cells still to run, and the time estimate; run nothing")
    args = parser.parse_args(argv)
    try:
        if args.max_parallel < 1:
            raise ValueError(f"--max_parallel {args.max_parallel} must be at least 1")
        grid = load_grid(args.grid, args.out_dir)
        only = {"attack": args.attacks, "protocol": args.protocols, "defense": args.defenses}
        if args.status:
            _print_status(grid_status(grid, only))
            return
        if args.collect:
            records = collect(grid)
            print(f"{len(records)} cell records -> {grid.out_dir / 'matrix.md'}")
            print((grid.out_dir / "matrix.md").read_text())
            return
        if args.dry_run:
            plan_grid(grid, only, args.resume_from, max_parallel=args.max_parallel)
            return
        if args.inline and args.launcher not in (None, "inline"):
            raise ValueError(f"--inline contradicts --launcher {args.launcher}")
        launcher = "inline" if args.inline else args.launcher or "local"
        resources = parse_resource_flags(args.resource)
        if args.resume_from:
            print(f"imported {import_records(grid, args.resume_from)} finished cells from {args.resume_from}")
        records = run_grid(grid, launcher, only=only, max_parallel=args.max_parallel, resources=resources)
    except (ValueError, FileNotFoundError) as error:
        print(f"lti matrix: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    failed = [r for r in records if r["status"] == "failed"]
    print(f"\n{len(records)} cells ({len(failed)} failed) -> {grid.out_dir / 'matrix.md'}")
    print((grid.out_dir / "matrix.md").read_text())
    if LAUNCHERS[launcher].waits:  # the selected cells have run: say so if any of them failed
        selected = {cell_id(*cell) for cell in select_cells(grid, only)}
        names = [key for r in failed if (key := f"{r['protocol']}__{r['defense']}__{r['attack']}") in selected]
        if names:
            print(f"lti matrix: {len(names)} of {len(selected)} selected cells failed ({cell_list(names)}); "
                  "their reasons are in matrix.md and `--status`", file=sys.stderr)
            raise SystemExit(1)
