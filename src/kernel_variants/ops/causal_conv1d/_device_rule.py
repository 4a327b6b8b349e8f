"""The conv ops' device rule as one ``torch.library`` op, ``kernel_variants::conv_device_rule``.

Off the CPU the dispatcher does not read index tensors on the host; the device rule makes bad
values harmless and counts them instead (see :mod:`._checks`). As separate aten ops that is a
launch per op on every call; as this op it is one:

- ``CUDA``: one Triton launch (:mod:`._rule_triton`). Where triton is not installed, the
  composite below (correct, about ten launches).
- every other device (``CompositeExplicitAutograd``: the CPU, where the tests force the rule,
  and an NPU): the composite of aten ops.
- ``Meta`` / fake tensors: outputs of the right shapes, so that the op traces under
  torch.compile and records into a CUDA graph.

Per call, given ``batch`` = B and what the call has:

- ``slots`` ``[B]`` (int32/int64, in ``[0, n_slots)`` when valid): an entry outside the pool that
  is not ``pad`` (when ``pad_given``; else every entry outside the pool) counts as SLOT. The
  result replaces entries outside the pool by ``pad`` when ``rewrite`` and keeps them otherwise
  (a variant declaring ``slot_bounds_safe`` masks them itself). Live entries (in the pool, not
  ``pad``) that repeat an earlier entry's slot count as DUPLICATE (k uses of a slot: k - 1).
  Without ``slots`` (sequence b uses slot b) the result is ``arange(B)`` as int32.
- ``accepted`` ``[B]``: a count outside ``1..length`` counts as ACCEPTED, is 1 in the result, and
  its sequence is dropped.
- ``query_start_loc`` ``[B+1]``: clamped to ``[0, total]``, the ends set to 0 and ``total``,
  then a running maximum; a sequence with a changed bound counts as QUERY_START and is dropped.
- a dropped sequence's slot is ``pad`` in the result.

Returns (slots ``[B]``, accepted ``[B]`` or ``[0]``, query_start_loc ``[B+1]`` or ``[0]``), all
new tensors, and adds the four counts to ``counter`` (``int64 [4]``, in the order of
``device_errors.KINDS``). The caller decides which results it hands on.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

from kernel_variants._runtime import device_errors as errors

NAMESPACE, NAME = "kernel_variants", "conv_device_rule"
SCHEMA = ("(Tensor? slots, Tensor? accepted, Tensor? query_start_loc, Tensor(a!) counter, int batch, int n_slots, "
          "int pad, bool pad_given, int length, int total, bool rewrite) -> (Tensor, Tensor, Tensor)")

_lock = threading.Lock()
_lib: torch.library.Library | None = None  # kept: a Library deregisters its ops when collected
_overload: torch._ops.OpOverload | None = None


def composite(slots: torch.Tensor | None, accepted: torch.Tensor | None, query_start_loc: torch.Tensor | None,
              counter: torch.Tensor, batch: int, n_slots: int, pad: int, pad_given: bool, length: int, total: int,
              rewrite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule as aten ops (the op's kernel off CUDA, and on CUDA without triton)."""
    drop = None
    qsl_out, acc_out = counter.new_empty(0, dtype=torch.int32), counter.new_empty(0, dtype=torch.int32)
    if query_start_loc is not None:
        fixed = query_start_loc.clamp(0, total)
        fixed[0] = 0
        fixed[-1] = total
        qsl_out = fixed.cummax(0).values
        moved = qsl_out != query_start_loc
        drop = moved[:-1] | moved[1:]
        counter[errors.QUERY_START].add_(drop.sum())
    if accepted is not None:
        bad = (accepted < 1) | (accepted > length)
        counter[errors.ACCEPTED].add_(bad.sum())
        acc_out = torch.where(bad, 1, accepted)
        drop = bad if drop is None else drop | bad
    if slots is not None:
        inside = (slots >= 0) & (slots < n_slots)
        fixed = torch.where(inside, slots, pad)
        # An entry changed iff it was outside the pool and not the pad id; without the caller's
        # pad id (the dtype cannot hold it) every entry outside the pool is bad.
        counter[errors.SLOT].add_((fixed != slots if pad_given else ~inside).sum())
        if batch > 1:
            ordered = fixed.sort().values  # equal live slots end up adjacent
            counter[errors.DUPLICATE].add_(((ordered[1:] == ordered[:-1]) & (ordered[1:] != pad)).sum())
        base = fixed if rewrite else slots
    else:
        base = torch.arange(batch, dtype=torch.int32, device=counter.device)
    if drop is not None:
        slots_out = torch.where(drop, pad, base)
    else:  # a result may not alias an input
        slots_out = base.clone() if base is slots else base
    return slots_out, acc_out, qsl_out


def _fake(slots, accepted, query_start_loc, counter, batch, n_slots, pad, pad_given, length, total, rewrite):
    def like(t: torch.Tensor | None, n: int) -> torch.Tensor:
        return counter.new_empty(n if t is not None else 0, dtype=t.dtype if t is not None else torch.int32)

    slots_out = counter.new_empty(batch, dtype=slots.dtype if slots is not None else torch.int32)
    return slots_out, like(accepted, batch), like(query_start_loc, batch + 1)


def _interpreting() -> bool:
    """Whether Triton interprets (``TRITON_INTERPRET``), read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def triton_module(interpret: bool) -> ModuleType | None:
    """:mod:`._rule_triton` loaded as a module of its own for this interpreter mode (triton.jit
    fixes the mode as it decorates); None where triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    name = f"{__package__}._rule_triton" + ("[interpreted]" if interpret else "")
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_rule_triton.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda(slots, accepted, query_start_loc, counter, batch, n_slots, pad, pad_given, length, total, rewrite):
    module = triton_module(_interpreting())
    if module is None:
        return composite(slots, accepted, query_start_loc, counter, batch, n_slots, pad, pad_given, length, total,
                         rewrite)
    with torch.cuda.device(counter.device):  # triton launches on the current device
        return module.launch(slots, accepted, query_start_loc, counter, batch, n_slots, pad, pad_given, length,
                             total, rewrite)


def op() -> torch._ops.OpOverload:
    """``torch.ops.kernel_variants.conv_device_rule.default``, defined on first use (the rule
    runs only off the CPU: a CPU-only process never defines it)."""
    global _lib, _overload
    if _overload is None:
        with _lock:
            if _lib is None:
                lib = torch.library.Library(NAMESPACE, "FRAGMENT")
                lib.define(NAME + SCHEMA)
                lib.impl(NAME, composite, "CompositeExplicitAutograd")
                lib.impl(NAME, _cuda, "CUDA")
                torch.library.register_fake(f"{NAMESPACE}::{NAME}", _fake, lib=lib)
                _lib = lib
            _overload = torch.ops.kernel_variants.conv_device_rule.default
    return _overload


def pad_value(idx: torch.Tensor, pad_slot_id: int) -> int:
    """The id that marks a pad in rewritten slot ids: the caller's, or -1 (outside every pool, so
    never a live slot) when the index dtype cannot hold it (then no entry equals it)."""
    info = torch.iinfo(idx.dtype)
    return pad_slot_id if info.min <= pad_slot_id <= info.max else -1


def apply(device: torch.device, slots: torch.Tensor | None, accepted: torch.Tensor | None,
          query_start_loc: torch.Tensor | None, pad_slot_id: int, *, batch: int, n_slots: int = 0, length: int = 0,
          total: int = 0, rewrite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Run the rule on ``device`` (one op) and count into its counter; returns the op's three
    results and the pad id that goes with the slot ids: the caller's where the index dtype
    holds it, else -1 (and -1 without ``slots``: the caller's may be one of 0..B-1, a live
    slot there)."""
    pad = pad_value(slots, pad_slot_id) if slots is not None else -1
    counter = errors.counter(device)
    if counter is None:  # a capture before any eager call: counted nowhere, as documented there
        counter = torch.zeros(len(errors.KINDS), dtype=torch.int64, device=device)
    slots_out, acc_out, qsl_out = op()(slots, accepted, query_start_loc, counter, batch, n_slots, pad,
                                       pad == pad_slot_id, length, total, rewrite)
    return slots_out, acc_out, qsl_out, pad
