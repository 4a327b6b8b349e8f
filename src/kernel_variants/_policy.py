"""Who may run a call and who wins it: pure functions of the candidates, the call key, what
the table holds and the verdicts. Nothing here reads a table, times, or qualifies: the
dispatcher and calibration gather the facts and ask.

- :func:`admit`: whether a variant may be chosen for a class on this device (the eligibility
  rule: qualified, or the reference, or ``KV_QUALIFY=off``);
- :func:`choose`: the decision for a key from the table's figures (``Found``), the variants
  barred, and rank 0's choice under distributed tuning;
- :func:`select`: the decision from timings or priorities alone;
- :func:`winner_of`: which variant a calibrated shape goes to (keep-the-incumbent).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants._registry.spec import OpSpec, Shape

if TYPE_CHECKING:
    from kernel_variants._table.rows import Verdict

Policy = Literal["require", "strict", "off"]
POLICIES: tuple[str, ...] = ("require", "strict", "off")
NOT_YET = "not qualified on this device yet (its first call qualifies it; `kv qualify` does it ahead)"


def policy_from(raw: str) -> Policy:
    """``KV_QUALIFY``: ``require`` (the default), ``strict`` or ``off``."""
    value = raw.strip().lower() or "require"
    if value not in POLICIES:
        raise ValueError(f"KV_QUALIFY: expected one of {', '.join(POLICIES)}, got {raw!r}")
    return value  # type: ignore[return-value]


def qualifies(policy: Policy) -> bool:
    """Whether ``policy`` qualifies variants and keeps what their checks find as verdicts: every
    policy but ``off`` (under which a check that fails rejects a variant where it ran, and no
    more)."""
    return policy != "off"


class Admission(NamedTuple):
    """:func:`admit`'s answer: ``barred`` (why not, or None: it may be chosen) unless the
    caller must first ``qualify`` it (no verdict yet) or ``check`` it at the call's shape."""

    barred: str | None
    qualify: bool = False
    check: bool = False


ADMITTED = Admission(None)


def is_reference(rv: RegisteredVariant, spec: OpSpec) -> bool:
    """Whether ``rv`` runs the op's reference (the oracle: never qualified, always admitted)."""
    return rv.variant.fn is spec.reference.fn


def admit(verdict: Verdict | None, *, policy: Policy, reference: bool, may_run: bool,
          shape: Shape = (), axes: tuple[str, ...] = ()) -> Admission:
    """The eligibility rule, for every route to a choice: a variant may be chosen for a class of
    calls on this device only when it passed that class's cases here. The reference always
    may, and ``KV_QUALIFY=off`` admits anything that can run, except what a shadowed live call
    found wrong (a wrong answer seen on real traffic is not a check the user chose to skip).
    Without a verdict it is qualified first when ``may_run`` (not while a graph is captured or
    traced, nor for a preview), else passed over. ``strict``: a passing variant is checked
    first at a shape beyond every one it was checked at."""
    if reference:
        return ADMITTED
    if verdict is not None and not verdict.passed and (qualifies(policy) or verdict.where == "shadow"):
        return Admission(verdict.summary())
    if not qualifies(policy):
        return ADMITTED
    if verdict is None:
        return Admission(None, qualify=True) if may_run else Admission(NOT_YET)
    if policy == "strict" and may_run and beyond(verdict, shape, axes):
        return Admission(None, check=True)
    return ADMITTED


def beyond(verdict: Verdict, shape: Shape, axes: tuple[str, ...]) -> str | None:
    """Which axes of ``shape`` exceed every size ``verdict`` checked its variant at, as text."""
    if not verdict.largest or len(verdict.largest) != len(shape):
        return None
    over = [f"{a}={v} > {m}" for a, v, m in zip(axes, shape, verdict.largest, strict=True) if v > m]
    return ", ".join(over) or None


class Found(NamedTuple):
    """What the table has for a call at one shape: each candidate's µs (pruned ones with their
    first-round figure), the recorded winner, "table" (the call's shape) or "nearest", the
    shape the figures are from, the candidates rejected there, and those pruned there with
    their bound."""

    timings: dict[str, float]
    winner: str | None
    source: str
    at: Shape
    rejected: set[str]
    pruned: dict[str, float]


class Figures(NamedTuple):
    """What the table has for a call among some candidates: the figures at its own shape, and
    at the nearest calibrated shape of its group where one of them was measured (either None)."""

    here: Found | None
    nearest: Found | None


def combined_noise(*noises: float | None) -> float:
    """The noise of a comparison of figures with these relative noises (independent: in quadrature)."""
    return math.sqrt(sum((n or 0.0) ** 2 for n in noises))


class Ranking(NamedTuple):
    """:func:`winner_of`'s answer for one shape."""

    winner: str
    runner_up: str | None
    lead: float | None  # the runner-up's time over the winner's, minus one
    noise: float | None  # the two figures' combined noise
    confidence: str  # "clear", "within noise" or "single"


def winner_of(timed: Mapping[str, tuple[float, float | None]], incumbent: str | None, margin: float) -> Ranking:
    """Which variant a calibrated shape goes to, from each variant's (best µs, noise) there.

    The fastest figure wins a shape that has no winner yet. A recorded winner (``incumbent``)
    keeps it unless a challenger leads it by more than ``margin`` and by more than the two
    figures' combined noise: choices that flip back and forth on noise help nobody."""
    t = {v: best for v, (best, _) in timed.items()}
    best = min(t, key=t.__getitem__)
    if incumbent in t and incumbent != best:
        lead = t[incumbent] / t[best] - 1
        if lead <= max(margin, combined_noise(timed[incumbent][1], timed[best][1])):
            best = incumbent
    others = sorted((v for v in t if v != best), key=t.__getitem__)
    if not others:
        return Ranking(best, None, None, None, "single")
    runner = others[0]
    lead = t[runner] / t[best] - 1
    noise = combined_noise(timed[runner][1], timed[best][1])
    return Ranking(best, runner, lead, noise, "clear" if lead > max(margin, noise) else "within noise")


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
    # Made while a graph was captured, passing over a variant not yet qualified: the next call
    # decides again (and qualifies it, once eager), so it is never memoised.
    provisional: bool = False

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
    unfit: Mapping[str, str | None] | None = None,
) -> Decision:
    """Pick the variant for ``key`` among ``entries``.

    ``timings`` maps variant id to measured microseconds for this call's key (or the nearest
    calibrated one); ``winner`` is the table's recorded winner there, which keeps its place
    unless it cannot run this call; ``rejected`` failed verification there and are never
    chosen over a measured variant. Without timings, the highest priority wins. ``barred``
    maps variants that may not be chosen (not qualified on this device, excluded) to why; a
    forced variant is never barred for want of qualification, so the caller bars it only for
    what stops it running (an exclusion, a failed build). ``unfit``: each entry's
    ``why_not(key)``, where the caller has it already.
    """
    rows: list[TraceRow] = []
    ok: list[RegisteredVariant] = []
    for rv in entries:
        if forced is not None and rv.id != forced:
            rows.append(TraceRow(rv.id, False, f"not the forced variant {forced!r}"))
            continue
        why = unfit[rv.id] if unfit is not None else rv.why_not(key)
        if why is None and barred:
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
        # A variant with a figure for any of its tactics (or its default) counts as measured: its
        # other tactics are alternatives already weighed, not a newcomer the row lacks.
        families = {vid.partition(":")[0] for vid in timed}
        unmeasured = [rv for rv in ok if rv.id not in timed and rv.id not in rejected
                      and rv.id.partition(":")[0] not in families and rv.variant.priority > measured.variant.priority]
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


def choose(entries: Sequence[RegisteredVariant], key: CallKey, figures: Figures | None,
           barred: Mapping[str, str], agreed: str | None = None,
           unfit: Mapping[str, str | None] | None = None) -> Decision:
    """The decision for ``key`` among ``entries`` from the table's figures (None: priorities
    decide), with ``barred`` variants passed over. The figures at the call's own shape decide
    when there are any; else the nearest calibrated shape's. ``agreed``: the variant rank 0
    chose for this key under distributed tuning; every rank runs it when it may run here.
    ``unfit``: as :func:`select` takes it."""
    found = None if figures is None else figures.here or figures.nearest
    if found is None:
        decision = select(entries, key, barred=barred, unfit=unfit)
    else:
        decision = select(entries, key, timings=found.timings, winner=found.winner, timings_source=found.source,
                          measured_key=found.at, rejected=found.rejected, barred=barred, unfit=unfit)
        if found.pruned:
            # A pruned variant is measured-slower, not unmeasured: say how much slower, at least.
            rows = tuple(TraceRow(r.variant, r.accepted, f"pruned: >= {found.pruned[r.variant]:.1f}x the best "
                                  f"there (after its first round, or by its neighbours: kv table says which)", r.time_us)
                         if r.variant in found.pruned and not r.accepted else r for r in decision.trace)
            decision = dataclasses.replace(decision, trace=rows)
    if agreed is None or agreed in barred or not any(
            rv.id == agreed and (unfit[rv.id] if unfit is not None else rv.why_not(key)) is None for rv in entries):
        return decision
    if decision.chosen is None or decision.chosen.id != agreed:
        mine = decision.chosen.id if decision.chosen is not None else "nothing"
        decision = dataclasses.replace(select(entries, key, forced=agreed), source="rank 0",
                                       note=f"rank 0's choice for this key (this rank's table: {mine})")
    return decision


def with_note(decision: Decision, note: str) -> Decision:
    return dataclasses.replace(decision, note=f"{decision.note}; {note}" if decision.note else note)
