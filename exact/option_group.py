"""The base of the exact attacks' option groups (`exact.dager.options`, `exact.spear.options`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

#: Declared types (as written: the modules use postponed annotations) that a value is cast to.
_CASTS = {"float": float, "int": int, "bool": bool, "float | None": float, "int | None": int}


@dataclass(frozen=True)
class OptionGroup:
    """A frozen dataclass of options: values cast to their declared type (a YAML `1` for a float stays
    a float in diagnostics), then checked by `_check`, which raises a one-line `ValueError`.

    A dataclass itself, without fields, so that jsonargparse treats its subclasses as plain nested
    groups of options (a base that is not a dataclass would make them classes to pick by `class_path`).
    """

    def __post_init__(self) -> None:
        for f in fields(self):
            value, cast = getattr(self, f.name), _CASTS.get(f.type)
            if cast is not None and value is not None:
                object.__setattr__(self, f.name, cast(value))
        self._check()

    def _check(self) -> None:
        """Raise a `ValueError` for a value out of range (nothing to check by default)."""
