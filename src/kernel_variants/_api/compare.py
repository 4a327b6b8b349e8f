"""Head-to-head of two variants, an incumbent and a candidate: measured here per shape
(:func:`compare`), or read from a CSV of figures measured elsewhere (:meth:`HeadToHead.from_csv`)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernel_variants._api.calibration import check_shapes
from kernel_variants._dtypes import as_dtype, dtype_name
from kernel_variants._registry.case import read_csv_rows, read_shapes
from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.spec import Shape
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.rows import Measurement
from kernel_variants._tuning.calibrate import Progress, measure_shape
from kernel_variants._tuning.timing import TimingConfig, check_mode

RANGE_DASH = "\N{EN DASH}"  # ranges as the regression report writes them


@dataclass(frozen=True)
class ShapeComparison:
    """One shape: the incumbent's and the candidate's microseconds per call, or why one has none
    (``"rejected: ..."``, ``"cannot run: ..."``)."""

    shape: Shape  # a tuple over the op's axes (or the CSV's shape columns)
    elements: int  # the product of the shape, or the CSV's elements column
    incumbent_us: float | None
    candidate_us: float | None
    incumbent_note: str = ""
    candidate_note: str = ""

    @property
    def ratio(self) -> float | None:
        """The candidate's time over the incumbent's: above 1 means the incumbent is faster."""
        if self.incumbent_us is None or self.candidate_us is None:
            return None
        return self.candidate_us / self.incumbent_us


@dataclass(frozen=True)
class HeadToHead:
    """Every shape of a head-to-head, and where the figures come from."""

    incumbent: str  # a variant id, or a CSV column without its _us unit
    candidate: str
    source: str  # "measured on cpu bfloat16", or the CSV's path
    pairs: tuple[ShapeComparison, ...]
    axes: tuple[str, ...]  # what the shapes' sizes are called (the op's axes, or the CSV's columns)

    def timed(self) -> list[ShapeComparison]:
        """The shapes where both were timed."""
        return [p for p in self.pairs if p.ratio is not None]

    def stats(self) -> dict[str, float | int | None]:
        """``shapes``, ``compared`` (both timed), ``incumbent_faster``, and the ``median``, ``min``
        and ``max`` of candidate/incumbent over the compared shapes (None without any)."""
        ratios = [p.ratio for p in self.timed()]
        return {
            "shapes": len(self.pairs), "compared": len(ratios),
            "incumbent_faster": sum(r > 1 for r in ratios),
            "median": statistics.median(ratios) if ratios else None,
            "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None,
        }

    def summary(self) -> str:
        """``I faster on X of N shapes, median C/I r (range lo-hi)`` over the shapes both ran (I the
        incumbent, C the candidate); the range takes an en dash, as in the regression report."""
        s = self.stats()
        a, b = self.incumbent, self.candidate
        if not s["compared"]:
            return f"{a} and {b} were not both timed on any of {s['shapes']} shapes"
        return (f"{a} faster on {s['incumbent_faster']} of {s['compared']} shapes, median {b}/{a} "
                f"{s['median']:.2f}x (range {s['min']:.2f}x{RANGE_DASH}{s['max']:.2f}x)")

    @classmethod
    def from_csv(cls, path: str | Path, incumbent: str, candidate: str, op: str | None = None) -> HeadToHead:
        """The head-to-head of two columns of microseconds, ``incumbent`` and ``candidate``, of a
        CSV of measurements with a column per axis of ``op`` (default: the first registered op;
        B, dim, seq for the conv ops) and optionally ``elements``. Every row must parse: the
        first bad one is the ``ValueError``."""
        registry = dispatcher().registry
        spec = registry.spec(op) if op is not None else registry.ops()[0]
        header, rows = read_csv_rows(path)
        if not header:
            raise ValueError(f"{path}: empty (expected a header with {', '.join(spec.axes)}, {incumbent}, {candidate})")
        for col in (incumbent, candidate):
            if col not in header:
                raise ValueError(f"{path}: no column {col!r} (columns: {', '.join(header)})")
        columns, shapes = read_shapes(header, rows, spec.axes, spec.axis_aliases, str(path))
        pairs = []
        for line, (row, shape) in enumerate(zip(rows, shapes, strict=True), start=2):
            times = [_time(row.get(col), path, line, col) for col in (incumbent, candidate)]
            elements = math.prod(shape)
            if row.get("elements"):
                try:
                    elements = int(row["elements"])
                except ValueError:
                    raise ValueError(f"{path}, line {line}: column elements: expected an integer, "
                                     f"got {row['elements']!r}") from None
            pairs.append(ShapeComparison(shape, elements, times[0], times[1]))
        a, b = _label(incumbent), _label(candidate)
        if a == b:
            a, b = incumbent, candidate
        return cls(a, b, str(path), tuple(pairs), tuple(columns))


def _time(raw: str | None, path: str | Path, line: int, col: str) -> float:
    try:
        t = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        t = math.nan
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"{path}, line {line}: column {col}: expected a positive time in µs, got {raw!r}")
    return t


def _label(col: str) -> str:
    return col.removesuffix("_us") or col


def compare(
    op: str,
    incumbent: str,
    candidate: str,
    shapes: Sequence[Sequence[int]],
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str = "cpu",
    timing: TimingConfig | None = None,
    rotate: int = 0,
    progress: Callable[[Progress], None] | None = None,
    **features: object,
) -> HeadToHead:
    """Check the variants ``incumbent`` and ``candidate`` of ``op`` against the reference at each
    of ``shapes`` (tuples over the op's axes), then time the ones that match, interleaved as
    ``timing`` says (see :func:`calibrate`), with ``features`` (default: the op's). Nothing is
    written to the table. A variant that is wrong at a shape, or cannot run it, has no time there
    and a note saying why."""
    if incumbent == candidate:
        raise ValueError(f"expected two different variants, got {incumbent!r} twice")
    d = dispatcher()
    spec = d.registry.spec(op)
    rvs = {v: d.registry.get(spec.name, v) for v in (incumbent, candidate)}  # KeyError naming what is registered
    if timing is not None and not isinstance(timing, TimingConfig):
        raise TypeError(f"timing: expected a kernel_variants.TimingConfig, got {type(timing).__name__}")
    timing = timing if timing is not None else TimingConfig()
    f = spec.features(**features)
    shapes = check_shapes(shapes, spec.axes)
    entries = d.registry.variants(spec.name)
    dt = as_dtype(dtype)
    device = str(torch.device(device))
    check_mode(timing, device)
    total, done = 2 * len(shapes), 0
    t0 = time.perf_counter()
    pairs = []
    try:
        for shape in shapes:
            def taken(m: Measurement) -> None:
                nonlocal done
                done += 1
                if progress is not None:
                    progress(Progress(done, total, m.shape, m.variant, time.perf_counter() - t0))

            ms = {m.variant: m for m in measure_shape(entries, spec, shape, dtype=dt, device=device, features=f,
                                                      timing=timing, rotate=rotate, only=[incumbent, candidate],
                                                      on_result=taken, qualifier=d.qualifier)}
            times, notes = {}, {}
            for v in (incumbent, candidate):
                m = ms.get(v)
                if m is None:
                    done += 1
                    key = CallKey(spec, torch.device(device).type, dtype_name(dt), f, shape)
                    notes[v] = f"cannot run: {rvs[v].why_not(key) or 'not measured'}"
                elif m.status == "rejected":
                    notes[v] = f"rejected: {m.reason}"
                else:
                    times[v] = m.best_us
            pairs.append(ShapeComparison(shape, math.prod(shape), times.get(incumbent), times.get(candidate),
                                         notes.get(incumbent, ""), notes.get(candidate, "")))
    finally:
        d.invalidate()  # a qualification verdict may have been stored
    return HeadToHead(incumbent, candidate, f"measured on {device} {dtype_name(dt)}", tuple(pairs), spec.axes)
