"""The core module's functions, each with the Python its user provides for where the core is
off or not built (the same results): ``FUNCTIONS.<name>``, bound by ``callcore.rearm``."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch


def _unaliased_py(res: Any, *args: Any) -> Any:
    ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}

    def fresh(o: Any) -> Any:  # not a tensor: handed back, for torch to say what the schema expected
        return o.clone() if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in ptrs else o

    return tuple(fresh(o) for o in res) if isinstance(res, (tuple, list)) else fresh(res)


class Functions:
    """The core module's functions: ``FUNCTIONS.<name>`` is the core's function where the core
    is on and built, else the Python its user provided (:meth:`provide`; the same results), as
    bound by ``callcore.rearm``.

    ``unaliased(result, *args)`` is the runtime's own: ``result`` (a tensor, or a tuple or list
    of them: a tuple), each output that shares storage with a tensor argument replaced by a clone
    (a ``torch.library`` op's output may not alias an input). The engine adapters provide theirs
    (``integrations._fast``)."""

    def __init__(self) -> None:
        self._python: dict[str, Callable[..., Any]] = {}
        self._module: ModuleType | None = None

    def provide(self, name: str, python: Callable[..., Any]) -> None:
        self._python[name] = python
        setattr(self, name, getattr(self._module, name, None) or python)

    def bind(self, module: ModuleType | None) -> None:
        self._module = module
        for name, python in self._python.items():
            setattr(self, name, getattr(module, name, None) or python)


FUNCTIONS = Functions()
FUNCTIONS.provide("unaliased", _unaliased_py)
