"""Two variants (or two columns of measurements taken elsewhere) side by side, per shape.

``kv compare`` reports the comparison and ``kv gate`` turns it into a verdict; both take the
same shape and measurement options, defined here.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import ProgressBar
from kernel_variants._dtypes import as_dtype
from kernel_variants._registry import CallKey, Features, OpSpec
from kernel_variants._registry.case import read_csv_rows, read_shapes
from kernel_variants._registry.spec import Shape
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.table import Measurement
from kernel_variants._tuning.calibrate import Progress, measure_shape
from kernel_variants._tuning.timing import TimingConfig

RANGE_DASH = "\N{EN DASH}"  # ranges as the regression report writes them


@dataclass(frozen=True)
class Pair:
    """One shape: A's and B's microseconds, or why one has none (rejected, cannot run)."""

    shape: Shape
    elements: int
    a_us: float | None
    b_us: float | None
    a_note: str = ""
    b_note: str = ""

    @property
    def ratio(self) -> float | None:
        """B's time over A's: above 1 means A is faster."""
        return None if self.a_us is None or self.b_us is None else self.b_us / self.a_us


@dataclass(frozen=True)
class HeadToHead:
    a: str  # label of A: a variant id, or a CSV column without its _us unit
    b: str
    source: str  # "measured on cpu bfloat16" or the CSV path
    pairs: tuple[Pair, ...]
    axes: tuple[str, ...]  # what the shapes' sizes are called (the CSV's columns, or the op's axes)

    def timed(self) -> list[Pair]:
        return [p for p in self.pairs if p.ratio is not None]

    def stats(self) -> dict[str, float | int | None]:
        ratios = [p.ratio for p in self.timed()]
        return {
            "shapes": len(self.pairs), "compared": len(ratios),
            "a_faster": sum(r > 1 for r in ratios),
            "median": statistics.median(ratios) if ratios else None,
            "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None,
        }

    def summary(self) -> str:
        """``A faster on X of N shapes, median B/A r (range lo-hi)`` over the shapes both ran; the
        range takes an en dash, as in the report this line reproduces."""
        s = self.stats()
        if not s["compared"]:
            return f"{self.a} and {self.b} were not both timed on any of {s['shapes']} shapes"
        return (f"{self.a} faster on {s['a_faster']} of {s['compared']} shapes, median {self.b}/{self.a} "
                f"{s['median']:.2f}x (range {s['min']:.2f}x{RANGE_DASH}{s['max']:.2f}x)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Shape, measurement and CSV options shared by compare and gate."""
    opt.add_op(p)
    opt.add_sweep(p)
    opt.add_dtype(p)
    opt.add_device(p)
    g = p.add_argument_group("measurements taken elsewhere")
    g.add_argument("--from-csv", metavar="FILE", help="a CSV with B, dim, seq and one µs column per side")
    g.add_argument("--a-col", metavar="COL", help="column of A's (the incumbent's) microseconds")
    g.add_argument("--b-col", metavar="COL", help="column of B's (the candidate's) microseconds")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    opt.add_timing(p)
    opt.add_features(p)


def collect(args: argparse.Namespace, a: str | None, b: str | None) -> HeadToHead:
    """Read the CSV given with ``--from-csv``, or measure variants ``a`` and ``b``."""
    if args.from_csv:
        if args.sweep or args.shapes:
            raise ValueError("--from-csv brings its own shapes: drop --sweep/--shapes")
        a_col, b_col = args.a_col or a, args.b_col or b
        if not a_col or not b_col:
            raise ValueError("--from-csv needs the two columns to compare: --a-col COL --b-col COL")
        spec = opt.op_spec(args.op) if args.op else opt.registry().ops()[0]
        return read_csv(args.from_csv, a_col, b_col, spec)
    if args.a_col or args.b_col:
        raise ValueError("--a-col/--b-col name columns of --from-csv FILE, which is missing")
    if not a or not b:
        raise ValueError("expected the two variant ids to compare (or --from-csv FILE --a-col COL --b-col COL)")
    if a == b:
        raise ValueError(f"expected two different variants, got {a!r} twice")
    work = opt.work(args)
    bar = None if args.quiet else ProgressBar(axes=work.spec.axes)
    try:
        return measure(a, b, work.spec, work.shapes, dtype=opt.dtype(args.dtype), device=opt.device(args.device),
                       features=work.features, timing=opt.timing(args), rotate=args.rotate, progress=bar)
    finally:
        if bar is not None:
            bar.close()


def measure(a: str, b: str, spec: OpSpec, shapes: Sequence[Shape], *, dtype: str, device: str,
            features: Features, timing: TimingConfig, rotate: int = 0,
            progress: Callable[[Progress], None] | None = None) -> HeadToHead:
    """Verify, then time, ``a`` and ``b`` on each shape; nothing is written to the table."""
    registry = dispatcher().registry
    rvs = {v: registry.get(spec.name, v) for v in (a, b)}  # KeyError naming what is registered
    entries = registry.variants(spec.name)
    dt = as_dtype(dtype)
    total, done = 2 * len(shapes), 0
    t0 = time.perf_counter()
    pairs = []
    for shape in shapes:
        def taken(m: Measurement) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(Progress(done, total, m.shape, m.variant, time.perf_counter() - t0))

        ms = {m.variant: m for m in measure_shape(entries, spec, shape, dtype=dt, device=device, features=features,
                                                  timing=timing, rotate=rotate, only=[a, b], on_result=taken)}
        times, notes = {}, {}
        for v in (a, b):
            m = ms.get(v)
            if m is None:
                done += 1
                key = CallKey(spec, torch.device(device).type, str(dt).removeprefix("torch."), features, shape)
                notes[v] = f"cannot run: {rvs[v].why_not(key) or 'not measured'}"
            elif m.status == "rejected":
                notes[v] = f"rejected: {m.reason}"
            else:
                times[v] = m.best_us
        pairs.append(Pair(shape, math.prod(shape), times.get(a), times.get(b), notes.get(a, ""), notes.get(b, "")))
    return HeadToHead(a, b, f"measured on {device} {str(dt).removeprefix('torch.')}", tuple(pairs), spec.axes)


def _label(col: str) -> str:
    return col.removesuffix("_us") or col


def read_csv(path: str | Path, a_col: str, b_col: str, spec: OpSpec) -> HeadToHead:
    """Pairs from a CSV of measurements: a column per axis of ``spec`` (B, dim, seq for the conv
    ops), optionally elements, and the two microsecond columns named. Every row must parse; the
    first bad one is the error."""
    header, rows = read_csv_rows(path)
    if not header:
        raise ValueError(f"{path}: empty (expected a header with {', '.join(spec.axes)}, {a_col}, {b_col})")
    for col in (a_col, b_col):
        if col not in header:
            raise ValueError(f"{path}: no column {col!r} (columns: {', '.join(header)})")
    columns, shapes = read_shapes(header, rows, spec.axes, spec.axis_aliases, str(path))
    pairs = []
    for line, (row, shape) in enumerate(zip(rows, shapes, strict=True), start=2):
        times = []
        for col in (a_col, b_col):
            raw = row.get(col)
            try:
                t = float(raw)
            except (TypeError, ValueError):
                t = math.nan
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"{path}, line {line}: column {col}: expected a positive time in µs, got {raw!r}")
            times.append(t)
        elements = math.prod(shape)
        if row.get("elements"):
            try:
                elements = int(row["elements"])
            except ValueError:
                raise ValueError(f"{path}, line {line}: column elements: expected an integer, "
                                 f"got {row['elements']!r}") from None
        pairs.append(Pair(shape, elements, times[0], times[1]))
    a, b = _label(a_col), _label(b_col)
    if a == b:
        a, b = a_col, b_col
    return HeadToHead(a, b, str(path), tuple(pairs), tuple(columns))
