"""Index value checks declared as data: what an op's ``value_checks`` returns.

An op's ``value_checks(*args)`` makes, once per memo signature, the checks that every call with
that signature runs on its index tensors. Made of these kinds, the checks are data as well as
functions: the Python path runs them (and they write every error message), and the compiled
call core reads their fields once and runs the same conditions in C++ on each call, handing a
call that fails one back to the Python path, which raises. An op's checks of any other form
(a plain function) stay valid; the core then calls them as they are.

- :class:`SlotIds`: ``args[index]`` holds slot ids into a pool of ``n_slots``: each is in
  ``[0, n_slots)`` or is the pad id, and no live slot appears twice.
- :class:`Offsets`: ``args[index]`` holds sequence start offsets: from 0, non-decreasing, to
  ``total``.
- :class:`Bounded`: every value of ``args[index]`` lies in ``lo..hi``.
- :class:`ValuePlan`: the checks of one signature; :func:`plan` makes the function that runs
  them, in order, after reporting what the device rule counted on the call's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kernel_variants._capture import capturing
from kernel_variants._runtime import device_errors as errors

# The kinds the call core knows, as it numbers them (CheckKind in _runtime/csrc/call_core.h).
SLOTS, OFFSETS, BOUNDED = 1, 2, 3
_INT64 = (-(2**63), 2**63 - 1)


def _slot_values(name: str, slots: list[int], n_slots: int, pad_slot_id: int) -> None:
    seen: set[int] = set()
    for b, s in enumerate(slots):
        if s == pad_slot_id:
            continue
        if not 0 <= s < n_slots:
            raise ValueError(
                f"{name}: expected slot indices in [0, {n_slots}) or pad_slot_id={pad_slot_id}, "
                f"got {s} at position {b}"
            )
        if s in seen:
            raise ValueError(f"{name}: expected distinct slots, got slot {s} twice (second at position {b})")
        seen.add(s)


@dataclass(frozen=True)
class SlotIds:
    """``args[index]`` (named ``name``): slot ids ``[batch]`` into a pool of ``n_slots``."""

    kind: ClassVar[int] = SLOTS
    index: int
    name: str
    n_slots: int
    pad: int
    batch: int

    def check(self) -> Callable[[Sequence[Any]], None]:
        i, name, n_slots, pad = self.index, self.name, self.n_slots, self.pad
        if self.batch == 1:  # a decode step of one sequence: one read, no list, no set

            def check_one(args: Sequence[Any]) -> None:
                try:
                    s = args[i].item()
                except RuntimeError:  # not one element: a bound call given other sizes; check them all
                    _slot_values(name, args[i].tolist(), n_slots, pad)
                    return
                if s != pad and not 0 <= s < n_slots:
                    _slot_values(name, [s], n_slots, pad)

            return check_one

        def check(args: Sequence[Any]) -> None:
            slots = args[i].tolist()
            live = [s for s in slots if s != pad] if pad in slots else slots
            # min, max and set run in C: the per-entry loop only runs to name a bad entry.
            if live and (min(live) < 0 or max(live) >= n_slots or len(set(live)) != len(live)):
                _slot_values(name, slots, n_slots, pad)

        return check


@dataclass(frozen=True)
class Offsets:
    """``args[index]`` (named ``name``): start offsets ``[B+1]`` of a batch of ``total`` items;
    ``end`` names ``total`` in messages."""

    kind: ClassVar[int] = OFFSETS
    index: int
    name: str
    total: int
    end: str

    def check(self) -> Callable[[Sequence[Any]], None]:
        i, name, total, end = self.index, self.name, self.total, self.end

        def check(args: Sequence[Any]) -> None:
            starts = args[i].tolist()
            if starts[0] != 0:
                raise ValueError(f"{name}: expected to start at 0, got {starts[0]}")
            for b in range(len(starts) - 1):
                if starts[b + 1] < starts[b]:
                    raise ValueError(
                        f"{name}: expected non-decreasing values, got {starts[b]} then "
                        f"{starts[b + 1]} at position {b + 1}"
                    )
            if starts[-1] != total:
                raise ValueError(f"{name}: expected to end at {end}, got {starts[-1]}")

        return check


@dataclass(frozen=True)
class Bounded:
    """``args[index]`` (named ``name``): every value in ``lo..hi``; ``hi_name`` names ``hi``."""

    kind: ClassVar[int] = BOUNDED
    index: int
    name: str
    lo: int
    hi: int
    hi_name: str

    def check(self) -> Callable[[Sequence[Any]], None]:
        i, name, lo, hi, hi_name = self.index, self.name, self.lo, self.hi, self.hi_name

        def check(args: Sequence[Any]) -> None:
            for b, n in enumerate(args[i].tolist()):
                if not lo <= n <= hi:
                    raise ValueError(f"{name}: expected values in {lo}..{hi_name}={hi}, got {n} at position {b}")

        return check


Declared = SlotIds | Offsets | Bounded


@dataclass(frozen=True)
class ValuePlan:
    """The value checks of one memo signature (as data), for a call whose first tensor is on
    ``device``."""

    device: torch.device
    checks: tuple[Declared, ...]

    def core_data(self) -> tuple[Declared, ...] | None:
        """The checks as the call core reads them (by ``kind`` and field name); None when a bound
        does not fit an int64 (a pad id outside it equals no index value: the core reads none)."""
        bounds = [v for c in self.checks for v in (
            (c.n_slots,) if isinstance(c, SlotIds) else (c.total,) if isinstance(c, Offsets) else (c.lo, c.hi))]
        return self.checks if all(_INT64[0] <= v <= _INT64[1] for v in bounds) else None


def plan(x: torch.Tensor, checks: list[Declared]) -> Callable[[Sequence[Any]], None] | None:
    """The function that runs ``checks`` on a call whose first tensor is ``x`` (None: there is
    nothing to read); its ``declared`` attribute is the :class:`ValuePlan`, which the call core
    reads. It first reports what the device rule counted on x's device, and off the CPU reads
    nothing while a graph is being captured. Closures, not objects with ``__call__``: on the
    Python path this runs on every call, and an instance call costs a tuple more."""
    if not checks:
        return None
    device = x.device
    kind = device.type
    pending = errors.pending
    fns = [c.check() for c in checks]
    if kind == "cpu" and len(fns) == 1:  # no graph capture on the CPU; the one-check case unrolled
        (only,) = fns

        def run_one(args: Sequence[Any]) -> None:
            if pending():
                errors.raise_pending(device)
            only(args)

        run_one.declared = ValuePlan(device, tuple(checks))  # type: ignore[attr-defined]
        return run_one

    def run(args: Sequence[Any]) -> None:
        if kind != "cpu" and capturing(kind):
            return
        if pending():
            errors.raise_pending(device)
        for check in fns:
            check(args)

    run.declared = ValuePlan(device, tuple(checks))  # type: ignore[attr-defined]
    return run
