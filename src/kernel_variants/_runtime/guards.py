"""The write guard: before anything runs, no argument may share memory with a tensor the op
writes (a mutated state, or ``out``), whichever variant runs. Split per memo signature: what
depends only on metadata is worked out once (``write_plan``), a call then reads data pointers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.errors import (
    inference_error,
    out_overlap_error,
    outs_overlap_error,
    overlap_error,
    self_overlap_error,
)


class Written(NamedTuple):
    """A tensor the op writes (``args[index]``, ``span`` bytes from its first element to past its
    last) and the arguments of its dtype compared with it (``near``)."""

    index: int
    span: int
    near: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WritePlan:
    """A write plan's work as data, which the call core reads by field: the written tensors, and
    whether the call has an ``out`` (checked in Python only)."""

    writes: tuple[Written, ...]
    out: bool


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte] that ``t``'s elements can occupy (strides are never
    negative in torch, so the first element is the lowest address)."""
    start = t.data_ptr()
    return start, start + _span(t)


def _span(t: torch.Tensor) -> int:
    """How many bytes from ``t``'s first element to past its last one."""
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def guard_writes(spec: OpSpec, args: tuple[Any, ...], out: Any = None) -> bool:
    """Before anything runs: no argument may share memory with a tensor the op writes (a mutated
    state, or ``out``): the answer would depend on the order a variant reads and writes in. The
    one exception is an ``out`` that is exactly the input the spec lets it alias (same first
    byte, shape and strides: in place). An inference tensor cannot be written outside inference
    mode. One behaviour whichever variant runs. Only tensors of the written tensor's dtype are
    compared (index tensors cannot alias a float pool but by a deliberate reinterpretation).
    Returns whether an ``out`` is exactly an input."""
    plan = write_plan(spec, args, out)
    return plan is not None and plan(args, out)


def _guard_out(spec: OpSpec, args: tuple[Any, ...], outs: tuple[torch.Tensor, ...]) -> bool:
    aliased = False
    several = len(outs) > 1
    done: list[tuple[str, int, int]] = []
    for k, o in enumerate(outs):
        name = f"out[{k}]" if several else "out"
        if o.numel() == 0:
            continue
        if o.is_inference() and not torch.is_inference_mode_enabled():
            raise inference_error(name)
        if not o.is_contiguous() and torch._debug_has_internal_overlap(o) == 1:  # 1: certainly overlaps
            raise self_overlap_error(name, o.stride())
        lo, hi = _extent(o)
        allowed = spec.out_alias_indices[k]
        for i in spec.tensor_indices:
            a = args[i]
            if a is None or a.dtype != o.dtype or a.numel() == 0:
                continue
            a_lo, a_hi = _extent(a)
            if not (a_lo < hi and lo < a_hi):
                continue
            if i == allowed and a_lo == lo and a.shape == o.shape and a.stride() == o.stride():
                aliased = True
                continue
            raise out_overlap_error(name, spec.params[i], in_place_allowed=i == allowed)
        for other, o_lo, o_hi in done:
            if o_lo < hi and lo < o_hi:
                raise outs_overlap_error(name, other)
        done.append((name, lo, hi))
    return aliased


def write_plan(spec: OpSpec, args: tuple[Any, ...], out: Any) -> Callable[..., bool] | None:
    """:func:`guard_writes` split for one memo signature: what depends only on
    metadata (which tensors share the written tensor's dtype, how many bytes it spans) is
    worked out here, once; a call then reads data pointers (and a tensor's span only when it
    starts inside the written tensor's allocation, before it). ``None``: nothing to guard.
    Its ``declared`` attribute is that work as data (a :class:`WritePlan`): what the call core reads."""
    checks = []
    for mi in spec.mutated_indices:
        m = args[mi]
        if m is None or m.numel() == 0:
            continue
        near = tuple(i for i in spec.tensor_indices
                     if i != mi and args[i] is not None and args[i].dtype == m.dtype and args[i].numel() > 0)
        checks.append(Written(mi, _span(m), near))
    if not checks and out is None:
        return None
    checks_t = tuple(checks)
    inference_mode = torch.is_inference_mode_enabled

    def plan(args: tuple[Any, ...], out: Any) -> bool:
        for mi, span, near in checks_t:
            m = args[mi]
            if not inference_mode() and m.is_inference():  # serving runs in inference mode
                raise inference_error(spec.params[mi])
            lo = m.data_ptr()
            hi = lo + span
            base = m.untyped_storage().data_ptr()
            for i in near:
                a = args[i]
                a_lo = a.data_ptr()
                if a_lo >= hi or a_lo < base:
                    # Past m's last byte, or in another allocation (allocations are disjoint,
                    # and a tensor never reaches below its first byte: strides are >= 0).
                    continue
                if a_lo >= lo or a_lo + _span(a) > lo:
                    raise overlap_error(spec, i, spec.params[mi])
        return False if out is None else _guard_out(spec, args, spec.out_tensors(out))

    plan.declared = WritePlan(checks_t, out is not None)  # type: ignore[attr-defined]
    return plan
