"""A minimal name -> class registry.

YAML configs select classes with `class_path`/`init_args` (jsonargparse resolves them); the registry
adds short names (`Defense.create("sign")`) and, above all, lets error messages list what is allowed.
"""

from __future__ import annotations

import difflib
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str, cls: type[T]) -> None:
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"{self.kind} name {name!r} is registered twice")
        self._classes[name] = cls

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self.names(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}{hint}") from None

    def create(self, name: str, **kwargs) -> T:
        return self.get(name)(**kwargs)

    def base(self) -> type:
        """A mixin for a base class: every subclass that defines `name` registers itself here."""
        registry = self

        class AutoRegistered:
            def __init_subclass__(cls, **kwargs) -> None:
                super().__init_subclass__(**kwargs)
                if "name" in cls.__dict__:
                    registry.register(cls.name, cls)

        return AutoRegistered


def materialize(obj):
    """A real, fresh instance for a `jsonargparse.lazy_instance` default (else `obj` itself).

    Lazy defaults make the CLI help show the default class; they are only initialised on a method
    call and one object would be shared by every caller, so init methods replace them with this.
    """
    get_init = getattr(obj, "lazy_get_init_data", None)
    if get_init is None:
        return obj
    import importlib

    data = get_init()
    module, _, name = data.class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    init_args = data.get("init_args")
    return cls(**(dict(vars(init_args)) if init_args is not None else {}))
