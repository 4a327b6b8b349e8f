"""What Python hands the compiled call core, one named object per hand-over: the C++ reads each
field by its name, once (a core's construction, a learned entry), never per call, so that a
field added, dropped or moved on one side fails there by name instead of shifting every
argument after it. A per-call vectorcall (a core's call, a bound call, an engine's layout step)
stays positional: that is the path whose cost the core exists to cut."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


class _Keep:
    """In ``subs``: the variant gets the call's own value of this parameter."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<kernel_variants call core: keep>"


KEEP = _Keep()


def per_parameter(n: int, subs: tuple[tuple[int, Any], ...]) -> tuple[Any, ...]:
    """A hit's (parameter index, normalised value) pairs as one value per parameter (:data:`KEEP`
    where the call's own stands)."""
    out: list[Any] = [KEEP] * n
    for i, value in subs:
        out[i] = value
    return tuple(out)


@dataclass(frozen=True, slots=True)
class CoreSpec:
    """A CallCore's op: per parameter its kind (0 a value, 1 a tensor, 2 an optional tensor) and
    whether the op writes it; how many are positional, the keyword-only names; the pins'
    ContextVar, the device rule's counters, ``fail(vid, exc)`` (raises VariantFailed), the miss
    sentinel, the graph-call sentinel (passed as ``out``) and :data:`KEEP`."""

    kinds: tuple[int, ...]
    mutated: tuple[bool, ...]
    npos: int
    kwnames: tuple[str, ...]
    pins: ContextVar
    counters: dict
    fail: Callable[[str, BaseException], None]
    miss: object
    graph: object
    keep: object = KEEP


@dataclass(frozen=True, slots=True)
class Learned:
    """An entry the Python path memoised, handed to a core's ``learn``: the call (``args``,
    ``out``) whose key it is filed under, the variant (``fn``, ``vid``), ``subs`` (per parameter),
    the index checks as data (values.py's SlotIds, Offsets, Bounded; or None) with the device whose
    counted errors come first (``gate``), a check the core calls as it is (``py_checks``), the write
    guard's data (guards.Written), whether the Python path keeps such calls, the device rule."""

    args: tuple[Any, ...]
    out: Any
    fn: Callable[..., Any]
    vid: str
    subs: tuple[Any, ...]
    checks: tuple[Any, ...] | None
    gate: Any
    py_checks: Callable[..., None] | None
    guards: tuple[Any, ...]
    python_only: bool
    rule: Callable[..., tuple[Any, ...]] | None


@dataclass(frozen=True, slots=True)
class BoundSpec:
    """A BoundCore: the op's signature (``names`` with "out" last, ``npos``, ``defaults``, where
    ``required`` marks none), its parameters' kinds and writes, the example (its arguments in
    signature order, whether it needed a gradient, its write guard's data), the fixed values
    (indices, each ``expected``), and what a served call runs: ``subs``, the checks as in
    :class:`Learned`, the device rule, the counters, the variant, ``fail``, and ``fallback``,
    the bound function in Python, which gets every call the core does not run."""

    names: tuple[str, ...]
    npos: int
    defaults: tuple[Any, ...]
    required: object
    kinds: tuple[int, ...]
    mutated: tuple[bool, ...]
    example: tuple[Any, ...]
    grad: bool
    guards: tuple[Any, ...]
    fixed: tuple[int, ...]
    expected: tuple[Any, ...]
    subs: tuple[Any, ...]
    checks: tuple[Any, ...] | None
    gate: Any
    py_checks: Callable[..., None] | None
    rule: Callable[..., tuple[Any, ...]] | None
    counters: dict
    fn: Callable[..., Any]
    vid: str
    kwnames: tuple[str, ...]
    fail: Callable[[str, BaseException], None]
    fallback: Callable[..., Any]
    keep: object = KEEP


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """An op's compiled-graph kernel (``graph_kernel``): the op's ``entry`` (a callcore.Entry,
    its ``core`` read per call), the Python ``kernel`` that serves while the entry holds no core,
    ``miss`` (its path for a call the core hands back), ``bad(result)`` (the exception for a
    result that is not the op's outputs), the op's parameter count ``n`` and outputs ``n_out``."""

    entry: Any
    kernel: Callable[..., Any]
    miss: Callable[..., Any]
    bad: Callable[[Any], BaseException]
    n: int
    n_out: int
