"""The compiled call core: which call path the ops take, and the core's side of the memo.

A dispatched call's per-call work (the memo key from the tensors' metadata and the other
arguments, the lookup, the index value checks, the write guard, the call of the variant) runs
in C++ (``kernels/cpu_native/csrc/call_core.cpp``) when the core is built: ``kv build`` builds
it with the C++ kernels; a call never does. Where it is not built (or does not load), the Python
path (``call.call``) serves every call, and the first call says so once on stderr.
``KV_CALL_CORE=0`` turns the core off (read at the first call after each ``kv.reload()``).

The core decides nothing. A call it has no entry for, or one it does not serve (``out=``, a
tensor off the CPU or of a subclass, a torch function mode) or in which it detects a problem (a
bad index value, an overlap with a written tensor), goes to the Python path, which validates,
decides, raises with its message, or memoises the decision and hands the core the same entry
(:func:`learn`). Anything that clears the Python memo clears every core too.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kernel_variants._runtime.device_errors import _counters
from kernel_variants._runtime.errors import variant_failed
from kernel_variants._runtime.pins import _pins
from kernel_variants._runtime.values import ValuePlan

if TYPE_CHECKING:
    from types import ModuleType

    from kernel_variants._registry.spec import OpSpec
    from kernel_variants._runtime.dispatcher import Hit

ENV = "KV_CALL_CORE"


class _Miss:
    """What the core returns for a call the Python path must serve."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<kernel_variants call core: miss>"


MISS = _Miss()

_lock = threading.Lock()
_loaded: dict[str, tuple[ModuleType | None, str | None]] = {}  # .so path -> (module, why not)
_cores: dict[tuple[str, OpSpec], Any] = {}  # (the module's file, the op) -> the op's CallCore
_announced = False


def _off(raw: str) -> bool:
    return raw.strip().lower() in ("0", "false", "no", "off")


def _library() -> tuple[ModuleType | None, str]:
    """(the core's extension module, or None; a short reason when None). Never builds."""
    from kernel_variants.kernels.cpu_native import _build

    try:
        name, build_dir = _build._name_and_dir(_build.CORE)
    except Exception as exc:  # torch or the sources unreadable: say so, serve in Python
        return None, f"cannot locate the build ({type(exc).__name__}: {exc})"
    path = build_dir / f"{name}.so"
    if not path.exists():
        return None, "not built: run kv build"
    with _lock:
        if str(path) not in _loaded:
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or spec.loader is None:
                    raise ImportError(f"{path} is not an extension module")
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                module.CallCore  # noqa: B018 - a stand-in file without the type is not the core
                _loaded[str(path)] = (module, None)
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                _loaded[str(path)] = (None, f"the build does not load ({first}); run kv build")
        module, why = _loaded[str(path)]
    return module, why or ""


def status() -> tuple[bool, str]:
    """(whether the ops take the compiled core, the call path in words) for this environment."""
    if _off(os.environ.get(ENV, "")):
        return False, f"Python ({ENV}=0)"
    module, why = _library()
    if module is None:
        return False, f"Python ({why})"
    return True, "compiled core"


def _make(spec: OpSpec, module: ModuleType) -> Any:
    """The CallCore of ``spec``: its parameters as the core reads them."""
    optional = dict(spec._tensor_params)
    kinds = tuple(0 if i not in optional else 2 if optional[i] else 1 for i in range(len(spec.params)))
    mutated = tuple(i in spec.mutated_indices for i in range(len(spec.params)))
    npos = len(spec.positional)

    def fail(vid: str, exc: BaseException) -> None:
        raise variant_failed(spec, vid, exc) from exc

    return module.CallCore(kinds, mutated, npos, spec.params[npos:], _pins, _counters, fail, MISS)


def core_for(spec: OpSpec) -> Any:
    """The core that serves ``spec``'s calls now, or None (the Python path); announces once
    per process that the core is not there."""
    global _announced
    if _off(os.environ.get(ENV, "")):
        return None
    module, why = _library()
    if module is None:
        if not _announced:
            _announced = True
            print(f"kernel_variants: ops take the Python call path (the compiled call core: {why}; "
                  f"{ENV}=0 silences this)", file=sys.stderr, flush=True)
        return None
    if len(spec.params) > 32:  # the core's own bound on parameters
        return None
    key = (str(module.__file__), spec)
    with _lock:
        core = _cores.get(key)
        if core is None:
            core = _cores[key] = _make(spec, module)
    return core


_REQUIRED = object()  # a BoundCore default slot: the parameter has none


def bound(spec: OpSpec, python: Callable[..., Any], vid: str, fn: Callable[..., Any],
          subs: tuple[tuple[int, Any], ...], checks: Callable[..., None] | None, fixed: list[int],
          expected: tuple[Any, ...]) -> Any:
    """``kv.bind``'s object in C (the op's signature bound there, then the bound call's checks and
    the variant), handing any call it does not run to ``python``, the bound function in Python;
    None where the core is off or not built, or the signature has positional-only parameters."""
    if core_for(spec) is None:
        return None
    module, _ = _library()
    params = list(spec.py_signature.parameters.values())
    if module is None or any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params):
        return None
    data = gate = py_checks = None
    if checks is not None:
        declared = getattr(checks, "declared", None)
        if isinstance(declared, ValuePlan):
            data, gate = declared.core_data(), declared.device
        if data is None:
            py_checks, gate = checks, None
    optional = dict(spec._tensor_params)
    kinds = tuple(0 if i not in optional else 2 if optional[i] else 1 for i in range(len(spec.params)))
    npos = len(spec.positional)

    def fail(vid: str, exc: BaseException) -> None:
        raise variant_failed(spec, vid, exc) from exc

    return module.BoundCore(
        tuple(p.name for p in params), npos, tuple(_REQUIRED if p.default is p.empty else p.default for p in params),
        _REQUIRED, kinds, tuple(fixed), expected, subs, data, gate, py_checks, _counters, fn, vid,
        spec.params[npos:], fail, python)


class Slot:
    """Where an op's entry finds its call core: ``core`` is a resolver until the op's first call
    (which finds the core, or None for the Python path, and keeps it here), then that."""

    __slots__ = ("core", "spec")

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.core: Any = self._resolve

    def _resolve(self, *args: Any) -> Any:
        core = self.core = core_for(self.spec)
        return MISS if core is None else core(*args)


_slots: list[Slot] = []


def _unaliased_py(res: Any, *args: Any) -> Any:
    ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}

    def fresh(o: Any) -> Any:  # not a tensor: handed back, for torch to say what the schema expected
        return o.clone() if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in ptrs else o

    return tuple(fresh(o) for o in res) if isinstance(res, (tuple, list)) else fresh(res)


_REFUSED = object()


def _slot_ids_py(indices: Any, batch: int, table: bool) -> Any:
    if indices is None:
        return None
    if not isinstance(indices, torch.Tensor) or indices.ndim == 0 or indices.shape[0] != batch:
        return _REFUSED
    if indices.ndim == 1:
        return indices
    return indices[:, 0] if indices.ndim == 2 and indices.shape[1] >= 1 and table else _REFUSED


def _decode_views_py(x: Any, pool: Any, weight: Any, indices: Any, table: bool) -> tuple[Any, Any] | None:
    if not all(isinstance(t, torch.Tensor) for t in (x, pool, weight)):
        return None
    if (x.ndim != 2 or pool.ndim != 3 or weight.ndim != 2 or pool.shape[2] != weight.shape[1] - 1
            or not x.dtype == pool.dtype == weight.dtype):
        return None
    indices = _slot_ids_py(indices, x.shape[0], table)
    return None if indices is _REFUSED else (pool.transpose(-1, -2), indices)


def _prefill_views_py(x: Any, weight: Any, pool: Any, qsl: Any, indices: Any, init: Any, table: bool,
                      known_nonempty: bool) -> tuple[Any, Any, Any] | None:
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, qsl)):
        return None
    if x.ndim != 2 or weight.ndim != 2 or qsl.ndim != 1 or qsl.shape[0] < 1 or x.dtype != weight.dtype:
        return None
    batch = qsl.shape[0] - 1
    if init is not None and (not isinstance(init, torch.Tensor) or init.ndim != 1 or init.shape[0] != batch):
        return None
    if pool is not None:
        if (not isinstance(pool, torch.Tensor) or pool.ndim != 3 or pool.shape[2] != weight.shape[1] - 1
                or pool.dtype != x.dtype or not (known_nonempty or _PYTHON["no_empty"](qsl) is True)):
            return None
        pool = pool.transpose(-1, -2)
    indices = _slot_ids_py(indices, batch, table)
    return None if indices is _REFUSED else (x.transpose(-1, -2), pool, indices)


# Each of the core's module functions in Python, for where the core is off or not built.
_PYTHON: dict[str, Callable[..., Any]] = {
    "unaliased": _unaliased_py,
    "channel_last": lambda t: t.transpose(-1, -2),
    "decode_views": _decode_views_py,
    "prefill_views": _prefill_views_py,
    "no_empty": lambda qsl: (bool((qsl.diff() != 0).all()) if isinstance(qsl, torch.Tensor) and qsl.is_cpu
                             and qsl.ndim == 1 and qsl.dtype in (torch.int32, torch.int64) else None),
}


class Functions:
    """The core's module functions, in C where the core serves, else in Python; found at first use
    after each :func:`rearm`.

    - ``unaliased(result, *args)``: ``result`` (a tensor, or a tuple or list of them: a tuple), each output that
      shares storage with a tensor argument replaced by a clone (a ``torch.library`` op's output
      may not alias an input);
    - ``channel_last(t)``: ``t.transpose(-1, -2)`` (in C a plain alias sharing storage and version
      counter, ~0.2 us against ~0.8 us for a view from Python; the ordinary view for a subclass, a
      functional tensor, or one that requires grad in grad mode);
    - ``decode_views(x, pool, weight, indices, table)``: (pool's channel-last view, the slot ids)
      for a channel-first engine's decode step, or None where the adapter's general path serves
      (see ``integrations._fast.decode_step``): its checks and views in one call;
      ``prefill_views(x, weight, pool, query_start_loc, indices, has_initial_state, table,
      known_nonempty)``: the same for a varlen prefill (``integrations._fast.prefill_step``);
    - ``no_empty(query_start_loc)``: whether no sequence of a CPU ``[B+1]`` integer tensor is empty;
      None where that is not read on the host (off the CPU).
    """

    __slots__ = tuple(_PYTHON)

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        for name in _PYTHON:
            setattr(self, name, functools.partial(self._resolve, name))

    def _resolve(self, name: str, *args: Any) -> Any:
        module = None if _off(os.environ.get(ENV, "")) else _library()[0]
        for n, python in _PYTHON.items():
            setattr(self, n, getattr(module, n, None) or python)
        return getattr(self, name)(*args)


FUNCTIONS = Functions()


def arm(spec: OpSpec) -> Slot:
    """The slot through which ``spec``'s entry finds its core, from its next call on."""
    slot = Slot(spec)
    _slots.append(slot)
    return slot


def slot_of(spec: OpSpec) -> Slot:
    """The slot :func:`arm` made for ``spec`` (this op object, not another of its name)."""
    return next(slot for slot in reversed(_slots) if slot.spec is spec)


def rearm() -> None:
    """A new dispatcher: every core forgets its entries, and each op finds its path again on
    its next call (``KV_CALL_CORE`` is read then)."""
    clear_all()
    for slot in _slots:
        slot.core = slot._resolve
    FUNCTIONS.reset()


def clear_all() -> None:
    """Forget every core's entries (the Python memo was cleared)."""
    for core in list(_cores.values()):
        core.clear()


def learn(core: Any, spec: OpSpec, args: tuple[Any, ...], out: Any, hit: Hit) -> None:
    """Hand ``core`` the entry the Python path memoised for this call. A hit the core cannot
    run (an ``out=`` runner, a device rule, a write guard or value check it cannot read) is
    kept as the Python path's, so the core hands such calls over without asking again."""
    vid, fn, invoke, subs, guard, checks, rule = hit.vid, hit.fn, hit.invoke, hit.subs, hit.guard, hit.checks, hit.rule
    python_only = rule is not None or invoke is not spec.invoke or out is not None
    data = py_checks = gate = None
    if checks is not None and not python_only:
        declared = getattr(checks, "declared", None)
        if isinstance(declared, ValuePlan):
            data = declared.core_data()
            gate = declared.device
        if data is None:  # not declared as data the core reads: it calls the check as it is
            py_checks, gate = checks, None
    guards: tuple[Any, ...] = ()
    if guard is not None and not python_only:
        declared = getattr(guard, "declared", None)
        if isinstance(declared, tuple) and not declared[1]:
            guards = declared[0]
        else:
            python_only = True
    core.learn(args, out, fn, vid, subs, data, gate, py_checks, guards, python_only)


