"""`lti SUBCOMMAND ...`: the workbench's command line, a table of subcommands.

`fit`, `validate`, `test` and `predict` are Lightning CLI entry points (`lti.trainer_cli`); `matrix`
runs a grid of them (`lti.matrix`). This module sits on top: it imports both, and neither imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def _trainer(argv: list[str]) -> None:
    from lti.trainer_cli import USER_ERRORS, run, user_message

    if os.environ.get("LTI_DEBUG"):  # LTI_DEBUG=1: the traceback instead of one line
        return run(argv)
    try:
        run(argv)
    except USER_ERRORS as error:
        print(f"lti: error: {user_message(error)}", file=sys.stderr)
        raise SystemExit(2) from None


def _matrix(argv: list[str]) -> None:
    from lti.matrix import main as matrix_main

    matrix_main(argv[1:])


#: subcommand -> handler of the whole argument list (the subcommand included).
SUBCOMMANDS: dict[str, Callable[[list[str]], None]] = {
    "fit": _trainer, "validate": _trainer, "test": _trainer, "predict": _trainer, "matrix": _matrix,
}


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if args is None else list(args)
    # Anything else (`--help`, a typo) goes to the Lightning CLI, whose parser lists the subcommands.
    SUBCOMMANDS.get(argv[0] if argv else "", _trainer)(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
