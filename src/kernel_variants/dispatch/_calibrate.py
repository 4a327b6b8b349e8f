"""Calibration: check every candidate against the reference on a shape, time the ones that
match, store per-variant figures and re-decide the shape's winner."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kernel_variants._cases import Case, make_case
from kernel_variants._checks import CallKey, dtype_name
from kernel_variants.ops import call_key
from kernel_variants.registry._models import OpName
from kernel_variants.registry._registry import RegisteredVariant

from ._fingerprint import fingerprint, fingerprint_id
from ._select import uncovered
from ._table import CalibrationTable, Group, Measurement, Shape, Winner, check_margin
from ._timing import TimingConfig, measure
from ._verify import reference_result, verify

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}") from None


@dataclass(frozen=True)
class Features:
    """The call features a calibration run measures (shared by every shape of the run)."""

    width: int = 4
    bias: bool = True
    activation: str | None = "silu"
    states: bool = True
    varlen: bool = False
    spec: bool = False


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

    op: OpName
    device: str
    dtype: str
    measurements: list[Measurement] = field(default_factory=list)
    winners: dict[Shape, Winner | None] = field(default_factory=dict)

    def rejected(self) -> list[Measurement]:
        return [m for m in self.measurements if m.status == "rejected"]


def _case(op: OpName, shape: Shape, dtype: torch.dtype, device: str, f: Features, seed: int) -> Case:
    b, d, seq = shape
    return make_case(op, b, d, seq, width=f.width, dtype=dtype, device=device, bias=f.bias,
                     activation=f.activation, states=f.states, varlen=f.varlen, spec=f.spec, seed=seed)


def candidates(entries: Iterable[RegisteredVariant], case: Case, wanted: Sequence[str] | None) -> list[tuple[RegisteredVariant, str | None]]:
    """Each entry with why it cannot be measured on ``case`` (None when it can); a variant
    compiled here is built first."""
    key = call_key(case.op, *case.args, **case.kwargs)
    out = []
    for rv in entries:
        if wanted is not None and rv.id not in wanted:
            continue
        out.append((rv, uncovered(rv.variant.capabilities, key) or rv.ensure_built()))
    return out


def measure_shape(
    entries: Sequence[RegisteredVariant],
    op: OpName,
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
    case = _case(op, shape, dtype, device, features, seed=_seed(shape))
    key = call_key(op, *case.args, **case.kwargs)
    fp = fingerprint(device)
    fpid = fingerprint_id(fp)
    group = Group.of(key)
    expected = None
    out = []
    for rv, why in candidates(entries, case, only):
        if why is not None:
            continue  # cannot run here or does not claim this call: nothing to record
        if expected is None:
            expected = reference_result(case)
        base = dict(fingerprint=fp, fingerprint_id=fpid, group=group, shape=shape, variant=rv.id,
                    version=rv.version, measured_at=time.time())
        bad = verify(rv.variant.fn, case, expected)
        if bad is None:
            copies = [case.fresh()] + [_case(op, shape, dtype, device, features, seed=i + 1) for i in range(rotate)]
            fn = rv.variant.fn
            calls = [(lambda c=c: fn(*c.args, **c.kwargs)) for c in copies]
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
    b, d, seq = shape
    return (b * 1_000_003 + d * 1009 + seq) % (1 << 31)


def _finite(v: float) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))


def run_calibration(
    entries: Sequence[RegisteredVariant],
    table: CalibrationTable | None,
    op: OpName,
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
            raise ValueError(f"variants: {', '.join(missing)} not registered for {op} (registered: {', '.join(sorted(known))})")
    result = CalibrationResult(op, device, dtype_name(dt))
    versions = {(rv.op, rv.id): rv.version for rv in entries}
    start = time.perf_counter()
    wanted = [rv for rv in entries if variants is None or rv.id in variants]
    runnable = {}
    for shape in shapes:  # for the progress total: which variants will run each shape
        key = CallKey(op, torch.device(device).type, dtype_name(dt), features.width, *shape, features.bias,
                      "none" if features.activation is None else "silu", features.states or op == "causal_conv1d_update",
                      features.varlen, features.spec, False)
        runnable[tuple(shape)] = sum(1 for rv in wanted if uncovered(rv.variant.capabilities, key) is None
                                     and rv.unavailable_reason() is None)
    total, done = sum(runnable.values()), 0
    for shape in shapes:
        def taken(m: Measurement) -> None:
            nonlocal done
            if table is not None:
                table.record(m)  # at once: a run killed later keeps what it completed
            done += 1
            if progress is not None:
                progress(Progress(done, total, m.shape, m.variant, time.perf_counter() - start))

        ms = measure_shape(entries, op, tuple(shape), dtype=dt, device=device, features=features,
                           timing=timing, rotate=rotate, only=variants, on_result=taken)
        done += runnable[tuple(shape)] - len(ms)  # keeps the count right if a case's key differs
        result.measurements += ms
        if table is not None and ms:
            result.winners[tuple(shape)] = table.decide_winner(ms[0].fingerprint_id, ms[0].group, tuple(shape),
                                                               versions, margin)
    return result
