"""The calibration API: measure, read and clear the table of the process-wide dispatcher."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.spec import Shape
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import DEFAULT_PRUNE, Group, StaleRow
from kernel_variants._table.store import Recorder
from kernel_variants._table.table import DEFAULT_MARGIN
from kernel_variants._tuning.calibrate import CalibrationResult, Progress, run_calibration
from kernel_variants._tuning.distributed import calibrate_distributed
from kernel_variants._tuning.timing import TimingConfig


def check_shapes(shapes: Sequence[Sequence[int]], axes: Sequence[str]) -> list[Shape]:
    out = []
    for s in shapes:
        if len(s) != len(axes) or not all(isinstance(v, int) and v >= 1 for v in s):
            raise ValueError(f"shapes: expected ({', '.join(axes)}) tuples of positive ints, got {tuple(s)!r}")
        out.append(tuple(s))
    if not out:
        raise ValueError(f"shapes: expected at least one ({', '.join(axes)}), got none")
    return out


# calibrate's timing keywords before it took a TimingConfig, and the field each became.
_TIMING_KEYWORDS = {"warmup": "warmup", "windows": "windows", "iters": "iters", "window_budget_s": "window_budget_s",
                    "timing_mode": "mode", "cold_l2": "cold_l2", "with_out": "with_out"}


def calibrate(
    op: str,
    shapes: Sequence[Sequence[int]],
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str = "cpu",
    variants: Sequence[str] | None = None,
    timing: TimingConfig | None = None,
    rotate: int = 0,
    margin: float = DEFAULT_MARGIN,
    progress: Callable[[Progress], None] | None = None,
    prune: float | None = DEFAULT_PRUNE,
    budget_s: float | None = None,
    distributed: bool = False,
    **features: object,
) -> CalibrationResult:
    """Measure ``variants`` (default: every available one) of ``op`` on each shape (a tuple over
    the op's axes, ``(B, D, L)`` for the conv ops), with the op's ``features`` (``width=3``,
    ``activation=None``...; defaults: the op's).

    Each variant is first checked against the reference on the shape's inputs; one that differs,
    raises or gives NaN/Inf is recorded as rejected with the reason and never chosen there. The
    others are timed, interleaved as ``timing`` (a :class:`TimingConfig`; default: 5 warm-up
    calls, then 5 rounds of one window each, min over windows of the mean of 100 calls, fewer
    when a window would exceed 0.25 s) says: one window of each in turn (``rotate`` adds
    cold-cache input copies), and stored with each window's figure. After the first round, a variant slower than the best by more than ``prune`` times is
    stored as pruned with that ratio and timed no further; one that lost by more than twice that
    to the same rival at the neighbouring shapes measured earlier in the call is stored as pruned
    by its neighbours, neither checked nor timed (``prune=None``: check and time every variant
    fully). The result's ``breakdown`` says where the time went. ``budget_s`` bounds the run:
    shapes that no longer fit are listed in the result's
    ``skipped``. A shape's winner changes only when a challenger is faster by more than
    ``margin`` and by more than the two figures' measured noise.

    ``TimingConfig(mode="graph")`` (CUDA) times the replay of a captured CUDA graph of each
    window's calls instead of eager launches; ``cold_l2`` (CUDA) rotates as many input copies as
    make twice the device's L2. ``with_out`` times each call writing into a preallocated
    ``out=``, as the dispatcher runs it: for callers that always pass ``out``. Each
    measurement's ``method`` says how it was taken.

    ``distributed=True``: across the ranks of this ``torchrun`` job, leaving every rank with the
    same table. A collective: every rank calls it with the same arguments; ``device`` is a device
    type (each rank measures on ``TYPE:LOCAL_RANK``). Each rank measures a share of the (shape,
    variant) pairs; rank 0 records them all and decides the winners, every other rank imports
    rank 0's table (the result's ``imported`` says what that changed; ``rank`` and
    ``world_size`` say where it ran). Nothing is pruned and no budget applies (the ranks would
    stop at different shapes). Ranks must have one device fingerprint and one set of variant
    versions (a ``ValueError`` names the ranks that differ). It joins the default process group,
    or creates it from the torchrun environment for the call.
    """
    moved = [k for k in _TIMING_KEYWORDS if k in features]
    if moved:
        raise TypeError(f"calibrate: {', '.join(moved)} moved into timing=kernel_variants.TimingConfig(...) "
                        f"(TimingConfig({', '.join(f'{_TIMING_KEYWORDS[k]}=...' for k in moved)}))")
    d = dispatcher()
    spec = d.registry.spec(op)
    if timing is not None and not isinstance(timing, TimingConfig):
        raise TypeError(f"timing: expected a kernel_variants.TimingConfig, got {type(timing).__name__}")
    timing = timing if timing is not None else TimingConfig()
    if distributed:
        if budget_s is not None:
            raise ValueError("budget_s: a distributed calibration takes none (the ranks would stop at different shapes)")
        if prune not in (None, DEFAULT_PRUNE):
            raise ValueError(f"prune: a distributed calibration prunes nothing (each rank times its share), got {prune}")
        try:
            return calibrate_distributed(d, spec.name, check_shapes(shapes, spec.axes), dtype=dtype, device=device,
                                         features=spec.features(**features), timing=timing, variants=variants,
                                         rotate=rotate, margin=margin, progress=progress)
        finally:
            d.invalidate()
    try:
        return run_calibration(d.registry.variants(spec.name), d.table, spec, check_shapes(shapes, spec.axes),
                               dtype=dtype, device=str(torch.device(device)), features=spec.features(**features),
                               timing=timing, variants=variants, rotate=rotate, margin=margin, progress=progress,
                               prune=prune, budget_s=budget_s, qualifier=d.qualifier)
    finally:
        d.invalidate()


@dataclass(frozen=True)
class TableRow:
    """One calibrated shape: every variant's microseconds, the winner and its lead."""

    group: Group
    shape: Shape
    times_us: dict[str, float]
    # Every variant with a figure: the fully timed ones, and the pruned ones with their first
    # (rough, far slower) figure; ``pruned`` says which are which.
    rejected: dict[str, str]
    winner: str | None
    # Variants that could run this shape here but have no current figure: an incomplete row
    # (the dispatcher then lets priority decide between them and the measured winner).
    missing: tuple[str, ...] = ()
    # Timed for the first round only: variant -> at least how many times slower than the best.
    pruned: dict[str, float] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)  # variant -> its measured noise
    confidence: str = ""  # the winner row's: "clear", "within noise", "single" ("" if older)
    methods: tuple[str, ...] = ()  # how the figures were taken (clock, eager or graph replay...)
    # Those of ``pruned`` not timed here at all: they lost by far at the neighbouring shapes.
    by_neighbours: frozenset[str] = frozenset()

    @property
    def margin(self) -> float | None:
        """Runner-up time over winner time, minus one (how far ahead the winner is)."""
        if self.winner is None or self.winner not in self.times_us or len(self.times_us) < 2:
            return None
        others = [t for v, t in self.times_us.items() if v != self.winner]
        return min(others) / self.times_us[self.winner] - 1


def table(op: str | None = None, *, device: str = "cpu") -> list[TableRow]:
    """The calibrated shapes of this device (of ``op``, if given), grouped and sorted."""
    d = dispatcher()
    fpid = fingerprint_id(fingerprint(str(torch.device(device))))
    rows, winners = d.table.measurements(d.versions(), fpid)
    out = []
    for (group, shape), by_v in rows.items():
        if op is not None and group.op != op:
            continue
        w = winners.get((group, shape))
        times = {v: m.best_us for v, m in by_v.items() if m.timed}
        pruned = {v: m.pruned_at or 0.0 for v, m in by_v.items() if m.status == "pruned"}
        out.append(TableRow(group, shape, times, {v: m.reason for v, m in by_v.items() if m.status == "rejected"},
                            w.variant if w is not None and w.variant in times else None,
                            missing_variants(group, shape, set(by_v), device), pruned,
                            {v: m.noise for v, m in by_v.items() if m.noise is not None},
                            w.confidence if w is not None else "",
                            tuple(sorted({m.method for m in by_v.values() if m.method})),
                            frozenset(v for v, m in by_v.items() if m.by_neighbours)))
    return sorted(out, key=lambda r: (r.group.slug(), r.shape))


def missing_variants(group: Group, shape: Shape, measured: set[str], device: str = "cpu") -> tuple[str, ...]:
    """Variants of ``group``'s op that can run ``shape`` on ``device`` but have no figure there."""
    d = dispatcher()
    try:
        spec = d.registry.spec(group.op)
        key = CallKey(spec, torch.device(device).type, group.dtype, spec.features(**group.flags()), tuple(shape))
    except ValueError:  # an op or features this release does not know: nothing to say
        return ()
    return tuple(rv.id for rv in d.registry.variants(spec.name) if rv.id not in measured and rv.why_not(key) is None)


def clear_table(op: str | None = None, variant: str | None = None) -> int:
    """Forget measurements of ``op`` (and of ``variant`` only, if given); returns entries removed."""
    d = dispatcher()
    try:
        return d.table.clear(op, variant, versions=d.versions())
    finally:
        d.invalidate()


def stale_rows(op: str | None = None, *, device: str = "cpu") -> list[StaleRow]:
    """This device's measurements that no longer match their variant (its source, declared
    version or a declared dependency changed), and rows written by an earlier release; each
    says why. ``kv calibrate --stale`` re-measures exactly these."""
    d = dispatcher()
    fpid = fingerprint_id(fingerprint(str(torch.device(device))))
    entries = d.registry.variants()
    deps = {(rv.op, rv.id): rv.deps for rv in entries}
    sources = {(rv.op, rv.id): rv.source_version for rv in entries}
    return [r for r in d.table.stale(d.versions(), deps, fpid, sources) if op is None or r.group.op == op]


def recorder() -> Recorder:
    """The record ``KV_RECORD`` writes to (the table directory, or the directory it names)."""
    from kernel_variants._runtime.dispatcher import record_dir

    d = dispatcher()
    where = record_dir(os.environ.get("KV_RECORD", ""), d.table.directory)
    return Recorder(where if where is not None else d.table.directory)


def recorded(pending_only: bool = False) -> list[dict]:
    """The call keys serving processes recorded (``KV_RECORD=1``) because the table had no
    measured row for them, oldest first; ``done_at`` is set once ``kv calibrate --recorded``
    measured one."""
    r = recorder()
    try:
        return r.entries(pending_only)
    finally:
        r.close()
