"""`lti audit` on the command line: options from `lti.audit.options` (a config file and/or flags)."""

from __future__ import annotations

import sys


def parse_error_line(message: str, options: list[str]) -> str:
    """jsonargparse's report of a bad option or value (several lines: `Parser key "federation.lr":` then
    the reason) -> one line naming the option, the value and the reason; an unknown option gets a "did
    you mean" among `options` (the dotted option names)."""
    import difflib
    import re

    from lti.trainer_cli import parse_error_message

    if match := re.match(r"unrecognized arguments: --([\w.]+)", message):
        close = difflib.get_close_matches(match.group(1), options, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown option '{match.group(1)}'{hint}; `lti audit --help` lists every option"
    line = parse_error_message(message).replace("`lti fit --help`", "`lti audit --help`")
    line = re.sub(r"Expected a <class '(\w+)'>\. Got value: (.*)", r"expected \1, got \2", line)
    return re.sub(r"<class '(\w+)'>", r"\1", line)


def main(argv: list[str] | None = None) -> None:
    """`lti audit --config C [--federation.rounds 3 ...]`. Exits 2 with one line on bad input (options,
    threat model, a damaged or another audit's folder, a folder in use), 1 on a fault of the machine (a
    full disk), 130 on Ctrl-C (finished rounds stay recorded: a rerun resumes); `LTI_DEBUG=1`: the traceback."""
    import logging

    from jsonargparse import ActionConfigFile, ArgumentParser

    from lti.audit.options import AuditOptions

    parser = ArgumentParser(prog="lti audit", description=AuditOptions.__doc__, exit_on_error=False, default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="an audit config (configs/audit/)")
    parser.add_class_arguments(AuditOptions, as_group=False)
    try:
        config = parser.parse_args(argv)
        options = parser.instantiate_classes(config)
        options = AuditOptions(**{k: v for k, v in vars(options).items() if k != "config"})
    except Exception as error:  # jsonargparse reports bad input as several exception types
        names = [action.dest for action in parser._actions if "." in action.dest]
        print(f"lti audit: error: {parse_error_line(str(error), names)}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        import flwr  # noqa: F401
    except ImportError:
        print("lti audit: error: Flower is not installed: pip install -e \".[flower]\"", file=sys.stderr)
        raise SystemExit(2) from None
    import os

    from lti.audit.run import Audit
    from lti.trainer_cli import USER_ERRORS, failure_message, user_message

    if os.environ.get("LTI_DEBUG"):  # LTI_DEBUG=1: the traceback instead of one line
        Audit(options).run()
        return
    # A full disk also fails the libraries' log handlers; the one line below says what happened.
    logging.raiseExceptions = False
    try:
        Audit(options).run()
    except (*USER_ERRORS, ValueError, FileNotFoundError) as error:
        print(f"lti audit: error: {user_message(error).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
    except (RuntimeError, FloatingPointError) as error:  # a client or the federation failed mid-run
        print(f"lti audit: error: {str(error).splitlines()[0]} (finished rounds are kept in {options.out_dir})",
              file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as error:  # the machine: a full disk, a failed write (the same command may succeed later)
        print(f"lti audit: error: {failure_message(error)} (finished rounds are kept in {options.out_dir}; a rerun "
              "resumes)", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"lti audit: interrupted; finished rounds are kept in {options.out_dir} (a rerun resumes)", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"report: {options.out_dir}/report.md")
