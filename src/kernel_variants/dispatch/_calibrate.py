"""Calibration: check every candidate against the reference on a shape, time the ones that
match, store per-variant figures and re-decide the shape's winner."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kernel_variants._dtypes import as_dtype, dtype_name
from kernel_variants.registry import CallKey, Features, OpSpec
from kernel_variants.registry._registry import RegisteredVariant
from kernel_variants.registry._spec import Shape

from ._fingerprint import fingerprint, fingerprint_id
from ._table import CalibrationTable, Group, Measurement, Winner, check_margin
from ._timing import TimingConfig, measure
from ._verify import reference_result, verify


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

    def rejected(self) -> list[Measurement]:
        return [m for m in self.measurements if m.status == "rejected"]


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
) -> list[Measurement]:
    """Verify, then time, each of ``entries`` that can run ``shape``; rejected ones say why.
    ``on_result`` sees each measurement as soon as it is taken."""
    case = spec.sweep_case(shape, features, dtype=dtype, device=device, seed=_seed(shape))
    key = spec.key_of_case(case)
    fp = fingerprint(device)
    fpid = fingerprint_id(fp)
    group = Group.of(key)
    expected = None
    out = []
    for rv, why in candidates(entries, key, only):
        if why is not None:
            continue  # cannot run here or does not claim this call: nothing to record
        if expected is None:
            expected = reference_result(case)
        base = dict(fingerprint=fp, fingerprint_id=fpid, group=group, shape=shape, variant=rv.id,
                    version=rv.version, measured_at=time.time())
        bad = verify(rv.variant.fn, case, expected)
        if bad is None:
            copies = [case.fresh()] + [spec.sweep_case(shape, features, dtype=dtype, device=device, seed=i + 1)
                                       for i in range(rotate)]
            fn = rv.variant.fn
            calls = [(lambda c=c, fn=fn: fn(*c.args, **c.kwargs)) for c in copies]
            try:
                t = measure(calls, device, timing)
            except Exception as exc:  # a variant that verified but crashes when timed is rejected too
                bad = f"raised while timed: {type(exc).__name__}: {exc}"
            else:
                if not all(map(_finite, (t.best_us, t.median_us))):
                    bad = "timing was not finite"
                else:
                    out.append(Measurement(status="ok", **t.as_dict(), **base))
        if bad is not None:
            out.append(Measurement(status="rejected", reason=bad, **base))
        if on_result is not None:
            on_result(out[-1])
    return out


def _seed(shape: Shape) -> int:
    seed = 0
    for size in shape:
        seed = (seed * 1009 + size) % (1 << 31)
    return seed


def _finite(v: float) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


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
) -> CalibrationResult:
    dt = as_dtype(dtype)
    check_margin(margin)
    if variants is not None:
        known = {rv.id for rv in entries}
        missing = [v for v in variants if v not in known]
        if missing:
            raise ValueError(f"variants: {', '.join(missing)} not registered for {spec.name} "
                             f"(registered: {', '.join(sorted(known))})")
    result = CalibrationResult(spec.name, device, dtype_name(dt))
    versions = {(rv.op, rv.id): rv.version for rv in entries}
    start = time.perf_counter()
    wanted = [rv for rv in entries if variants is None or rv.id in variants]
    runnable = {}
    for shape in shapes:  # for the progress total: which variants will run each shape
        key = CallKey(spec, torch.device(device).type, dtype_name(dt), features, tuple(shape))
        runnable[tuple(shape)] = sum(1 for rv in wanted if rv.why_not(key) is None)
    total, done = sum(runnable.values()), 0
    for shape in shapes:
        def taken(m: Measurement) -> None:
            nonlocal done
            if table is not None:
                table.record(m)  # at once: a run killed later keeps what it completed
            done += 1
            if progress is not None:
                progress(Progress(done, total, m.shape, m.variant, time.perf_counter() - start))

        ms = measure_shape(entries, spec, tuple(shape), dtype=dt, device=device, features=features,
                           timing=timing, rotate=rotate, only=variants, on_result=taken)
        done += runnable[tuple(shape)] - len(ms)  # keeps the count right if a case's key differs
        result.measurements += ms
        if table is not None and ms:
            result.winners[tuple(shape)] = table.decide_winner(ms[0].fingerprint_id, ms[0].group, tuple(shape),
                                                               versions, margin)
    if table is not None and result.measurements:
        table.prepare(versions, result.measurements[0].fingerprint_id)
    return result
