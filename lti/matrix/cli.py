"""`lti matrix` on the command line: parses the arguments and runs, resumes or plans (`--dry_run`) a grid."""

from __future__ import annotations

import argparse
import sys

from lti.matrix.grid import load_grid
from lti.matrix.records import import_records
from lti.matrix.runner import plan_grid, run_grid


def main(argv: list[str] | None = None) -> None:
    from lti import matrix  # the package docstring's first paragraph describes the command

    parser = argparse.ArgumentParser(prog="lti matrix", description=matrix.__doc__.split("\n\n")[0])
    parser.add_argument("--grid", required=True, help="grid YAML (see configs/matrix/)")
    parser.add_argument("--out_dir", help="where cells, tables and plots go (default: the grid's out_dir)")
    for axis in ("attack", "protocol", "defense"):
        parser.add_argument(f"--{axis}s", nargs="+", metavar=axis.upper(), help=f"run only these {axis}s' cells")
    parser.add_argument("--resume_from", metavar="MATRIX_JSON",
                        help="count the finished cells of an earlier table (matrix.json) as done where their arguments match")
    parser.add_argument("--inline", action="store_true", help="run cells in this process (faster, less isolated)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="run this many cells at once, as subprocesses (not with --inline); on a CPU each gets "
                             "an equal share of the cores")
    parser.add_argument("--threads_per_job", type=int,
                        help="CPU threads of each cell when --jobs > 1 (default: cores // jobs)")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the lti commands of the selected cells still to run, and the time estimate; run nothing")
    args = parser.parse_args(argv)
    try:
        grid = load_grid(args.grid, args.out_dir)
        only = {"attack": args.attacks, "protocol": args.protocols, "defense": args.defenses}
        if args.dry_run:
            plan_grid(grid, only, args.resume_from, jobs=args.jobs)
            return
        if args.resume_from:
            print(f"imported {import_records(grid, args.resume_from)} finished cells from {args.resume_from}")
        records = run_grid(grid, inline=args.inline, only=only, jobs=args.jobs, threads_per_job=args.threads_per_job)
    except (ValueError, FileNotFoundError) as error:
        print(f"lti matrix: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    failed = [r for r in records if r["status"] == "failed"]
    print(f"\n{len(records)} cells ({len(failed)} failed) -> {grid.out_dir / 'matrix.md'}")
    print((grid.out_dir / "matrix.md").read_text())
