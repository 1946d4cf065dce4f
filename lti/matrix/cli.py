"""`lti matrix` on the command line: runs, resumes, submits, follows (`--status`), collects
(`--collect`) or plans (`--dry_run`) a grid. Its options are `lti.matrix.options.MatrixOptions`, parsed
by jsonargparse (`lti.command_line`; also from `--config FILE`): lists are written
`--attacks '[dager, spear]'` and resources `--resource+ cpus=1`; the argparse spellings `--attacks
dager spear` and `--resource cpus=1` still work, with one line on stderr."""

from __future__ import annotations

import argparse
import sys

from lti.matrix.grid import cell_id, cell_list, load_grid, select_cells
from lti.matrix.launchers import LAUNCHERS
from lti.matrix.options import MatrixOptions
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


def parse(argv: list[str]) -> MatrixOptions:
    """The command line -> its options, checked; bad input: one line, exit 2."""
    from jsonargparse import DefaultHelpFormatter

    from lti import matrix  # the package docstring's first paragraph describes the command
    from lti.command_line import parse_options

    class Formatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
        """jsonargparse's help, with the description and the table of resources below it as written."""

    epilog = ("resources (--resource+ [learned.|exact.]KEY=VALUE, or the grid's resources: block):\n"
              + "\n".join(f"  {k:<12} {help}" for k, (_, help) in RESOURCE_KEYS.items())
              + "\n\nexit status: 0 done, 1 a selected cell failed, 2 bad input (e.g. a cell's arguments), 130 interrupted")
    return parse_options("lti matrix", MatrixOptions, argv, appended=("resource",), formatter_class=Formatter,
                         description=matrix.__doc__.split("\n\n")[0], epilog=epilog)


def _main(argv: list[str] | None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
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
