"""`lti SUBCOMMAND ...`: the workbench's command line, a table of subcommands.

`fit`, `validate`, `test` and `predict` are Lightning CLI entry points (`lti.trainer_cli`); `matrix`
runs a grid of them (`lti.matrix`); `audit` a Flower federation with its attacks (`lti.audit`); `candidates` the candidate-pointer
attack (`lti.candidates`). This
module sits on top: it imports them, and none imports it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

#: Exit codes: bad arguments or input files (the command cannot run as given), and a run stopped by its
#: machine (a full disk, a failed save; the command may succeed when run again).
EXIT_BAD_INPUT, EXIT_RUN_FAILED = 2, 1


def _trainer(argv: list[str]) -> None:
    from lti.trainer_cli import USER_ERRORS, RunFailed, failure_message, run, user_message

    if os.environ.get("LTI_DEBUG"):  # LTI_DEBUG=1: the traceback instead of one line
        return run(argv)
    # A full disk also fails the log handlers of the libraries (W&B's debug log): each failure would print
    # a "--- Logging error ---" traceback; the one line below says what happened.
    logging.raiseExceptions = False
    try:
        run(argv)
    except USER_ERRORS as error:
        print(f"lti: error: {user_message(error)}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    except RunFailed as error:
        print(f"lti: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_RUN_FAILED) from None
    except OSError as error:  # before or after the run itself (setting up, saving its config)
        print(f"lti: error: {failure_message(error, None)}", file=sys.stderr)
        raise SystemExit(EXIT_RUN_FAILED) from None


def _matrix(argv: list[str]) -> None:
    from lti.matrix import main as matrix_main

    matrix_main(argv[1:])


def _candidates(argv: list[str]) -> None:
    from lti.candidates.cli import main as candidates_main

    candidates_main(argv[1:])


def _audit(argv: list[str]) -> None:
    from lti.audit.cli import main as audit_main

    audit_main(argv[1:])


#: subcommand -> handler of the whole argument list (the subcommand included).
SUBCOMMANDS: dict[str, Callable[[list[str]], None]] = {
    "fit": _trainer, "validate": _trainer, "test": _trainer, "predict": _trainer, "matrix": _matrix,
    "audit": _audit, "candidates": _candidates,
}


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if args is None else list(args)
    # Anything else (`--help`, a typo) goes to the Lightning CLI, whose parser lists the subcommands.
    SUBCOMMANDS.get(argv[0] if argv else "", _trainer)(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
