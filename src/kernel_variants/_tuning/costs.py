"""Where a calibration's time went: seconds per kind of work, overall and per variant, so that
a slow calibration says what to cut (``kv calibrate`` prints it; ``--json`` has it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# The kinds of work, in the order a shape meets them: building compiled variants, qualifying a
# class (its edge cases), making a shape's inputs, the reference's output there, checking each
# variant there, timing the variants kept, timing variants before they were pruned, and writing
# rows and deciding winners.
KINDS: tuple[str, ...] = ("build", "qualification", "inputs", "reference", "checks", "timing", "timing_pruned",
                          "table")


@dataclass
class Breakdown:
    """Seconds per kind of work (``KINDS``), and per variant where the work was one variant's."""

    seconds: dict[str, float] = field(default_factory=dict)
    by_variant: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, kind: str, seconds: float, variant: str | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        if variant is not None:
            mine = self.by_variant.setdefault(variant, {})
            mine[kind] = mine.get(kind, 0.0) + seconds

    @contextmanager
    def timer(self, kind: str, variant: str | None = None) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - t, variant)

    def merge(self, other: Breakdown) -> None:
        for kind, s in other.seconds.items():
            self.add(kind, s)
        for variant, kinds in other.by_variant.items():
            mine = self.by_variant.setdefault(variant, {})
            for kind, s in kinds.items():
                mine[kind] = mine.get(kind, 0.0) + s

    def as_dict(self, elapsed_s: float) -> dict[str, Any]:
        """Plain data: each kind's seconds (every kind, 0 where none), ``other_s`` (the rest of
        ``elapsed_s``: progress, bookkeeping) and the per-variant seconds."""
        seconds = {kind: round(self.seconds.get(kind, 0.0), 3) for kind in KINDS}
        return {"seconds": seconds, "other_s": round(max(0.0, elapsed_s - sum(self.seconds.values())), 3),
                "by_variant": {v: {k: round(s, 3) for k, s in kinds.items()}
                               for v, kinds in sorted(self.by_variant.items())}}
