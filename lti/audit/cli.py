"""`lti audit` on the command line: options from `lti.audit.options` (a config file and/or flags)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """`lti audit --config C [--federation.rounds 3 ...]`. Exits 2 with one line on bad input or a missing
    `flwr`, 130 on Ctrl-C (finished rounds stay recorded: a rerun resumes)."""
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
        print(f"lti audit: error: {str(error).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        import flwr  # noqa: F401
    except ImportError:
        print("lti audit: error: Flower is not installed: pip install -e \".[flower]\"", file=sys.stderr)
        raise SystemExit(2) from None
    import os

    from lti.audit.run import Audit
    from lti.trainer_cli import USER_ERRORS, user_message

    if os.environ.get("LTI_DEBUG"):  # LTI_DEBUG=1: the traceback instead of one line
        Audit(options).run()
        return
    try:
        Audit(options).run()
    except (*USER_ERRORS, ValueError, FileNotFoundError) as error:
        print(f"lti audit: error: {user_message(error).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
    except (RuntimeError, FloatingPointError) as error:  # a client or the federation failed mid-run
        print(f"lti audit: error: {str(error).splitlines()[0]} (finished rounds are kept in {options.out_dir})",
              file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"lti audit: interrupted; finished rounds are kept in {options.out_dir} (a rerun resumes)", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"report: {options.out_dir}/report.md")
