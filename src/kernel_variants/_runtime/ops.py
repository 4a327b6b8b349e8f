"""An op's entry into the runtime: what its public function calls with its arguments.

An op's public function is written in its package with its signature and docstring, and one line
into its entry (``make_op``), so that a reader, a debugger and an IDE can follow a call from the
op inward (until its first call finds the core: see below). Traced by ``torch.compile``, the entry calls the op's ``torch.library`` custom op,
which dispatches when the graph runs (after the first trace Dynamo inlines the op's traced
function in the entry's place: ``custom_ops``); eagerly, the compiled call core where it is
built, which hands what it does not serve to the Python path (``call.call``), or, in a real run
under ``torch.export`` or a compile session, to the custom op. Once an op's first call has found
the core, its public function calls the core's entry in C instead of this one (its frame
skipped; ``_c_entry``), which hands the same calls to the same Python.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime import callcore, imports
from kernel_variants._runtime.call import MADE, ON_MADE, call


def make_op(spec: OpSpec) -> Callable[..., Any]:
    """The dispatched entry of ``spec``: ``entry(*args, out)``, every parameter of the op in
    signature order, then ``out``. The op's public function returns ``entry(...)``."""
    name = spec.name
    # Folded to True while Dynamo traces; eagerly a function that returns False (one frame, where
    # is_compiling takes two: with cold caches each frame entered is a few cache misses).
    tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
    compiling = torch.compiler.is_compiling
    miss = callcore.MISS
    slot = callcore.arm(spec)

    def traced(args: tuple[Any, ...]) -> Any:
        # Importing custom_ops runs for real, also under Dynamo (it is not traced): it registers
        # the ops made so far and sets each slot's ``traced``, read only after it. Through the
        # slot rather than custom_ops.OPS: each object a traced call reads is a guard the
        # compiled graph checks per call, and after a large kernel each costs a cache miss.
        from kernel_variants._runtime import custom_ops

        # custom_ops.register sets the newest slot of a spec; an older entry of the same spec
        # (made twice) finds its traced function by name.
        return (slot.traced or custom_ops.OPS[name])(*args)

    def entry(*args: Any) -> Any:
        if tracing():
            return traced(args)
        core = slot.core
        if core is not None:
            r = core(*args)
            if r is not miss:
                return r
        return after_miss(*args)

    def after_miss(*args: Any) -> Any:
        # The core did not serve the call (or there is none); a first call resolved the core
        # (or None) just now.
        if compiling():
            # A real run under torch.export or a compile session (fake or functional tensors,
            # which the core never serves): the graph records the op's custom op.
            return traced(args)
        core = slot.core
        return call(spec, args[:-1], args[-1]) if core is None else call(spec, args[:-1], args[-1], core)

    def stand_in(*args: Any) -> Any:
        # What Dynamo traces in place of the core's C entry (_c_entry below), as the entry's
        # compile branch. Closed over the op's name alone: Dynamo traces it without a source,
        # and so cannot read a closure's other objects (the slot, the miss sentinel).
        from kernel_variants._runtime import custom_ops

        return custom_ops.OPS[name](*args)

    entry.__qualname__ = entry.__name__ = f"{name}_entry"
    slot.entry, slot.after_miss, slot.stand_in, slot.found = entry, after_miss, stand_in, _c_entry
    MADE.append(spec)
    for hook in ON_MADE:  # a compile already happened: this op needs its custom op now
        hook(spec)
    return entry


_lock = threading.Lock()
_waiting: list[tuple[callcore.Slot, dict[str, Any], str]] = []  # C entries Dynamo has not been told of yet


def _c_entry(slot: callcore.Slot) -> None:
    """Once ``slot``'s core is found, the op's public function calls the core's C entry
    (``op_entry`` in call_core.cpp) in place of the Python entry it calls by a global of its
    module (~0.25 us a call). Dynamo is told to trace the slot's stand-in in its place before
    any trace can reach it: now if Dynamo is imported, else as soon as it is (importing it here
    costs seconds). Nothing changes where the module has no C entry, the public function reads
    its entry otherwise, torch cannot substitute, or a trace already happened (its graph guards
    on the global: swapped, it would recompile)."""
    if slot.c_entry is not None:  # found again after a reload: swapped already
        return
    module = callcore.core_module()
    public = getattr(slot.spec.signature, "__globals__", {})
    names = [k for k, v in list(public.items()) if v is slot.entry]  # list(): one step, under the GIL
    if (module is None or not hasattr(module, "op_entry") or len(names) != 1
            or not hasattr(torch.compiler, "substitute_in_graph")
            or f"{__package__}.custom_ops" in sys.modules):  # a trace happened
        return
    with _lock:
        if slot.c_entry is not None:
            return
        slot.c_entry = module.op_entry(slot.entry.__name__, slot, slot.entry, slot.after_miss)
    dynamo = "torch._dynamo" in sys.modules
    if dynamo and not _substituted(slot):
        return
    public[names[0]] = slot.c_entry
    if not dynamo:
        with _lock:
            _waiting.append((slot, public, names[0]))
        imports.after_import("torch._dynamo", _dynamo_imported)


def _substituted(slot: callcore.Slot) -> bool:
    """Whether Dynamo now traces the op's stand-in where a traced call reaches the C entry."""
    with contextlib.suppress(Exception):  # a torch that refuses it: the public function keeps its Python entry
        torch.compiler.substitute_in_graph(slot.c_entry, skip_signature_check=True)(slot.stand_in)
        return True
    return False


def _dynamo_imported(_: ModuleType) -> None:
    with _lock:  # each waiting entry taken once: a second substitution of one entry fails
        waiting = _waiting[:]
        _waiting.clear()
    for slot, public, name in waiting:
        if not _substituted(slot):
            public[name] = slot.entry
