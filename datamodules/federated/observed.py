"""Which parameters' updates the server observes, selected by module/parameter name, never by position."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn


class ParameterSelection:
    def __init__(self, include: Sequence[str] = ("*",), exclude: Sequence[str] | None = None) -> None:
        """
        Args:
            include: fnmatch patterns on parameter names (`model.named_parameters()`), e.g.
                `encoder.layers.0.self_attn.*` for layer 0's attention only.
            exclude: Patterns removed from the selection. None means the target model's default
                (the LTI paper's: token embedding and tied decoder weight/bias are not observed).
        """
        if not include:
            raise ValueError("ParameterSelection.include is empty; give at least one pattern, e.g. '*'")
        self.include = tuple(include)
        self.exclude = None if exclude is None else tuple(exclude)

    def resolve(self, model: nn.Module) -> list[str]:
        """Names of the observed parameters, in `named_parameters()` order."""
        exclude = self.exclude if self.exclude is not None else tuple(getattr(model, "default_excluded", ()))
        names = [name for name, _ in model.named_parameters()]
        for pattern in self.include:
            if not any(fnmatchcase(name, pattern) for name in names):
                preview = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ValueError(f"observed-parameter pattern {pattern!r} matches no parameter; names look like: {preview}")
        selected = [
            name
            for name in names
            if any(fnmatchcase(name, p) for p in self.include) and not any(fnmatchcase(name, p) for p in exclude)
        ]
        if not selected:
            raise ValueError(f"include={list(self.include)} minus exclude={list(exclude)} selects no parameter")
        return selected

    def __repr__(self) -> str:
        return f"ParameterSelection(include={list(self.include)}, exclude={self.exclude})"
