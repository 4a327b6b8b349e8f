"""Running code once a module has been imported, without importing it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class _AfterExec(importlib.abc.Loader):
    """A module's own loader, followed by ``then(module)`` once the module has run."""

    def __init__(self, inner: Any, then: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader...: the real loader's
        return getattr(self._inner, name)


def spec_then(finder: object, then: Callable[[ModuleType], None], name: str, path: Any = None,
              target: Any = None) -> Any:
    """For a meta path finder's ``find_spec``: the spec ``sys.meta_path``'s other finders give
    ``name``, its loader followed by ``then(module)``; None where they find none."""
    for other in sys.meta_path:
        find = getattr(other, "find_spec", None)
        if other is finder or find is None:
            continue
        spec = find(name, path, target)
        if spec is not None:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _AfterExec(spec.loader, then)
            return spec
    return None


class _Once(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self._name:
            return None
        sys.meta_path.remove(self)
        return spec_then(self, self._then, name, path, target)


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` as soon as the module ``name`` has been imported (it is not yet: the
    caller checked ``sys.modules``), in the importing thread. Importing nothing itself: the
    hook waits in ``sys.meta_path`` and leaves it at the module's import."""
    sys.meta_path.insert(0, _Once(name, then))
