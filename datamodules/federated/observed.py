"""Which parameters' updates the server observes, selected by module/parameter name, never by position."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn

from datamodules.targets.architectures import preset_patterns


class ParameterSelection:
    def __init__(
        self,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] | None = None,
        preset: str | list[str] | None = None,
    ) -> None:
        """
        Args:
            include: fnmatch patterns on parameter names (`model.named_parameters()`), e.g.
                `encoder.layers.0.self_attn.*` for layer 0's attention only.
            exclude: Patterns removed from the selection. None means the target model's default
                (the LTI paper's: token embedding and tied decoder weight/bias are not observed).
            preset: Partial-observation preset(s) `layer<i>_<part>` (i 0-based as in the parameter
                names; part: query, key, value, attn_qkv, attn_out, ffn_in, ffn_out, attn, ffn, norms,
                all), resolved per architecture (see `datamodules.targets.architectures`). A preset
                replaces `include`, which must then stay at its default `['*']`.
        """
        if not include:
            raise ValueError("ParameterSelection.include is empty; give at least one pattern, e.g. '*'")
        presets = [preset] if isinstance(preset, str) else list(preset or [])
        if presets and tuple(include) != ("*",):
            raise ValueError("give observed parameters by include patterns or by preset, not both")
        self.include = tuple(include)
        self.exclude = None if exclude is None else tuple(exclude)
        self.preset = presets or None

    def patterns(self, model: nn.Module) -> tuple[str, ...]:
        """The include patterns, with presets resolved for `model`'s architecture."""
        if not self.preset:
            return self.include
        return tuple(pattern for name in self.preset for pattern in preset_patterns(model, name))

    def resolve(self, model: nn.Module) -> list[str]:
        """Names of the observed parameters, in `named_parameters()` order."""
        include = self.patterns(model)
        exclude = self.exclude if self.exclude is not None else tuple(getattr(model, "default_excluded", ()))
        names = [name for name, _ in model.named_parameters()]
        for pattern in include:
            if not any(fnmatchcase(name, pattern) for name in names):
                preview = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ValueError(f"observed-parameter pattern {pattern!r} matches no parameter; names look like: {preview}")
        selected = [
            name
            for name in names
            if any(fnmatchcase(name, p) for p in include) and not any(fnmatchcase(name, p) for p in exclude)
        ]
        if not selected:
            raise ValueError(f"include={list(include)} minus exclude={list(exclude)} selects no parameter")
        return selected

    def __repr__(self) -> str:
        preset = f", preset={self.preset}" if self.preset else ""
        return f"ParameterSelection(include={list(self.include)}, exclude={self.exclude}{preset})"
