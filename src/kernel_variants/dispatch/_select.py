"""Choosing a variant for a call: a pure function of candidates, call key and measurements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kernel_variants.registry import CallKey
from kernel_variants.registry._registry import RegisteredVariant


@dataclass(frozen=True)
class TraceRow:
    """One candidate's fate in a decision."""

    variant: str
    accepted: bool
    reason: str
    time_us: float | None = None

    def __str__(self) -> str:
        mark = "+" if self.accepted else "-"
        t = f" {self.time_us:.2f} us" if self.time_us is not None else ""
        return f"  {mark} {self.variant}{t}: {self.reason}"


@dataclass(frozen=True)
class Decision:
    """Which variant runs a call, and why. ``chosen`` is None when nothing can run it."""

    key: CallKey
    chosen: RegisteredVariant | None
    source: str  # "forced", "table", "nearest", "priority" or "none"
    trace: tuple[TraceRow, ...]
    note: str = ""
    measured_key: tuple[int, ...] | None = field(default=None)

    def __str__(self) -> str:
        head = self.key.describe()
        pick = self.chosen.id if self.chosen is not None else "nothing"
        notes = [self.note] if self.note else []
        if self.chosen is not None and self.chosen.needs_build():
            notes.append("not built yet: the first call compiles it, or run `kv build`")
        if self.measured_key is not None:
            at = ", ".join(f"{a}={v}" for a, v in zip(self.key.spec.axes, self.measured_key, strict=True))
            notes.append(f"timings measured at {at}")
        lines = [head, f"-> {pick} (by {self.source}{'; ' + '; '.join(notes) if notes else ''})"]
        lines += [str(r) for r in self.trace]
        return "\n".join(lines)


class NoVariantError(RuntimeError):
    """No registered variant can run a call (or the forced one cannot); the message has the trace."""


def select(
    entries: Sequence[RegisteredVariant],
    key: CallKey,
    *,
    forced: str | None = None,
    timings: Mapping[str, float] | None = None,
    timings_source: str = "table",
    measured_key: tuple[int, ...] | None = None,
    winner: str | None = None,
    rejected: set[str] | frozenset[str] = frozenset(),
    barred: Mapping[str, str] | None = None,
) -> Decision:
    """Pick the variant for ``key`` among ``entries``.

    ``timings`` maps variant id to measured microseconds for this call's key (or the nearest
    calibrated one); ``winner`` is the table's recorded winner there, which keeps its place
    unless it cannot run this call; ``rejected`` failed verification there and are never
    chosen over a measured variant. Without timings, the highest priority wins. ``barred``
    maps variants that may not be chosen (not qualified on this device) to why.
    """
    rows: list[TraceRow] = []
    ok: list[RegisteredVariant] = []
    for rv in entries:
        if forced is not None and rv.id != forced:
            rows.append(TraceRow(rv.id, False, f"not the forced variant {forced!r}"))
            continue
        why = rv.why_not(key)
        if why is None and forced is None and barred:
            why = barred.get(rv.id)
        if why is not None:
            rows.append(TraceRow(rv.id, False, why))
            continue
        ok.append(rv)
    if forced is not None:
        if not any(rv.id == forced for rv in entries):
            rows.append(TraceRow(forced, False, "not registered for this op"))
        if not ok:
            return Decision(key, None, "none", tuple(rows), note=f"forced variant {forced!r} cannot run this call")
        rows.append(TraceRow(forced, True, "forced"))
        return Decision(key, ok[0], "forced", tuple(rows))
    if not ok:
        return Decision(key, None, "none", tuple(rows))
    timed = {rv.id: timings[rv.id] for rv in ok if timings and rv.id in timings}
    if timed:
        if winner in timed:
            best = winner
            note = "recorded winner"
        else:
            best = min(timed, key=timed.__getitem__)
            note = "fastest measured"
        measured = next(rv for rv in ok if rv.id == best)
        # An incomplete row (a partial calibration, one killed mid-shape, a variant added later)
        # must not make things worse than no row: a runnable variant without a figure here that
        # the priorities rank above the measured winner is not beaten by that winner's figure.
        unmeasured = [rv for rv in ok if rv.id not in timed and rv.id not in rejected
                      and rv.variant.priority > measured.variant.priority]
        chosen = max(unmeasured, key=lambda rv: rv.variant.priority) if unmeasured else measured
        for rv in ok:
            t = timed.get(rv.id)
            if rv is chosen and chosen is not measured:
                rows.append(TraceRow(rv.id, True, f"not measured here, priority {rv.variant.priority} above the "
                                                  f"measured winner {best}'s {measured.variant.priority}", None))
            elif rv.id == best:
                rows.append(TraceRow(rv.id, chosen is measured, note if chosen is measured else
                                     f"{note}, but ranked below an unmeasured variant", t))
            elif rv.id in rejected:
                rows.append(TraceRow(rv.id, False, "rejected by calibration here (differs from the reference)", None))
            elif t is None:
                rows.append(TraceRow(rv.id, False, "not measured for this key", None))
            else:
                rows.append(TraceRow(rv.id, False, f"{t / timed[best]:.2f}x the winner", t))
        if chosen is not measured:
            missing = ", ".join(rv.id for rv in unmeasured)
            return Decision(key, chosen, "priority", tuple(rows), measured_key=measured_key,
                            note=f"incomplete row: {missing} not measured (kv calibrate --missing completes it)")
        return Decision(key, chosen, timings_source, tuple(rows), measured_key=measured_key)
    ranked = sorted(ok, key=lambda rv: -rv.variant.priority)
    for i, rv in enumerate(ranked):
        rows.append(TraceRow(rv.id, i == 0, f"priority {rv.variant.priority}" + ("" if i == 0 else " (lower)")))
    return Decision(key, ranked[0], "priority", tuple(rows), note="no measurements for this key")
