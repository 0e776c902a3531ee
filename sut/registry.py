"""Registries by name (SUT backends, transports): a class decorator, a lookup that imports a built-in's
module on first use, and the list of names (lm-evaluation-harness ``api/registry.py`` style).

``Registry(kind, builtins)``: ``kind`` names what is registered in error messages (``"SUT"``,
``"transport"``); ``builtins`` maps each built-in name to the module that registers it, so only the
requested one is imported (a host without flamepy can still run the others).
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, builtins: dict[str, str]):
        self.kind, self.builtins = kind, builtins
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: register ``cls`` as ``name`` (also sets ``cls.name``)."""

        def deco(cls: type[T]) -> type[T]:
            cls.name = name
            self._classes[name] = cls
            return cls

        return deco

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``, importing a built-in's module first. ``KeyError`` listing the
        known names."""
        if name not in self._classes and name in self.builtins:
            importlib.import_module(self.builtins[name])
        try:
            return self._classes[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Built-in and registered names, sorted."""
        return sorted(set(self.builtins) | set(self._classes))
