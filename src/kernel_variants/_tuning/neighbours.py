"""Pruning by neighbours: a variant that lost by far at the shapes next to this one, measured
earlier in the same run, is neither checked nor timed here.

A kernel's time over another's moves smoothly with the shape: a variant 20x slower than the
winner at (8, 2048, 1024) and at (8, 4096, 1024) does not win (8, 4096, 2048). Timing it there
costs a full-size call of a slow kernel (often the largest part of a calibration) and cannot
change the winner. The evidence is held to more than pruning at the shape itself asks:

- only shapes measured in this run, and there only figures taken at that shape (a row pruned by
  its own neighbours is never evidence: a bound carried from shape to shape would drift away
  from any measurement);
- a neighbour is within ``REACH`` of the shape on every axis, and at least ``MIN_NEIGHBOURS``
  of them must have figures of both the variant and one same rival;
- the variant lost to that rival by more than ``NEIGHBOUR_FACTOR`` times the prune factor at
  **every** such neighbour;
- and, once the rival is timed here, the variant's least plausible time here is still more than
  the prune factor times the rival's. That least time assumes only that a kernel is not faster
  on a larger shape, nor faster per element on a smaller one (``Lost.lower_us``); so a rival
  that turns slow here (a fallback path, a cache cliff) voids the evidence, and the variant is
  checked and timed after all.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from kernel_variants._registry.spec import Shape
from kernel_variants._table.rows import Group, Measurement

REACH = 2.0  # a neighbour's every axis is within this factor of the shape's
MIN_NEIGHBOURS = 2
# Evidence from another shape asks twice the lead that pruning at the shape itself asks (3x by
# default, so 6x): the ratio can move a little between neighbours, and this must not flip a winner.
NEIGHBOUR_FACTOR = 2.0


@dataclass(frozen=True)
class Lost:
    """A variant lost to ``rival`` by more than ``ratio`` at each shape of ``at``; ``lower_us``
    is the least time per call it can take here, from its figures there."""

    ratio: float
    rival: str
    at: tuple[Shape, ...]
    lower_us: float

    def bound(self, rival_us: float) -> float:
        """How many times the rival's figure here (``rival_us``) this variant takes, at least."""
        return self.lower_us / rival_us if rival_us > 0 else 0.0

    def reason(self, rival_us: float) -> str:
        where = "; ".join(",".join(map(str, s)) for s in self.at)
        return (f"pruned by its neighbours: >= {floor1(self.bound(rival_us)):.1f}x {self.rival}'s time per call "
                f"here (not timed: it lost by >= {floor1(self.ratio):.1f}x at {where})")


def floor1(x: float) -> float:
    """``x`` rounded down to one decimal: a bound stays a bound when printed."""
    return math.floor(x * 10) / 10


class Evidence:
    """The figures taken at each shape of this run, per group: variant -> µs per call."""

    def __init__(self) -> None:
        self._at: dict[Group, dict[Shape, dict[str, float]]] = {}

    def note(self, ms: Iterable[Measurement]) -> None:
        for m in ms:
            if m.timed and not m.by_neighbours:
                self._at.setdefault(m.group, {}).setdefault(tuple(m.shape), {})[m.variant] = float(m.best_us)

    def lost(self, group: Group, shape: Shape, candidates: Collection[str], factor: float) -> dict[str, Lost]:
        """Each of ``candidates`` that lost by more than ``factor`` at every neighbour of
        ``shape`` (at least ``MIN_NEIGHBOURS``) to a rival among ``candidates`` that did not
        lose so itself. The rival is still to be timed here: ``Lost.bound`` of its figure says
        whether the variant is far enough behind to be left out."""
        near = {s: figs for s, figs in self._at.get(group, {}).items() if s != tuple(shape) and _near(s, shape)}
        if len(near) < MIN_NEIGHBOURS:
            return {}
        beaten: dict[str, dict[str, Lost]] = {}
        for v in candidates:
            for rival in candidates:
                if rival == v:
                    continue
                both = [(s, figs[v], figs[rival]) for s, figs in sorted(near.items())
                        if v in figs and rival in figs and figs[rival] > 0]
                if len(both) >= MIN_NEIGHBOURS and all(t / r > factor for _, t, r in both):
                    # Not faster on a larger shape, not faster per element on a smaller one.
                    lower = min(t * min(1.0, math.prod(shape) / math.prod(s)) for s, t, _ in both)
                    beaten.setdefault(v, {})[rival] = Lost(min(t / r for _, t, r in both), rival,
                                                           tuple(s for s, _, _ in both), lower)
        anchors = [v for v in candidates if v not in beaten]  # measured here, so each bound has a figure
        out = {}
        for v, by in beaten.items():
            usable = [lost for rival, lost in by.items() if rival in anchors]
            if usable:
                out[v] = max(usable, key=lambda lost: lost.ratio)
        return out


def _near(a: Shape, b: Shape) -> bool:
    reach = math.log(REACH) + 1e-9
    return len(a) == len(b) and all(abs(math.log(x / y)) <= reach for x, y in zip(a, b, strict=True))
