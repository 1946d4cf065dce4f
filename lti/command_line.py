"""An options dataclass on the command line, parsed by jsonargparse as `lti audit` parses its options
(`lti candidates`' commands and `lti matrix` use it).

Each field is an option and its docstring line the help; a bool field is a flag (`--overwrite`, also
`--overwrite true|false`, `--no_overwrite`). A list takes jsonargparse's spelling, `--eval '[a, b]'`
(or `--eval+ a --eval+ b`); the argparse spellings these commands had before, `--eval a b`, a
repeated `--resource K=V` and overrides after `--`, are rewritten to it with one line on stderr
saying so. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
import typing
from typing import Any

#: argparse's test for a value that looks like an option but is a negative number (`--weights -1 2`).
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class Real(float):
    """The type of a float option that also takes Python's spellings of the values that are not finite
    (`nan`, `inf`, `-inf`, in any case): YAML reads only `.nan` and `.inf` as numbers, so `--lr nan` would be
    refused as a bad value before the option's own check could say what is wrong with it (`--lr nan must
    be finite and > 0`). Parsed values are plain floats."""


def _real(value: Any) -> float:
    if isinstance(value, str) and value.strip().lower() in (".nan", ".inf", "+.inf", "-.inf"):
        value = value.strip().replace(".", "")  # YAML's spellings, which the parser took for a float
    if isinstance(value, bool):  # YAML's true/false: float() would take them as 1.0 and 0.0
        raise ValueError(f"expected float, got {value}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected float, got {value}") from None


def _list_item(hint: Any) -> Any:
    """The item type of a `list[X]` or `list[X] | None` field; None for any other field."""
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is list:
            return typing.get_args(candidate)[0]
    return None


def _list_value(values: list[str], item: Any) -> str:
    """`a b` -> `[a, b]` for the parser; JSON where YAML would read a value as something else than the
    string given (`16`, `yes`, `null`, `a: b`), so the values arrive as they were typed."""
    plain = "[" + ", ".join(values) + "]"
    if item in (int, float, Real):
        return plain  # the parser reads and checks the numbers
    import yaml

    try:
        if yaml.safe_load(plain) == values:
            return plain
    except yaml.YAMLError:
        pass
    return json.dumps(values)


def _is_value(token: str) -> bool:
    return not token.startswith("-") or bool(_NEGATIVE_NUMBER.match(token))


def rewrite_old_spellings(argv: list[str], options: type, appended: tuple[str, ...] = (),
                          positional: str | None = None) -> tuple[list[str], list[str]]:
    """argparse spellings of `options`' list fields -> jsonargparse's, and what changed (`old -> new`).

    `--name a b` (also `--name=a`) becomes `--name '[a, b]'`; a field in `appended` was a repeatable
    option (`--resource K=V` twice) and becomes `--resource+ K=V` each time; the words after `--` go
    to the `positional` field as one list. A value already in brackets is the new spelling, left as is.
    An abbreviated option (`--eva`, argparse's prefix of one option) counts as the option it names."""
    hints = typing.get_type_hints(options)
    lists = {name: item for name, hint in hints.items() if (item := _list_item(hint)) is not None}
    names = [*hints, "config", "help", "print_config", *(f"no_{name}" for name, hint in hints.items() if hint is bool)]

    def list_field(option: str) -> str | None:
        if option in names:
            return option if option in lists else None
        prefixed = [name for name in names if name.startswith(option)]
        return prefixed[0] if len(prefixed) == 1 and prefixed[0] in lists else None

    out: list[str] = []
    changes: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" and positional:
            rest = argv[i + 1 :]
            new = [f"--{positional}", _list_value(rest, str)]
            changes.append(f"{shlex.join(argv[i:])} -> {shlex.join(new)}")
            out += new
            break
        option, equals, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        name = list_field(option) if option else None
        if name is None:
            out.append(token)
            i += 1
            continue
        if equals:
            values, end = [inline], i + 1
        elif name in appended:
            values, end = argv[i + 1 : i + 2], i + 2
        else:
            end = i + 1
            while end < len(argv) and _is_value(argv[end]):
                end += 1
            values = argv[i + 1 : end]
        if not values or values[0].startswith("["):  # no value (the parser says so), or the new spelling
            out.append(token)
            i += 1
            continue
        if name in appended:
            new = [f"--{name}+", values[0]]
        else:
            new = [f"--{name}", _list_value(values, lists[name])]
        changes.append(f"{shlex.join(argv[i:end])} -> {shlex.join(new)}")
        out += new
        i = end
    return out, changes


def _field_help(options: type) -> dict[str, str]:
    """Field -> its line of the dataclass docstring's `Args:` (the help jsonargparse shows for it)."""
    import docstring_parser

    return {param.arg_name: param.description or "" for param in docstring_parser.parse(options.__doc__ or "").params}


def options_parser(prog: str, options: type, config_file: bool = True, description: str | None = None, **kwargs: Any):
    """A jsonargparse parser of `options`' fields; `--config FILE` reads them from a YAML file. The
    description is the dataclass docstring's text before `Args:`, unless given.

    A bool field is jsonargparse's flag action (`--flag`, `--flag true|false`, `--no_flag`), so the bare
    flags of the argparse commands keep working as they are."""
    import inspect

    from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser
    from jsonargparse.typing import register_type

    register_type(Real, serializer=float, deserializer=_real)  # once: the same registration again is a no-op
    if description is None:
        description = inspect.cleandoc(options.__doc__ or "").split("Args:")[0].strip()
    # allow_abbrev: the argparse commands took unique prefixes (`--max_par`); jsonargparse warns of them otherwise
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False, default_env=False,
                            allow_abbrev=True, **kwargs)
    if config_file:
        parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these options")
    flags = {f.name: f for f in dataclasses.fields(options) if typing.get_type_hints(options)[f.name] is bool}
    parser.add_class_arguments(options, as_group=False, skip=set(flags))
    helps = _field_help(options)
    for name, field in flags.items():
        parser.add_argument(f"--{name}", action=ActionYesNo, nargs="?", default=field.default, help=helps.get(name))
    return parser


def parse_options(prog: str, options: type, argv: list[str], error_prefix: str | None = None,
                  config_file: bool = True, appended: tuple[str, ...] = (), positional: str | None = None,
                  **parser_kwargs: Any) -> Any:
    """`argv` -> an `options` instance, its `check()` passed. Old spellings are rewritten with one line
    on stderr; bad input is one line `<error_prefix>: error: ...` and exit status 2."""
    from lti.audit.cli import parse_error_line  # the one-line report of `lti audit`'s jsonargparse errors

    error_prefix = error_prefix or prog
    argv, changes = rewrite_old_spellings(argv, options, appended, positional)
    if changes:
        print(f"{error_prefix}: warning: deprecated spelling: {'; '.join(changes)}", file=sys.stderr)
    parser = options_parser(prog, options, config_file, **parser_kwargs)
    try:
        config = parser.parse_args(argv)
    except Exception as error:  # jsonargparse reports bad input as several exception types
        names = [action.dest for action in parser._actions if action.dest not in ("help", "config", "print_config")]
        line = parse_error_line(str(error), names).replace("`lti audit --help`", f"`{prog} --help`")
        # a flag's value that is not a boolean: argparse's words name the converter, not the option's values
        line = re.sub(r"argument --(\w+)/--no_\w+: invalid _boolean_type value: (.*)",
                      r"option '\1' is a flag (--\1, or --\1 true|false), not \2", line)
        line = line.replace(f"Not of type {Real.__name__}: ", "")  # a float option's value: "expected float, got ..."
        print(f"{error_prefix}: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    fields = {f.name for f in dataclasses.fields(options)}
    parsed = options(**{k: v for k, v in vars(config).items() if k in fields})
    try:
        parsed.check()
    except ValueError as error:
        print(f"{error_prefix}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    return parsed
