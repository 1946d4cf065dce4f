"""The cells' `lti` arguments checked before any cell runs (and by `--dry_run`), by the parser `lti fit`
itself uses: a misspelled override is one line naming the option ("did you mean ..."), found in seconds,
not a failed cell at the end of a long grid."""

from __future__ import annotations

import functools
from typing import Any

from lti.matrix.grid import Entry, Grid, cell_commands, cell_id, cell_list
from lti.matrix.records import one_line


class _ParserReady(Exception):
    def __init__(self, parser: Any):
        super().__init__("parser ready")
        self.parser = parser


@functools.cache
def trainer_parser() -> Any:
    """The parser of `lti fit|validate|test|predict`, built once per process by `lti.trainer_cli.run` itself
    (so its options, defaults and parser settings are the CLI's), stopped before it parses anything:
    nothing is instantiated, seeded or written."""
    from lti import trainer_cli  # the Lightning CLI: imported here so `--status`/`--collect` stay light

    class ParserOnly(trainer_cli.LTICLI):
        def parse_arguments(self, parser, args):
            raise _ParserReady(parser)

    original, trainer_cli.LTICLI = trainer_cli.LTICLI, ParserOnly
    try:
        trainer_cli.run([])
    except _ParserReady as ready:
        return ready.parser
    finally:
        trainer_cli.LTICLI = original
    raise RuntimeError("lti.trainer_cli.run no longer parses through LTICLI.parse_arguments")


def argument_errors(grid: Grid, cells: list[tuple[Entry, Entry, Entry]]) -> dict[str, str]:
    """{cell id: the one line `lti fit` would print} for each cell one of whose `lti` commands does not parse.

    Commands are parsed without merging the parser's defaults: several times faster, and on every grid
    under configs/matrix/ it finds exactly what the full parse finds (unknown options, bad values,
    unknown classes; the defaults themselves are the CLI's, not the grid's, to get right)."""
    if not cells:
        return {}
    from lti.trainer_cli import USER_ERRORS, user_message

    parser = trainer_parser()
    errors = {}
    for cell in cells:
        for command in cell_commands(grid, *cell):
            try:
                parser.parse_args(command, defaults=False)
            except USER_ERRORS as error:
                errors[cell_id(*cell)] = one_line(user_message(error))
                break
    return errors


def check_arguments(grid: Grid, cells: list[tuple[Entry, Entry, Entry]]) -> None:
    """Raises ValueError, one line per distinct problem with the cells it hits, if any cell's arguments
    do not parse (`argument_errors`)."""
    errors = argument_errors(grid, cells)
    if not errors:
        return
    by_problem: dict[str, list[str]] = {}
    for cell, problem in errors.items():
        by_problem.setdefault(problem, []).append(cell)
    lines = [f"  {cell_list(names)}: {problem}" for problem, names in by_problem.items()]
    raise ValueError(f"{len(errors)} of {len(cells)} cells to run have bad arguments (fix the grid; no cell was started):\n"
                     + "\n".join(lines))
