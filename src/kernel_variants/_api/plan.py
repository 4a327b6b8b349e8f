"""Planning a calibration: which (op, dtype, features, shape, variants) to measure for a sweep,
for the figures a sweep lacks, for the stale rows, or for the keys serving processes recorded;
then measuring the plan with :func:`calibrate`, one call per group and set of variants."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kernel_variants._api.calibration import (
    TableRow,
    calibrate,
    check_shapes,
    recorded,
    recorder,
    stale_rows,
    table,
)
from kernel_variants._registry.spec import Shape
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.fingerprint import device_part, fingerprint, fingerprint_id
from kernel_variants._table.rows import DEFAULT_PRUNE, Group, check_margin, check_prune
from kernel_variants._table.table import DEFAULT_MARGIN
from kernel_variants._tuning.calibrate import CalibrationResult, Progress
from kernel_variants._tuning.timing import TimingConfig, check_mode

Select = Literal["all", "missing", "stale", "recorded"]
SELECTS: tuple[str, ...] = ("all", "missing", "stale", "recorded")


@dataclass
class CalibrationJob:
    """The shapes of one group (``op``, ``dtype``, ``features``) to measure on ``device``, and with
    which variants at each shape."""

    op: str
    dtype: str  # canonical: "bfloat16"
    device: str  # "cpu", "cuda:0"...
    features: dict[str, Any]  # the op's features, every field set (``spec.features(...).model_dump()``)
    # shape (a tuple over the op's axes, (B, D, L) for the conv ops) -> the variant ids to measure
    # there, in order; an empty tuple: nothing left to measure at that shape
    variants: dict[Shape, tuple[str, ...]]
    threads: int | None = None  # a recorded key's CPU thread count (measured with it), when not ours
    recorded: dict[Shape, str] = field(default_factory=dict)  # the recorded key id of each shape

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return tuple(self.variants)

    def slug(self) -> str:
        """``op|dtype|flags``, as the table names the group."""
        return Group(op=self.op, dtype=self.dtype, features=self.features).slug()


@dataclass(frozen=True)
class JobResult:
    """What measuring one job did, and the table's row of each of its shapes afterwards."""

    job: CalibrationJob
    result: CalibrationResult
    rows: dict[Shape, TableRow]  # a shape without a row here has no measurement of this group


@dataclass
class CalibrationPlan:
    """What :meth:`run` measures: ``jobs`` (one per group), and the recorded keys that cannot be
    measured on this device, each a recorded entry with ``why``."""

    select: str
    jobs: list[CalibrationJob]
    not_measured: list[dict[str, Any]] = field(default_factory=list)
    # The storage keys of rows of an earlier release, by (group, shape, variant): dropped once
    # the run has measured that triple again.
    superseded: dict[tuple[Group, Shape, str], list[str]] = field(default_factory=dict)

    def run(self, *, timing: TimingConfig | None = None, rotate: int = 0, margin: float = DEFAULT_MARGIN,
            prune: float | None = DEFAULT_PRUNE, budget_s: float | None = None,
            progress: Callable[[Progress], None] | None = None) -> list[JobResult]:
        """Measure every job with :func:`calibrate` (the arguments as there), ``budget_s`` shared by
        all: a job met after the budget is spent lists its shapes as skipped. Then drops the rows
        of an earlier release measured again, and marks the recorded keys measured as done.
        Returns one :class:`JobResult` per job, in order."""
        check_margin(margin)  # before anything is measured
        prune = check_prune(prune)
        for job in self.jobs:
            check_mode(timing if timing is not None else TimingConfig(), job.device)
        d = dispatcher()
        done: list[tuple[CalibrationJob, CalibrationResult]] = []
        left = budget_s
        d.table.quiet_stale = self.select == "stale"
        try:
            for job in self.jobs:
                result, left = _run_job(job, timing, rotate, margin, prune, left, progress)
                done.append((job, result))
        finally:
            d.table.quiet_stale = False
        if self.superseded:
            measured = {(m.group, m.shape, m.variant) for _, r in done for m in r.measurements}
            d.table.drop([k for triple, keys in self.superseded.items() if triple in measured for k in keys])
        ids = [job.recorded[s] for job, r in done for s in {m.shape for m in r.measurements} if s in job.recorded]
        if ids:
            rec = recorder()
            try:
                rec.mark_done(ids)
            finally:
                rec.close()
        out = []
        for job, result in done:
            groups = {m.shape: m.group for m in result.measurements}
            with _threads(job.threads):  # the table as the measurements were filed
                rows = {r.shape: r for r in table(job.op, device=job.device) if groups.get(r.shape) == r.group}
            out.append(JobResult(job, result, rows))
        return out


def plan_calibration(
    select: Select = "all",
    op: str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str = "cpu",
    variants: Sequence[str] | None = None,
    **features: object,
) -> CalibrationPlan:
    """What a calibration of ``select`` measures, without measuring anything:

    - ``"all"``: ``variants`` (default: every available one) of ``op`` at each of ``shapes``
      (tuples over the op's axes), with ``features`` (default: the op's), in ``dtype``;
    - ``"missing"``: the same, less the variants a shape has a current figure (or a rejection or
      a pruning) for in this device's table; a new shape gets all of them;
    - ``"stale"``: the rows of this device that no longer match their variant (see
      :func:`stale_rows`; of ``op`` if given), each group with its own features and dtype;
    - ``"recorded"``: the keys serving processes recorded (``KV_RECORD=1``) and still waiting,
      each with its own op, features, dtype and shape; a key recorded on another device or
      software stack is listed in ``not_measured`` with why (one recorded with another CPU thread
      count is measured with that count).

    ``stale`` and ``recorded`` bring their own shapes and features. ``variants`` narrows every
    selection to those ids.
    """
    if select not in SELECTS:
        raise ValueError(f"select: expected one of {', '.join(SELECTS)}, got {select!r}")
    dev = str(torch.device(device))
    chosen = list(variants) if variants is not None else None
    if select in ("stale", "recorded"):
        if shapes is not None or features:
            raise ValueError(f"{select}: brings its own shapes and features, got shapes or features too")
        if select == "stale":
            return _stale_plan(op, dev, chosen)
        return _recorded_plan(op, dev, chosen)
    if op is None or shapes is None:
        raise ValueError(f"{select}: expected an op and its shapes")
    from kernel_variants._dtypes import canonical, dtype_name

    spec = dispatcher().registry.spec(op)
    dt = dtype_name(dtype) if isinstance(dtype, torch.dtype) else canonical(dtype)
    ids = tuple(chosen if chosen is not None else _available(spec.name))
    job = CalibrationJob(spec.name, dt, dev, spec.features(**features).model_dump(),
                         {tuple(s): ids for s in check_shapes(shapes, spec.axes)})
    return CalibrationPlan(select, [_missing(job) if select == "missing" else job])


def _available(op: str) -> list[str]:
    return [rv.id for rv in dispatcher().registry.variants(op) if rv.unavailable_reason() is None]


def _missing(job: CalibrationJob) -> CalibrationJob:
    """``job`` less the variants with a figure at each shape (all for a new shape)."""
    group = Group(op=job.op, dtype=job.dtype, features=job.features)
    rows = {r.shape: r for r in table(job.op, device=job.device) if r.group == group}
    for shape, ids in job.variants.items():
        row = rows.get(tuple(shape))
        have = set(row.times_us) | set(row.rejected) | set(row.pruned) if row is not None else set()
        job.variants[shape] = tuple(v for v in ids if v not in have)
    return job


def _stale_plan(op: str | None, device: str, variants: list[str] | None) -> CalibrationPlan:
    """One job per group of the stale rows, each shape with the variants stale there."""
    registry = dispatcher().registry
    op = registry.spec(op).name if op is not None else None
    jobs: dict[Group, CalibrationJob] = {}
    plan = CalibrationPlan("stale", [])
    for r in stale_rows(op, device=device):
        if variants is not None and r.variant not in variants:
            continue
        try:
            spec = registry.spec(r.group.op)
            f = spec.features(**r.group.flags()).model_dump()
        except ValueError:
            continue  # an op or features this release does not know
        job = jobs.setdefault(r.group, CalibrationJob(spec.name, r.group.dtype, device, f, {}))
        job.variants[r.shape] = (*job.variants.get(r.shape, ()), r.variant)
        if r.legacy:
            plan.superseded[(r.group, r.shape, r.variant)] = [r.key, r.winner_key]
    plan.jobs = list(jobs.values())
    return plan


def _recorded_plan(op: str | None, device: str, variants: list[str] | None) -> CalibrationPlan:
    """One job per group (and thread count) of the recorded keys waiting on this device type."""
    registry = dispatcher().registry
    ours = fingerprint(device)
    jobs: dict[tuple, CalibrationJob] = {}
    plan = CalibrationPlan("recorded", [])
    for entry in recorded(pending_only=True):
        if op is not None and entry.get("op") != registry.spec(op).name:
            continue
        why, threads = _recorded_fit(entry, ours, device)
        if why is None:
            try:
                spec = registry.spec(str(entry["op"]))
                f = spec.features(**dict(entry["features"])).model_dump()
                shape = tuple(int(v) for v in entry["shape"])
                if len(shape) != len(spec.axes):
                    raise ValueError(f"shape {shape} is not {spec.name}'s")
            except (ValueError, TypeError, KeyError) as exc:
                why = f"not a call this release can make ({exc})"
        if why is not None:
            plan.not_measured.append({**entry, "why": why})
            continue
        ids = tuple(v for v in _available(spec.name) if variants is None or v in variants)
        dt = str(entry["dtype"])
        slot = (spec.name, dt, Group(op=spec.name, dtype=dt, features=f), threads)
        job = jobs.setdefault(slot, CalibrationJob(spec.name, dt, device, f, {}, threads=threads))
        job.variants[shape] = ids
        job.recorded[shape] = str(entry["id"])
    plan.jobs = list(jobs.values())
    return plan


def _recorded_fit(entry: dict, ours: dict[str, str], device: str) -> tuple[str | None, int | None]:
    """(why a recorded key cannot be measured here or None, the thread count to measure it with)."""
    if entry.get("device") != torch.device(device).type:
        return f"recorded on {entry.get('device')}, not {torch.device(device).type} (pass --device)", None
    theirs = entry.get("fingerprint")
    if not isinstance(theirs, dict) or entry.get("fingerprint_id") == fingerprint_id(ours):
        return None, None
    # A key recorded before fingerprints named the CPU's kind: a shape to measure, on this CPU's
    # name (measuring it here says nothing of the CPU it was recorded on).
    theirs = device_part(theirs)
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if not differ:
        return None, None
    if differ == ["threads"] and str(theirs.get("threads", "")).isdigit():
        return None, int(theirs["threads"])  # the serving process's thread count: measured with it
    diff = ", ".join(f"{k} {theirs.get(k, '(none)')!r} vs {ours.get(k, '(none)')!r} here" for k in differ)
    return f"recorded on another device or stack ({diff})", None


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_job(job: CalibrationJob, timing: TimingConfig | None, rotate: int, margin: float, prune: float | None,
             left: float | None, progress: Callable[[Progress], None] | None,
             ) -> tuple[CalibrationResult, float | None]:
    """Measure one job, one :func:`calibrate` per set of variants; its result and the budget left."""
    result = CalibrationResult(job.op, job.device, job.dtype)
    by_ids: dict[tuple[str, ...], list[Shape]] = {}
    for shape, ids in job.variants.items():
        by_ids.setdefault(tuple(ids), []).append(shape)
    for ids, shapes in by_ids.items():
        if not ids:
            continue
        if left is not None and left <= 0:
            result.skipped += shapes
            continue
        with _threads(job.threads):
            part = calibrate(job.op, shapes, device=job.device, rotate=rotate, margin=margin, dtype=job.dtype,
                             variants=list(ids), progress=progress, prune=prune, budget_s=left, timing=timing,
                             **job.features)
        result.measurements += part.measurements
        result.winners.update(part.winners)
        result.skipped += part.skipped
        result.elapsed_s += part.elapsed_s
        result.breakdown.merge(part.breakdown)
        if left is not None:
            left -= part.elapsed_s
    return result, left
