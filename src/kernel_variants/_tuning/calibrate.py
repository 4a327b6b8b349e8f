"""Calibration: check every candidate against the reference on a shape, time the ones that
match, store per-variant figures and re-decide the shape's winner."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernel_variants._decide import Facts, Qualify, admissions
from kernel_variants._dtypes import as_dtype, dtype_name
from kernel_variants._policy import NOT_YET, is_reference, qualifies
from kernel_variants._registry.case import Case
from kernel_variants._registry.keys import CallKey, Features
from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants._registry.spec import OpSpec, Shape
from kernel_variants._table.exchange import ImportReport
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import Group, Measurement, Winner, check_margin, check_prune
from kernel_variants._table.table import CalibrationTable
from kernel_variants._tuning import timing as _timing
from kernel_variants._tuning.costs import Breakdown
from kernel_variants._tuning.inputs import input_copies, seed_of, with_out
from kernel_variants._tuning.neighbours import NEIGHBOUR_FACTOR, Evidence, floor1
from kernel_variants._tuning.qualify import Qualifier
from kernel_variants._tuning.timing import Failed, Pruned, TimingConfig, check_mode
from kernel_variants._tuning.verify import Expected, reference_result, verify


@dataclass
class Progress:
    done: int
    total: int
    shape: Shape
    variant: str
    elapsed_s: float

    @property
    def eta_s(self) -> float:
        return self.elapsed_s / self.done * (self.total - self.done) if self.done else float("nan")


@dataclass
class CalibrationResult:
    """Everything one run measured, and the winner each shape ended with."""

    op: str
    device: str
    dtype: str
    measurements: list[Measurement] = field(default_factory=list)
    winners: dict[Shape, Winner | None] = field(default_factory=dict)
    skipped: list[Shape] = field(default_factory=list)  # not started: the time budget was spent
    elapsed_s: float = 0.0
    # Under torchrun (calibrate(distributed=True)): this rank, the ranks, and on ranks other than
    # 0 what importing rank 0's table changed here.
    rank: int = 0
    world_size: int = 1
    imported: ImportReport | None = None
    breakdown: Breakdown = field(default_factory=Breakdown)  # where ``elapsed_s`` went

    def rejected(self) -> list[Measurement]:
        return [m for m in self.measurements if m.status == "rejected"]

    def pruned(self) -> list[Measurement]:
        return [m for m in self.measurements if m.status == "pruned"]

    def pruned_by_neighbours(self) -> list[Measurement]:
        return [m for m in self.measurements if m.by_neighbours]


def candidates(entries: Iterable[RegisteredVariant], key: CallKey, wanted: Sequence[str] | None,
               costs: Breakdown | None = None) -> list[tuple[RegisteredVariant, str | None]]:
    """Each entry with why it cannot be measured for ``key`` (None when it can); a variant
    compiled here is built first (``costs`` notes how long that took)."""
    costs = costs if costs is not None else Breakdown()
    out = []
    for rv in entries:
        if wanted is None or rv.id in wanted:
            why = rv.variant.capabilities.uncovered(key)
            if why is None:
                with costs.timer("build", rv.id):
                    why = rv.ensure_built()
            out.append((rv, why))
    return out


def measure_shape(
    entries: Sequence[RegisteredVariant],
    spec: OpSpec,
    shape: Shape,
    *,
    dtype: torch.dtype,
    device: str,
    features: Features,
    timing: TimingConfig,
    rotate: int = 0,
    only: Sequence[str] | None = None,
    on_result: Callable[[Measurement], None] | None = None,
    prune: float | None = None,
    deadline: float | None = None,
    qualifier: Qualifier,
    evidence: Evidence | None = None,
    costs: Breakdown | None = None,
) -> list[Measurement]:
    """Qualify each of ``entries`` that can run ``shape`` for its class and check it at ``shape``
    (rejected ones say why; a failed check fails the class, see ``Qualifier.check``), then time the
    ones that match, interleaved (see ``_timing.measure_interleaved``); ``prune`` and
    ``deadline`` are passed on. With ``prune`` and ``evidence`` (the figures taken so far in this
    run), a variant that lost by far at the neighbouring shapes is neither checked nor timed
    (``neighbours``). ``on_result`` sees each measurement as soon as it is taken; ``costs``
    gains where the time went."""
    check_mode(timing, device)
    run = _ShapeRun(spec, tuple(shape), dtype, device, features, timing, rotate, qualifier, on_result,
                    costs if costs is not None else Breakdown())
    runnable = [rv for rv, why in candidates(entries, run.key, only, run.costs) if why is None]
    held = {}
    if evidence is not None and prune is not None:
        held = evidence.lost(run.group, run.shape, [rv.id for rv in runnable], prune * NEIGHBOUR_FACTOR)
    first_pass = [rv for rv in runnable if rv.id not in held]
    figures = run.time(run.check(first_pass), prune, deadline)
    late = []
    for rv in runnable:
        lost = held.get(rv.id)
        if lost is None:
            continue
        barred = _barred(qualifier, rv, run.key)
        if barred is not None:  # a failed class is rejected here, as in a check
            run.emit(Measurement(status="rejected", reason=barred, measured_at=time.time(), **run.base(rv)))
        elif lost.rival in figures and lost.bound(figures[lost.rival]) > prune:
            t = lost.lower_us  # the least it can take here: a figure that keeps it measured-slower
            run.emit(Measurement(status="pruned", reason=lost.reason(figures[lost.rival]), best_us=t, median_us=t,
                                 spread=0.0, windows=0, iters=0, method="not timed here: pruned by its neighbours",
                                 pruned_at=floor1(lost.bound(figures[lost.rival])), measured_at=time.time(),
                                 **run.base(rv)))
        else:  # its rival has no figure here, or is not far enough ahead here: it is measured itself
            late.append(rv)
    if late:
        run.time(run.check(late), prune, deadline)
    return run.out


class _ShapeRun:
    """One shape's measurement: its cases, the reference's result there (computed once, when the
    first variant is checked), and the rows taken."""

    def __init__(self, spec: OpSpec, shape: Shape, dtype: torch.dtype, device: str, features: Features,
                 timing: TimingConfig, rotate: int, qualifier: Qualifier,
                 on_result: Callable[[Measurement], None] | None, costs: Breakdown) -> None:
        self.spec, self.shape, self.dtype, self.device, self.features = spec, shape, dtype, device, features
        self.timing, self.rotate, self.qualifier, self.on_result, self.costs = timing, rotate, qualifier, on_result, costs
        self.dev = torch.device(device)
        with costs.timer("inputs"):
            self.case = spec.sweep_case(shape, features, dtype=dtype, device=device, seed=seed_of(shape))
            # The check at this shape holds the op's traps (pads, poisoned rows): a kernel wrong only
            # at large sizes, or only on pads, is caught where it would run. The timing case has none.
            self.check_case = spec.make_case(shape, dtype=dtype, device=device, seed=seed_of(shape),
                                             **{**features.model_dump(), **spec.check_options})
        self.key = spec.key_of_case(self.case)
        self.group = Group.of(self.key)
        self.fp = fingerprint(device)
        self.fpid = fingerprint_id(self.fp)
        self.out: list[Measurement] = []
        self.first: dict[str, float] = {}  # seconds one call of each took while it was checked
        self._expected: Expected | None = None
        self._copies: tuple[list[Case], str] | None = None

    def base(self, rv: RegisteredVariant) -> dict[str, Any]:
        return dict(fingerprint=self.fp, fingerprint_id=self.fpid, group=self.group, shape=self.shape,
                    variant=rv.id, version=rv.version, deps=rv.deps)

    def emit(self, m: Measurement) -> None:
        self.out.append(m)
        if self.on_result is not None:
            self.on_result(m)

    def expected(self) -> Expected:
        if self._expected is None:
            with self.costs.timer("reference"):
                self._expected = reference_result(self.check_case, _timed(self.spec.reference.fn, self.dev,
                                                                          self.first, "\0reference"))
        return self._expected

    def check(self, rvs: Sequence[RegisteredVariant]) -> list[RegisteredVariant]:
        """Those of ``rvs`` that are right at this shape (the others are emitted as rejected)."""
        passed = []
        for rv in rvs:
            if is_reference(rv, self.spec):  # the oracle itself: its result is the expected one
                self.expected()
                bad, self.first[rv.id] = None, self.first["\0reference"]
            else:
                with self.costs.timer("qualification", rv.id):
                    bad = _barred(self.qualifier, rv, self.key)  # its class's edge cases first
                if bad is None:
                    expected = self.expected()
                    with self.costs.timer("checks", rv.id):
                        bad = verify(_timed(rv.variant.fn, self.dev, self.first, rv.id), self.check_case, expected)
                    if qualifies(self.qualifier.policy):  # off: rejected at this shape, no verdict kept
                        verdict = self.qualifier.check(rv, self.key, self.shape, bad, ran=True)
                        bad = None if verdict.passed else verdict.summary()
            if bad is None:
                passed.append(rv)
            else:
                self.emit(Measurement(status="rejected", reason=bad, measured_at=time.time(), **self.base(rv)))
        return passed

    def time(self, timed: Sequence[RegisteredVariant], prune: float | None,
             deadline: float | None) -> dict[str, float]:
        """Time ``timed`` interleaved and emit their rows; returns each one's figure (µs per call)."""
        if not timed:
            return {}
        spec, timing = self.spec, self.timing
        if self._copies is None:
            with self.costs.timer("inputs"):
                self._copies = input_copies(spec, self.case, self.shape, self.features, dtype=self.dtype,
                                            device=self.device, rotate=self.rotate, timing=timing)
        copies, note = self._copies
        calls = {}
        with self.costs.timer("inputs"):
            for rv in timed:
                mine = [c.fresh() for c in copies]  # its own state pools; the read-only inputs are shared
                fn = rv.variant.fn
                if timing.with_out:
                    calls[rv.id] = [with_out(spec, rv.variant.capabilities.takes_out, fn, c) for c in mine]
                else:
                    calls[rv.id] = [(lambda c=c, fn=fn: fn(*c.args, **c.kwargs)) for c in mine]
        if timing.with_out:
            note += ", out="
        eager_only = [rv.id for rv in timed if not rv.variant.capabilities.graph_safe]
        # A checking call is a fair first figure only where one-time costs cannot dominate it: a
        # call of at least FIRST_CALL_MIN_S, by a variant this process has run before (on any shape).
        fair = {v: t for v, t in self.first.items()
                if v in calls and t >= FIRST_CALL_MIN_S and (spec.name, v) in _RAN}
        _RAN.update((spec.name, v) for v in self.first if v in calls)
        spent: dict[str, float] = {}
        results = _timing.measure_interleaved(calls, self.device, timing, prune=prune, deadline=deadline,
                                              eager_only=eager_only, first=fair, spent=spent)
        base = {rv.id: self.base(rv) for rv in timed}
        figures = {}
        for vid, r in results.items():
            at = time.time()
            self.costs.add("timing" if isinstance(r, _timing.Timing) else "timing_pruned", spent.get(vid, 0.0), vid)
            if isinstance(r, Failed):
                self.emit(Measurement(status="rejected", reason=r.reason, measured_at=at, **base[vid]))
            elif isinstance(r, Pruned):
                bound = floor1(r.ratio)
                figures[vid] = r.first_us
                self.emit(Measurement(status="pruned", reason=f"pruned after the first round at >= {bound:.1f}x "
                                                              f"{r.leader}'s time per call",
                                      best_us=r.first_us, median_us=r.first_us, spread=0.0, windows=1, iters=r.iters,
                                      method=r.method + note, samples_us=(r.first_us,), pruned_at=bound,
                                      measured_at=at, **base[vid]))
            else:
                figures[vid] = r.best_us
                d = r.as_dict()
                d["method"] += note
                self.emit(Measurement(status="ok", measured_at=at, **d, **base[vid]))
        return figures


FIRST_CALL_MIN_S = 0.005
_RAN: set[tuple[str, str]] = set()  # (op, variant) verified in this process: its one-time set-up is done


def _timed(fn: Callable[..., Any], device: torch.device, sink: dict[str, float], name: str) -> Callable[..., Any]:
    """``fn``, noting in ``sink[name]`` how long its call took (the device synchronised around
    it): verification's call is a candidate's first figure, for pruning the far slower ones."""
    def call(*args: Any, **kwargs: Any) -> Any:
        _timing.sync(device)
        t = _timing._now()
        out = fn(*args, **kwargs)
        _timing.sync(device)
        sink[name] = _timing._now() - t
        return out

    return call


def _barred(qualifier: Qualifier, rv: RegisteredVariant, key: CallKey, *, may_run: bool = True) -> str | None:
    """Why ``rv`` may not be measured for ``key``'s class (None: it may): what
    ``_decide.admissions`` says of it, as for a call. With ``may_run`` what it asks for is done
    first, as ``Dispatcher.settle`` does: a variant without a verdict is qualified (and under
    ``KV_QUALIFY=strict`` one beyond every shape it was checked at is checked at ``key``'s).
    Without, only a verdict bars: one not qualified yet is not. ``rv`` is taken to run ``key``
    (the caller chose it among those that do, or asks of its class, not of this shape)."""
    facts = Facts(key, (rv,), qualifier.announced_policy(), {rv.id: qualifier.stored(rv, key)},
                  may_run=may_run, unfit={rv.id: None})
    while isinstance(asked := admissions(facts), Qualify):
        facts = qualifier.answer(facts, asked)
    why = asked.get(rv.id)
    return None if why == NOT_YET else why


def _without_failed(table: CalibrationTable, entries: Sequence[RegisteredVariant], spec: OpSpec,
                    result: CalibrationResult, features: Features, device: str, qualifier: Qualifier,
                    versions: dict[tuple[str, str], str], margin: float) -> None:
    """A variant whose check failed at a later shape of this run failed its whole class: the
    shapes it won earlier in the run are decided again without it."""
    dev = torch.device(device)
    key = CallKey(spec, dev.type, result.dtype, features, result.measurements[0].shape, index=dev.index)
    failed = {rv.id: why for rv in entries if (why := _barred(qualifier, rv, key, may_run=False)) is not None}
    if not any(w is not None and w.variant in failed for w in result.winners.values()):
        return
    allowed = {k: v for k, v in versions.items() if k[1] not in failed}
    fpid, group = result.measurements[0].fingerprint_id, result.measurements[0].group
    for shape in result.winners:
        result.winners[shape] = table.decide_winner(fpid, group, shape, allowed, margin)


def run_calibration(
    entries: Sequence[RegisteredVariant],
    table: CalibrationTable | None,
    spec: OpSpec,
    shapes: Sequence[Shape],
    *,
    dtype: str | torch.dtype,
    device: str,
    features: Features,
    timing: TimingConfig,
    variants: Sequence[str] | None,
    rotate: int,
    margin: float,
    progress: Callable[[Progress], None] | None,
    prune: float | None = None,
    budget_s: float | None = None,
    qualifier: Qualifier,
) -> CalibrationResult:
    """Measure ``shapes`` and re-decide each one's winner in ``table``.

    ``budget_s``: a shape is started only while it still fits, estimated from the time per
    element of the shapes done so far (those that do not are listed in ``skipped``), and the
    rounds of a shape stop at the budget (each variant keeps at least one window)."""
    dt = as_dtype(dtype)
    check_margin(margin)
    prune = check_prune(prune)
    check_mode(timing, device)
    if budget_s is not None and not (budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(f"budget: expected a positive number of seconds, got {budget_s}")
    if variants is not None:
        known = {rv.id for rv in entries}
        missing = [v for v in variants if v not in known]
        if missing:
            raise ValueError(f"variants: {', '.join(missing)} not registered for {spec.name} "
                             f"(registered: {', '.join(sorted(known))})")
    result = CalibrationResult(spec.name, device, dtype_name(dt))
    versions = {(rv.op, rv.id): rv.version for rv in entries}
    start = time.perf_counter()
    deadline = None if budget_s is None else time.monotonic() + budget_s
    wanted = [rv for rv in entries if variants is None or rv.id in variants]
    runnable = {}
    for shape in shapes:  # for the progress total: which variants will run each shape
        key = CallKey(spec, torch.device(device).type, dtype_name(dt), features, tuple(shape))
        runnable[tuple(shape)] = sum(1 for rv in wanted if rv.why_not(key) is None)
    total, done = sum(runnable.values()), 0
    spent, sizes = 0.0, 0  # seconds and elements of the shapes measured so far
    evidence = Evidence()  # what this run measured: a shape's neighbours' figures
    for shape in shapes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or (sizes and spent / sizes * math.prod(shape) > left):
                result.skipped.append(tuple(shape))
                continue
        t_shape = time.monotonic()

        def taken(m: Measurement) -> None:
            nonlocal done
            if table is not None:
                with result.breakdown.timer("table"):
                    table.record(m)  # at once: a run killed later keeps what it completed
            done += 1
            if progress is not None:
                progress(Progress(done, total, m.shape, m.variant, time.perf_counter() - start))

        ms = measure_shape(entries, spec, tuple(shape), dtype=dt, device=device, features=features,
                           timing=timing, rotate=rotate, only=variants, on_result=taken, prune=prune,
                           deadline=deadline, qualifier=qualifier, evidence=evidence, costs=result.breakdown)
        spent += time.monotonic() - t_shape
        sizes += math.prod(shape)
        done += runnable[tuple(shape)] - len(ms)  # keeps the count right if a case's key differs
        result.measurements += ms
        evidence.note(ms)
        if table is not None and ms:
            with result.breakdown.timer("table"):
                result.winners[tuple(shape)] = table.decide_winner(ms[0].fingerprint_id, ms[0].group, tuple(shape),
                                                                   versions, margin)
    if table is not None and result.measurements:
        with result.breakdown.timer("table"):
            _without_failed(table, entries, spec, result, features, device, qualifier, versions, margin)
            table.prepare(versions, result.measurements[0].fingerprint_id)
    result.elapsed_s = time.perf_counter() - start
    return result
