"""Calibration: check every candidate against the reference on a shape, time the ones that
match, store per-variant figures and re-decide the shape's winner."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernel_variants._dtypes import as_dtype, dtype_name
from kernel_variants._registry.case import Case
from kernel_variants._registry.keys import CallKey, Features
from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants._registry.spec import OpSpec, Shape
from kernel_variants._table.exchange import ImportReport
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import Group, Measurement, Winner, check_margin, check_prune
from kernel_variants._table.table import CalibrationTable
from kernel_variants._tuning import timing as _timing
from kernel_variants._tuning.qualify import Qualifier
from kernel_variants._tuning.timing import (
    Failed,
    Pruned,
    TimingConfig,
    check_mode,
    cold_copies,
    measure_interleaved,
)
from kernel_variants._tuning.verify import reference_result, verify


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

    def rejected(self) -> list[Measurement]:
        return [m for m in self.measurements if m.status == "rejected"]

    def pruned(self) -> list[Measurement]:
        return [m for m in self.measurements if m.status == "pruned"]


def candidates(entries: Iterable[RegisteredVariant], key: CallKey,
               wanted: Sequence[str] | None) -> list[tuple[RegisteredVariant, str | None]]:
    """Each entry with why it cannot be measured for ``key`` (None when it can); a variant
    compiled here is built first."""
    return [(rv, rv.variant.capabilities.uncovered(key) or rv.ensure_built())
            for rv in entries if wanted is None or rv.id in wanted]


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
) -> list[Measurement]:
    """Qualify each of ``entries`` that can run ``shape`` for its class and check it at ``shape``
    (rejected ones say why; a failed check fails the class, see ``Qualifier.check``), then time the
    ones that match, interleaved (see ``_timing.measure_interleaved``); ``prune`` and
    ``deadline`` are passed on. ``on_result`` sees each measurement as soon as it is taken."""
    check_mode(timing, device)
    case = spec.sweep_case(shape, features, dtype=dtype, device=device, seed=_seed(shape))
    key = spec.key_of_case(case)
    # The check at this shape holds the op's traps (pads, poisoned rows): a kernel wrong only
    # at large sizes, or only on pads, is caught where it would run. The timing case has none.
    check = spec.make_case(tuple(shape), dtype=dtype, device=device, seed=_seed(shape),
                           **{**features.model_dump(), **spec.check_options})
    fp = fingerprint(device)
    fpid = fingerprint_id(fp)
    group = Group.of(key)
    expected = None
    out: list[Measurement] = []
    base: dict[str, dict] = {}
    timed: list[RegisteredVariant] = []

    def emit(m: Measurement) -> None:
        out.append(m)
        if on_result is not None:
            on_result(m)

    first: dict[str, float] = {}  # seconds one call of each took while it was verified
    dev = torch.device(device)
    for rv, why in candidates(entries, key, only):
        if why is not None:
            continue  # cannot run here or does not claim this call: nothing to record
        base[rv.id] = dict(fingerprint=fp, fingerprint_id=fpid, group=group, shape=shape, variant=rv.id,
                           version=rv.version, deps=rv.deps)
        if rv.variant.fn is spec.reference.fn:  # the oracle itself: its result is the expected one
            if expected is None:
                expected = reference_result(check, _timed(spec.reference.fn, dev, first, "\0reference"))
            bad, first[rv.id] = None, first["\0reference"]
        else:
            bad = qualifier.barred(rv, key, may_run=True)  # its class's edge cases first
            if bad is None:
                if expected is None:
                    expected = reference_result(check, _timed(spec.reference.fn, dev, first, "\0reference"))
                bad = verify(_timed(rv.variant.fn, dev, first, rv.id), check, expected)
                if qualifier.policy != "off":  # off: rejected at this shape, no verdict kept
                    verdict = qualifier.check(rv, key, tuple(shape), bad)
                    bad = None if verdict.passed else verdict.summary()
        if bad is None:
            timed.append(rv)
        else:
            emit(Measurement(status="rejected", reason=bad, measured_at=time.time(), **base[rv.id]))
    if not timed:
        return out
    copies, note = _inputs(spec, case, shape, features, dtype=dtype, device=device, rotate=rotate, timing=timing)
    calls = {}
    for rv in timed:
        mine = [c.fresh() for c in copies]  # its own state pools; the read-only inputs are shared
        fn = rv.variant.fn
        if timing.with_out:
            calls[rv.id] = [_with_out(spec, rv.variant.capabilities.takes_out, fn, c) for c in mine]
        else:
            calls[rv.id] = [(lambda c=c, fn=fn: fn(*c.args, **c.kwargs)) for c in mine]
    if timing.with_out:
        note += ", out="
    eager_only = [rv.id for rv in timed if not rv.variant.capabilities.graph_safe]
    # A verification call is a fair first figure only where one-time costs cannot dominate it: a
    # call of at least FIRST_CALL_MIN_S, by a variant this process has run before (on any shape).
    fair = {v: t for v, t in first.items() if v in calls and t >= FIRST_CALL_MIN_S and (spec.name, v) in _RAN}
    _RAN.update((spec.name, v) for v in first if v in calls)
    results = measure_interleaved(calls, device, timing, prune=prune, deadline=deadline, eager_only=eager_only,
                                  first=fair)
    for vid, r in results.items():
        at = time.time()
        if isinstance(r, Failed):
            emit(Measurement(status="rejected", reason=r.reason, measured_at=at, **base[vid]))
        elif isinstance(r, Pruned):
            bound = math.floor(r.ratio * 10) / 10
            emit(Measurement(status="pruned", reason=f"pruned after the first round at >= {bound:.1f}x "
                                                     f"{r.leader}'s time per call",
                             best_us=r.first_us, median_us=r.first_us, spread=0.0, windows=1, iters=r.iters,
                             method=r.method + note, samples_us=(r.first_us,), pruned_at=bound, measured_at=at,
                             **base[vid]))
        else:
            d = r.as_dict()
            d["method"] += note
            emit(Measurement(status="ok", measured_at=at, **d, **base[vid]))
    return out


def _with_out(spec: OpSpec, takes_out: bool, fn: Callable[..., Any], case: Case) -> Callable[[], Any]:
    """One timed call of ``case`` into a preallocated dense ``out``, as the dispatcher runs it."""
    like = spec.bind(*case.args, **case.kwargs)[spec.out_like_index]
    outs = tuple(torch.empty_like(like, memory_format=torch.contiguous_format) for _ in spec.outputs)
    args, kwargs = case.args, case.kwargs
    if takes_out:
        out = outs[0] if len(outs) == 1 else outs
        return lambda: fn(*args, **kwargs, out=out)
    if len(outs) == 1:
        return lambda: outs[0].copy_(fn(*args, **kwargs))

    def copied() -> None:
        for o, r in zip(outs, fn(*args, **kwargs), strict=True):
            o.copy_(r)

    return copied


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


def _inputs(spec: OpSpec, case: Case, shape: Shape, features: Features, *, dtype: torch.dtype, device: str,
            rotate: int, timing: TimingConfig) -> tuple[list[Case], str]:
    """The input copies a variant's calls cycle over, and what the method says of them: the
    case, plus ``rotate`` more, or with ``cold_l2`` as many as make twice the device's L2."""
    n = rotate
    if timing.cold_l2:
        n = max(n, cold_copies(device, case_bytes(case)) - 1)
    copies = [case] + [spec.sweep_case(shape, features, dtype=dtype, device=device, seed=i + 1) for i in range(n)]
    if timing.cold_l2:
        return copies, f", cold L2 ({len(copies)} input sets)"
    return copies, f", {len(copies)} input sets" if n else ""


def case_bytes(case: Case) -> int:
    """Bytes of the tensors a call reads and writes."""
    tensors = [a for a in (*case.args, *case.kwargs.values()) if isinstance(a, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _seed(shape: Shape) -> int:
    seed = 0
    for size in shape:
        seed = (seed * 1009 + size) % (1 << 31)
    return seed


def _without_failed(table: CalibrationTable, entries: Sequence[RegisteredVariant], spec: OpSpec,
                    result: CalibrationResult, features: Features, device: str, qualifier: Qualifier,
                    versions: dict[tuple[str, str], str], margin: float) -> None:
    """A variant whose check failed at a later shape of this run failed its whole class: the
    shapes it won earlier in the run are decided again without it."""
    dev = torch.device(device)
    key = CallKey(spec, dev.type, result.dtype, features, result.measurements[0].shape, index=dev.index)
    failed = qualifier.failed(list(entries), key)
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
                table.record(m)  # at once: a run killed later keeps what it completed
            done += 1
            if progress is not None:
                progress(Progress(done, total, m.shape, m.variant, time.perf_counter() - start))

        ms = measure_shape(entries, spec, tuple(shape), dtype=dt, device=device, features=features,
                           timing=timing, rotate=rotate, only=variants, on_result=taken, prune=prune,
                           deadline=deadline, qualifier=qualifier)
        spent += time.monotonic() - t_shape
        sizes += math.prod(shape)
        done += runnable[tuple(shape)] - len(ms)  # keeps the count right if a case's key differs
        result.measurements += ms
        if table is not None and ms:
            result.winners[tuple(shape)] = table.decide_winner(ms[0].fingerprint_id, ms[0].group, tuple(shape),
                                                               versions, margin)
    if table is not None and result.measurements:
        _without_failed(table, entries, spec, result, features, device, qualifier, versions, margin)
        table.prepare(versions, result.measurements[0].fingerprint_id)
    result.elapsed_s = time.perf_counter() - start
    return result
