"""A minimal name -> class registry.

YAML configs select classes with `class_path`/`init_args` (jsonargparse resolves them); the registry
adds short names (`Defense.create("sign")`) and, above all, lets error messages list what is allowed.
"""

from __future__ import annotations

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
            raise ValueError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}") from None

    def create(self, name: str, **kwargs) -> T:
        return self.get(name)(**kwargs)
