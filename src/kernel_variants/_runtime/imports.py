"""Running code once a module has been imported, without importing it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_lock = threading.Lock()


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
    """Waits in ``sys.meta_path`` for the module ``name`` and leaves once it has run (a spec
    asked for and never loaded, as ``importlib.util.find_spec`` does, leaves it waiting)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return spec_then(self, self.ran, name, path, target) if name == self.name else None

    def ran(self, module: ModuleType) -> None:
        if self in sys.meta_path:  # else it ran before
            sys.meta_path.remove(self)
            self.then(module)


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` once the module ``name`` has been imported: now if it is, else in the
    thread that imports it, as soon as it has run. Imports nothing itself; one hook per
    (name, then), however often asked. ``then`` may run more than once (the module imported by
    another thread while this one asked): it must be idempotent."""
    with _lock:
        if name not in sys.modules and not any(
                isinstance(f, _Once) and f.name == name and f.then == then for f in sys.meta_path):
            sys.meta_path.insert(0, _Once(name, then))
    module = sys.modules.get(name)
    if module is not None:  # imported already, or by another thread just now
        then(module)
