"""The compiled core module's functions, each with its Python stand-in: ``FUNCTIONS.<name>`` is
the core's function where the core is on and built, else the Python function its user provided
(the same results). Found again after each ``kv.reload()`` (``KV_CALL_CORE`` is read then)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from kernel_variants._runtime import callcore


def _unaliased_py(res: Any, *args: Any) -> Any:
    ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}

    def fresh(o: Any) -> Any:  # not a tensor: handed back, for torch to say what the schema expected
        return o.clone() if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in ptrs else o

    return tuple(fresh(o) for o in res) if isinstance(res, (tuple, list)) else fresh(res)


class Functions:
    """The core extension's module functions, each in C where the core serves and else in the
    Python its user provided (:meth:`provide`); found at first use after each ``callcore.rearm()``.

    ``unaliased(result, *args)`` is the runtime's own: ``result`` (a tensor, or a tuple or list
    of them: a tuple), each output that shares storage with a tensor argument replaced by a clone
    (a ``torch.library`` op's output may not alias an input). The engine adapters provide theirs
    (``integrations._fast``).
    """

    def __init__(self) -> None:
        self._python: dict[str, Callable[..., Any]] = {}

    def provide(self, name: str, python: Callable[..., Any]) -> None:
        """``FUNCTIONS.<name>``: the core's function of that name, or ``python`` (the same
        results) where the core is off, not built, or without it."""
        self._python[name] = python
        setattr(self, name, functools.partial(self._resolve, name))

    def reset(self) -> None:
        for name in self._python:
            setattr(self, name, functools.partial(self._resolve, name))

    def _resolve(self, name: str, *args: Any) -> Any:
        module = callcore.core_module()
        for n, python in self._python.items():
            setattr(self, n, getattr(module, n, None) or python)
        return getattr(self, name)(*args)


FUNCTIONS = Functions()
FUNCTIONS.provide("unaliased", _unaliased_py)
callcore.ON_REARM.append(FUNCTIONS.reset)
