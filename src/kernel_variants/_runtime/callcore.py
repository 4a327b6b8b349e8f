"""The compiled call core: which call path the ops take, and the core's side of the memo.

A dispatched call's per-call work (the memo key from the tensors' metadata and the other
arguments, the lookup, the index value checks, the write guard, the call of the variant) runs
in C++ (``_runtime/csrc``, built as ``core_build.CORE``) when the core is built: ``kv build`` builds
it with the C++ kernels; a call never does. Where it is not built (or does not load), the Python
path (``call.call``) serves every call, and the first call says so once on stderr.
``KV_CALL_CORE=0`` turns the core off (read when the ops are made, and again when the process's
dispatcher is made and at each ``kv.reload()``: every call form follows that reading).

The core decides nothing. A call it has no entry for, or one it does not serve (``out=``, a
tensor of a subclass or on a device other than the CPU and CUDA, a torch function mode, a graph
being captured on the call's device) or in which it detects a problem (a bad index value, an
overlap with a written tensor), goes to the Python path, which validates, decides, raises with
its message, or memoises the decision and hands the core the same entry (:func:`learn`).
Anything that clears the Python memo clears every core too. CUDA tensors are served from the
first CUDA call the Python path sees on, with the op's device rule in place of the host value
checks (:func:`serves`).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kernel_variants._native import build
from kernel_variants._runtime.core_build import CORE
from kernel_variants._runtime.core_functions import FUNCTIONS
from kernel_variants._runtime.core_specs import (
    BoundSpec,
    CoreSpec,
    GraphSpec,
    Learned,
    per_parameter,
)
from kernel_variants._runtime.device_errors import _counters
from kernel_variants._runtime.errors import variant_failed
from kernel_variants._runtime.guards import WritePlan
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


class _Graph:
    """Passed to a core as ``out``: a call from a compiled graph's kernel (``custom_ops``), which
    takes no ``out`` and may return no output aliasing an argument (cloned in the same call)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<kernel_variants call core: graph call>"


GRAPH = _Graph()

MAX_PARAMS = 32  # the most parameters an op may have for the core to serve it (kMaxParams in csrc/call_core.h)

_lock = threading.Lock()
_loaded: dict[str, tuple[ModuleType | None, str | None]] = {}  # .so path -> (module, why not)
_cores: dict[tuple[str, OpSpec], Any] = {}  # (the module's file, the op) -> the op's CallCore
_announced = False
_generation = 0  # see generation()
_learn_lock = threading.RLock()  # a core's learn may run Python code (hashing a value)


def _off(raw: str) -> bool:
    return raw.strip().lower() in ("0", "false", "no", "off")


_wanted: bool | None = None  # KV_CALL_CORE as last read: by rearm, else at first need


def _core_wanted() -> bool:
    """Whether ``KV_CALL_CORE`` lets the ops take the core: read once, and again by each
    :func:`rearm`, so that every call form (the entry, ``kv.bind``, the graph kernels, the engine
    steps) and ``status()`` agree on one reading."""
    global _wanted
    if _wanted is None:
        _wanted = not _off(os.environ.get(ENV, ""))
    return _wanted


def _library() -> tuple[ModuleType | None, str]:
    """(the core's extension module, or None; a short reason when None). Never builds, and asks
    neither ninja nor the compiler: a complete build is imported as it is (``build.load_built``)."""
    try:
        name, build_dir = build._name_and_dir(CORE)
    except Exception as exc:  # torch or the sources unreadable: say so, serve in Python
        return None, f"cannot locate the build ({type(exc).__name__}: {exc})"
    path = str(build_dir / f"{name}.so")
    with _lock:
        if path not in _loaded:
            try:
                module = build.load_built(CORE)
                if module is None:  # not kept: a kv build in another process makes it loadable
                    return None, "not built: run kv build"
                _SERVED[module.CallCore] = (module, {"cpu"})  # a file without the type is not the core
                _loaded[path] = (module, None)
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                _loaded[path] = (None, f"the build does not load ({first}); run kv build")
        module, why = _loaded[path]
    return module, why or ""


# Per loaded core module (by its CallCore type): the module, and the device types its cores key.
_SERVED: dict[type, tuple[ModuleType, set[str]]] = {}


def _serve_cuda(module: ModuleType, served: set[str]) -> None:
    """Let ``module``'s cores serve CUDA tensors: they then ask whether the current stream is
    being captured per CUDA call, as the Python path's key does (``_capture.capturing``), and
    leave a call made while a graph is captured to it. Done at the first CUDA call the Python
    path sees, so that nothing here asks CUDA anything before the process itself has (a process
    that forks its CUDA workers later keeps CUDA uninitialised)."""
    if not hasattr(module, "capture_check"):
        return
    # The builtin behind torch.cuda.is_current_stream_capturing: no Python frame per call.
    check = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
    with _lock:
        if "cuda" not in served:
            module.capture_check("cuda", check)
            served.add("cuda")


def serves(core: Any, t: Any, host_checks: bool) -> bool:
    """Whether ``core`` can serve (and so be taught) a call whose first tensor is ``t``: a CPU
    tensor, or a CUDA one when the call reads no index values on the host (``host_checks``
    False: the device rule runs instead, or nothing is checked)."""
    if t.is_cpu:
        return True
    if host_checks:
        return False
    found = _SERVED.get(type(core))
    if found is None:  # not a core of a module loaded here
        return False
    module, served = found
    kind = t.device.type
    if kind == "cuda" and kind not in served:
        _serve_cuda(module, served)
    return kind in served


def status() -> tuple[bool, str]:
    """(whether the ops take the compiled core, the call path in words) for this environment."""
    if not _core_wanted():
        return False, f"Python ({ENV}=0)"
    module, why = _library()
    if module is None:
        return False, f"Python ({why})"
    return True, "compiled core"


def _kinds(spec: OpSpec) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Per parameter, as the core reads it: its kind (0 a value, 1 a tensor, 2 an optional
    tensor), and whether the op writes it."""
    optional = dict(spec._tensor_params)
    kinds = tuple(0 if i not in optional else 2 if optional[i] else 1 for i in range(len(spec.params)))
    return kinds, tuple(i in spec.mutated_indices for i in range(len(spec.params)))


def _check_data(checks: Callable[..., None]) -> tuple[Any, Any, Callable[..., None] | None]:
    """A hit's index value checks as the core takes them: (data, the device gate, None) where
    declared as data it reads, else (None, None, the check, which the core calls as it is)."""
    declared = getattr(checks, "declared", None)
    data = declared.core_data() if isinstance(declared, ValuePlan) else None
    return (data, declared.device, None) if data is not None else (None, None, checks)


def _make(spec: OpSpec, module: ModuleType) -> Any:
    """The CallCore of ``spec``: its parameters as the core reads them."""
    kinds, mutated = _kinds(spec)
    npos = len(spec.positional)

    def fail(vid: str, exc: BaseException) -> None:
        raise variant_failed(spec, vid, exc) from exc

    return module.CallCore(CoreSpec(kinds, mutated, npos, spec.params[npos:], _pins, _counters, fail, MISS, GRAPH))


def core_for(spec: OpSpec) -> Any:
    """The core that serves ``spec``'s calls now, or None (the Python path)."""
    if not _core_wanted():
        return None
    module, _ = _library()
    if module is None:
        return None
    if len(spec.params) > MAX_PARAMS:
        return None
    key = (str(module.__file__), spec)
    with _lock:
        core = _cores.get(key)
        if core is None:
            core = _cores[key] = _make(spec, module)
    return core


def python_path_notice() -> None:
    """Say once per process, on stderr, why the ops take the Python call path: a call found no
    core (called by that call, so a process that never calls an op says nothing)."""
    global _announced
    if _announced or not _core_wanted():
        return
    _announced = True
    module, why = _library()
    if module is None:
        print(f"kernel_variants: ops take the Python call path (the compiled call core: {why}; "
              f"{ENV}=0 silences this)", file=sys.stderr, flush=True)


def core_module() -> ModuleType | None:
    """The core's extension module, loaded now where it is built and the core is on; else None."""
    return _library()[0] if _core_wanted() else None


def graph_module() -> ModuleType | None:
    """The core's extension module for the ops' compiled-graph kernels (``custom_ops``), or None.
    Called once, when ``custom_ops`` is imported (the first trace of a process)."""
    found = core_module()
    return found if found is not None and hasattr(found, "graph_kernel") else None


def graph_kernel(module: ModuleType | None, name: str, *, entry: Entry, kernel: Callable[..., Any],
                 miss: Callable[..., Any], bad: Callable[[Any], BaseException], n_out: int) -> bool:
    """Register ``module``'s C++ kernel (:func:`graph_module`) for ``kernel_variants::<name>``
    (``op.overload``): a graph's call reaches ``entry``'s core with no Python frame. ``kernel``:
    the Python kernel, serving while the entry holds no core; ``miss``: its path for a call the
    core hands back; ``bad(result)``: the exception for a result that is not ``n_out`` tensors.
    The core gets them as one ``GraphSpec``. False (nothing registered) without a module, or for
    an op the core does not serve (over 32 parameters): the caller registers ``kernel`` itself."""
    if module is None or (n := len(entry.spec.params)) > MAX_PARAMS:
        return False
    module.graph_kernel(name, GraphSpec(entry=entry, kernel=kernel, miss=miss, bad=bad, n=n, n_out=n_out))
    return True


_REQUIRED = object()  # a BoundCore default slot: the parameter has none


def bound(spec: OpSpec, python: Callable[..., Any], vid: str, fn: Callable[..., Any], subs: tuple[tuple[int, Any], ...],
          checks: Callable[..., None] | None, rule: Callable[..., tuple[Any, ...]] | None, fixed: list[int],
          expected: tuple[Any, ...], example: tuple[Any, ...], grad: bool, guards: tuple[Any, ...]) -> Any:
    """``kv.bind``'s object in C (the op's signature bound there, then the bound call's checks,
    ``rule`` (off the CPU: the device rule) and the variant), handing any call it does not run to
    ``python``, the bound function in Python; None where the core is off or not built, the
    signature has positional-only parameters, or the example has a tensor subclass (but a
    Parameter). ``example``: the example's arguments in signature order, whose tensors each
    call's must be like; ``grad``: whether the example needed a gradient; ``guards``: the write
    guard's data (``write_plan(...).declared.writes``)."""
    if core_for(spec) is None:
        return None
    module, _ = _library()
    params = list(spec.py_signature.parameters.values())
    if module is None or any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params):
        return None
    if any(example[i] is not None and type(example[i]) not in (torch.Tensor, torch.nn.Parameter)
           for i in spec.tensor_indices):  # a subclass may see its own __torch_function__
        return None
    data, gate, py_checks = _check_data(checks) if checks is not None else (None, None, None)
    kinds, mutated = _kinds(spec)
    npos = len(spec.positional)

    def fail(vid: str, exc: BaseException) -> None:
        raise variant_failed(spec, vid, exc) from exc

    return module.BoundCore(BoundSpec(
        tuple(p.name for p in params), npos, tuple(_REQUIRED if p.default is p.empty else p.default for p in params),
        _REQUIRED, kinds, mutated, example, grad, guards, tuple(fixed), expected, per_parameter(len(kinds), subs), data,
        gate, py_checks, rule, _counters, fn, vid, spec.params[npos:], fail, python))


class Entry:
    """An op's entry, as the runtime holds it: ``call``, the function the op's public function
    calls (``entry.make_op``); ``core``, the CallCore it serves its calls through, or None (the
    Python path): bound when the op is made (:func:`arm`) and again by each new dispatcher
    (:func:`rearm`); never by a call. ``traced``: what a call traced by torch.compile
    invokes, set when the op's custom op is registered (``custom_ops.register``)."""

    __slots__ = ("call", "core", "spec", "traced")

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.core: Any = None
        self.traced: Callable[..., Any] | None = None
        self.call: Callable[..., Any] | None = None


_entries: list[Entry] = []


def arm(spec: OpSpec) -> Entry:
    """The entry of a new op ``spec``, bound to its core now."""
    entry = Entry(spec)
    entry.core = core_for(spec)
    _entries.append(entry)
    return entry


def entry_of(spec: OpSpec) -> Entry:
    """The entry :func:`arm` made for ``spec`` (this op object, not another of its name)."""
    return next(entry for entry in reversed(_entries) if entry.spec is spec)


def rearm() -> None:
    """A new dispatcher: every core forgets its entries, ``KV_CALL_CORE`` is read again, and
    each op's entry and :data:`FUNCTIONS` are bound to what serves from now on."""
    global _wanted
    clear_all()
    _wanted = None
    for entry in _entries:
        entry.core = core_for(entry.spec)
    FUNCTIONS.bind(core_module())


def generation() -> int:
    """How many times the cores forgot their entries: what :func:`learn` compares."""
    return _generation


def clear_all() -> None:
    """Forget every core's entries (the Python memo was cleared, or a new dispatcher made)."""
    global _generation
    with _learn_lock:
        _generation += 1
        for core in list(_cores.values()):
            core.clear()


def learn(core: Any, spec: OpSpec, args: tuple[Any, ...], out: Any, hit: Hit, since: int) -> None:
    """Hand ``core`` the entry the Python path memoised for this call, unless the cores were
    cleared since the call read the memo (``since``: :func:`generation` then; another thread's
    reload or invalidation). A hit the core cannot run (an ``out=`` runner, a write guard or value
    check it cannot read) is kept as the Python path's, so the core hands such calls over without
    asking again. A device rule the core calls as the Python path does (``rule(args)``)."""
    vid, fn, invoke, subs, guard, checks, rule = hit.vid, hit.fn, hit.invoke, hit.subs, hit.guard, hit.checks, hit.rule
    python_only = invoke is not spec.invoke or out is not None
    data, gate, py_checks = _check_data(checks) if checks is not None and not python_only else (None, None, None)
    guards: tuple[Any, ...] = ()
    if guard is not None and not python_only:
        declared = getattr(guard, "declared", None)
        if isinstance(declared, WritePlan) and not declared.out:
            guards = declared.writes
        else:
            python_only = True
    with _learn_lock:
        if since == _generation:
            core.learn(Learned(args, out, fn, vid, per_parameter(len(args), subs), data, gate, py_checks, guards,
                               python_only, rule))


