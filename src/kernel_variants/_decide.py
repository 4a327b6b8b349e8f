"""The decision procedure, as one pure function of the facts of a call.

:func:`decide` answers with the :class:`~kernel_variants._policy.Decision`, or with what must be
learnt or done first: the table's figures among some candidates (:class:`Look`), a verdict
(:class:`Qualify`), a measurement of the key (:class:`Tune`), a build (:class:`Build`). The
dispatcher carries that out, adds what it learnt to the facts and asks again; every rule (who
may be chosen, which figures count, when to tune, what a forced variant's note says, what
rank 0's choice overrides) is here or in ``_policy``, none in the dispatcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kernel_variants._policy import (
    NOT_YET,
    Decision,
    Figures,
    Policy,
    admit,
    beyond,
    choose,
    is_reference,
    select,
    with_note,
)
from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.registry import RegisteredVariant

if TYPE_CHECKING:
    from kernel_variants._table.rows import Verdict

UNQUALIFIED_FORCED = "forced, unqualified: not checked on this device for this class"


@dataclass(frozen=True)
class Look:
    """Read the table's figures for the call among these candidates."""

    among: frozenset[str]


@dataclass(frozen=True)
class Qualify:
    """Qualify ``variant`` for the call's class (``at_shape``: it passed, but check it at the
    call's shape, beyond every one it was checked at: ``KV_QUALIFY=strict``)."""

    variant: str
    at_shape: bool = False


@dataclass(frozen=True)
class Tune:
    """Measure the call's key now (``KV_TUNE``)."""


@dataclass(frozen=True)
class Build:
    """Build ``variant`` before the call runs it."""

    variant: str


Request = Look | Qualify | Tune | Build


@dataclass(frozen=True)
class Facts:
    """What the dispatcher knows of a call when it asks :func:`decide`."""

    key: CallKey
    entries: tuple[RegisteredVariant, ...]
    policy: Policy
    verdicts: Mapping[str, Verdict | None]  # each candidate's stored verdict for the key's class
    forced: str | None = None  # the pin (force(), KV_FORCE)
    may_run: bool = True  # qualify now: not while a graph is captured or traced, nor for a preview
    preview: bool = False  # explain(): say what the call would qualify rather than pass it over
    build: bool = False  # the call runs the choice, so it is built first
    tune: bool = False  # KV_TUNE, outside a capture
    tuned: bool = False
    agreed: str | None = None  # rank 0's choice for the key under distributed tuning
    excluded: Mapping[str, str] = field(default_factory=dict)  # not this rank's to choose (rank 0 decides), with why
    asked: frozenset[str] = frozenset()  # qualified for this call already
    checked: frozenset[str] = frozenset()  # checked at the call's shape for this call already
    built: Mapping[str, str | None] = field(default_factory=dict)  # build outcomes: why it failed, or None
    figures: Mapping[frozenset[str], Figures | None] = field(default_factory=dict)  # each Look's answer
    # Each entry's why_not(key) (what it cannot run: capabilities, availability), asked once.
    unfit: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.unfit) != len(self.entries):
            object.__setattr__(self, "unfit", {rv.id: rv.why_not(self.key) for rv in self.entries})

    def runnable(self) -> list[RegisteredVariant]:
        return [rv for rv in self.entries if self.unfit[rv.id] is None]

    def admission(self, rv: RegisteredVariant, *, may_run: bool):
        verdict = self.verdicts.get(rv.id)
        # Each step once per call: a qualification is followed by strict's check at the call's
        # shape where that applies, but neither is asked for again.
        again = rv.id not in self.checked and not (verdict is None and rv.id in self.asked)
        return admit(verdict, policy=self.policy, reference=is_reference(rv, self.key.spec),
                     may_run=may_run and again, shape=self.key.shape, axes=self.key.spec.axes)

    def unusable(self) -> dict[str, str]:
        """Candidates out for reasons beyond qualification: excluded, or their build failed."""
        return {**self.excluded, **{v: why for v, why in self.built.items() if why is not None}}


def decide(f: Facts) -> Decision | Request:
    """The decision for the call ``f`` describes, or what the dispatcher must do first.

    A forced variant runs as forced (its note says when it is not qualified). Otherwise: the
    candidates that can run the call, less those excluded, whose build failed or whose verdict
    bars them, are looked up in the table; an unmeasured key is measured first when tuning is
    wanted (and the ranks have not agreed on it); :func:`~kernel_variants._policy.choose`
    decides; the chosen variant is qualified (or checked at this shape) first when it may be,
    else passed over (the decision is then provisional: made under capture), and built when
    the call will run it."""
    if f.forced is not None:
        return _forced(f)
    runnable = f.runnable()
    if not runnable:
        return select(f.entries, f.key, unfit=f.unfit)
    barred = f.unusable()
    for rv in runnable:  # failures bar before anything is looked up, so the trace says why
        why = f.admission(rv, may_run=False).barred
        if rv.id not in barred and why is not None and why != NOT_YET:
            barred[rv.id] = why
    provisional = False
    while True:
        allowed = frozenset(rv.id for rv in runnable if rv.id not in barred)
        figures = None
        if allowed:
            if allowed not in f.figures:
                return Look(allowed)
            figures = f.figures[allowed]
        if wants_tuning(f, figures):
            return Tune()
        decision = choose(f.entries, f.key, figures, barred, f.agreed, unfit=f.unfit)
        chosen = decision.chosen
        if chosen is None:
            return dataclasses.replace(decision, provisional=provisional)
        answer = f.admission(chosen, may_run=f.may_run)
        if answer.qualify or answer.check:
            return Qualify(chosen.id, at_shape=answer.check)
        if answer.barred is None:
            if f.build and chosen.id not in f.built:
                return Build(chosen.id)
            return dataclasses.replace(noted(decision, f.verdicts.get(chosen.id)), provisional=provisional)
        if answer.barred == NOT_YET and f.preview:  # the call would qualify it, then run it
            return with_note(decision, NOT_YET)
        # passed over under capture: this decision must not outlive it
        provisional = provisional or answer.barred == NOT_YET
        barred[chosen.id] = answer.barred


def wants_tuning(f: Facts, figures: Figures | None) -> bool:
    """Tuning measures a key without figures at its own shape, once; never one the ranks agreed
    on (rank 0 measured it, or chose not to)."""
    return f.tune and not f.tuned and f.agreed is None and (figures is None or figures.here is None)


def admissions(f: Facts) -> dict[str, str] | Qualify:
    """Why each candidate that can run the call may not be chosen here, after qualifying those
    without a verdict (what each rank tells rank 0 under distributed tuning)."""
    out = f.unusable()
    for rv in f.runnable():
        if rv.id in out:
            continue
        answer = f.admission(rv, may_run=f.may_run)
        if answer.qualify or answer.check:
            return Qualify(rv.id, at_shape=answer.check)
        if answer.barred is not None:
            out[rv.id] = answer.barred
    return out


def _forced(f: Facts) -> Decision | Request:
    decision = select(f.entries, f.key, forced=f.forced, barred=f.unusable(), unfit=f.unfit)
    chosen = decision.chosen
    if chosen is None:
        return decision
    if f.build and chosen.id not in f.built:
        return Build(chosen.id)
    why = f.admission(chosen, may_run=False).barred
    if why is None:
        return decision
    return with_note(decision, UNQUALIFIED_FORCED if why == NOT_YET else f"forced, although it {why}")


def noted(decision: Decision, verdict: Verdict | None) -> Decision:
    """``decision``, saying so where its variant runs a shape beyond every one it was checked at."""
    chosen, key = decision.chosen, decision.key
    if chosen is None or verdict is None or is_reference(chosen, key.spec):
        return decision
    over = beyond(verdict, key.shape, key.spec.axes)
    if over is None:
        return decision
    return with_note(decision, f"checked at smaller sizes only ({over}; KV_QUALIFY=strict checks it "
                               "at this shape first)")
