"""Qualification: no variant is timed or chosen for a class of calls before it passed, on this
device, the op's named edge cases built for that class.

A class is (op, device fingerprint, dtype, features): what a calibration group is, on one device.
Its cases are the op's ``edge_cases`` at the class's features and dtype, at sizes the variant
takes (``Capabilities.fit``), plus each ``out=`` form the variant declares; the one ``verify``
judges each. The verdict (passed, or the first failing case and why) is stored in the table
beside the timings, keyed by the class and the variant, and is valid for the variant's full
version: a new version qualifies again.

A variant that runs compiled code (``Variant.isolate``, the default for anything not declared
pure) is qualified in a child process (``isolate``). Who may be chosen, given a verdict, is
``_policy.admit``'s to say; this module keeps the verdicts and runs what it asks for.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kernel_variants._policy import Policy, qualifies
from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants._registry.spec import Shape
from kernel_variants._table.rows import (
    VERDICT_PREFIX,
    Group,
    Verdict,
    parse_verdict,
    verdict_fingerprint,
    verdict_key,
)
from kernel_variants._tuning.cases import check_at, error, suite_of
from kernel_variants._tuning.isolate import run_qualification

if TYPE_CHECKING:
    from kernel_variants._decide import Facts, Qualify

SLOW_S = 1.0  # a qualification that takes longer is announced on stderr


def verdict_from(outcome: Mapping[str, Any], *, key: CallKey, rv: RegisteredVariant, fingerprint: dict[str, str],
                 fingerprint_id: str, where: str, seconds: float) -> Verdict:
    passed = not outcome.get("reason") and outcome.get("cases", 0) > 0
    return Verdict(fingerprint=fingerprint, fingerprint_id=fingerprint_id, group=Group.of(key), variant=rv.id,
                   version=rv.version, suite=suite_of(key.spec), passed=passed, cases=int(outcome.get("cases", 0)),
                   failed_case=str(outcome.get("failed_case", "")), reason=str(outcome.get("reason", "")),
                   where=where, seconds=round(seconds, 4),  # type: ignore[arg-type]
                   largest=tuple(outcome.get("largest") or ()), qualified_at=time.time())


class Qualifier:
    """The verdicts of one table: kept, read, and made by running what ``_policy.admit`` asks
    for (a qualification, a check at a shape). Who may be chosen given them is not said here:
    the dispatcher and calibration ask ``_decide`` with the verdicts as facts.

    ``on_failure`` runs when a variant's verdict becomes a failure (the dispatcher forgets its
    memoised decisions then: one may have chosen that variant)."""

    def __init__(self, table: Callable[[], Any], policy: Policy, on_failure: Callable[[], None] = lambda: None) -> None:
        self._table = table
        self.policy = policy
        self._on_failure = on_failure
        self._cache: dict[str, Verdict | None] = {}
        self._errors: dict[str, Verdict] = {}  # this process only: the machine failed, not the variant
        self._lock = threading.RLock()  # one qualification at a time: no class is run twice at once
        self._said_off = False

    def _where(self, key: CallKey) -> tuple[dict[str, str], str]:
        from kernel_variants._table.fingerprint import fingerprint, fingerprint_id

        fp = verdict_fingerprint(fingerprint(key.where))
        return fp, fingerprint_id(fp)

    def stored(self, rv: RegisteredVariant, key: CallKey) -> Verdict | None:
        """The current verdict of ``rv`` for ``key``'s class (None: none, or of another version of
        the variant or of the op's qualification suite)."""
        _, fpid = self._where(key)
        skey = verdict_key(fpid, Group.of(key), rv.id)
        v = self._errors.get(skey)
        if v is None:
            if skey not in self._cache:
                table = self._table()
                self._cache[skey] = parse_verdict(table._guard(table.store.get, skey))
            v = self._cache[skey]
        return v if v is not None and v.version == rv.version and v.suite == suite_of(key.spec) else None

    def _keep(self, v: Verdict, *, persist: bool = True, replace_failure: bool = False) -> Verdict:
        """Store ``v`` and return the verdict that stands. A stored failure of the same version
        and suite stands against a pass (read again as the pass is written: another process may
        have failed the class while this one ran), unless ``replace_failure``: the pass re-ran
        the case that failed (``qualify(redo=True)``)."""
        skey = v.storage_key()
        before = self._errors.get(skey) or self._cache.get(skey)
        if persist:
            table = self._table()

            def write() -> Verdict:
                with table.store.transaction():
                    now = parse_verdict(table.store.get(skey))
                    if v.passed and not replace_failure and now is not None and not now.passed \
                            and (now.version, now.suite) == (v.version, v.suite):
                        return now
                    table.store.set(skey, v.model_dump_json())
                    return v

            v = table._guard(write)
            self._cache[skey] = v
            self._errors.pop(skey, None)
        else:
            self._errors[skey] = v
        if not v.passed and (before is None or before.passed):
            self._on_failure()
        return v

    def qualify(self, rv: RegisteredVariant, key: CallKey, *, announce: bool = False, redo: bool = False) -> Verdict:
        """Run ``rv``'s cases for ``key``'s class now (building it first) and keep the verdict.
        ``announce`` (a call's first use): say on stderr what ran, when it took longer than a
        second, ran in a child process or failed (kv qualify and kv calibrate report their own).
        An outcome that says nothing about the variant (its build failed, the child was killed
        by the system, the check itself broke) bars it in this process only: not stored.

        A stored failure stands against the new outcome unless ``redo``; then a pass replaces
        it only once the failing case passed too (a check at a calibrated shape is run again),
        and the shapes the earlier verdict covered stay covered."""
        from kernel_variants._dtypes import as_dtype

        with self._lock:
            fp, fpid = self._where(key)
            earlier = self.stored(rv, key) if redo else None
            t0 = time.perf_counter()
            why = rv.ensure_built()
            if why is not None:
                outcome, where = error(f"cannot run here: {why}"), "process"
            else:
                outcome, where = run_qualification(key.spec, rv, key.features, dtype=as_dtype(key.dtype),
                                                   device=key.where)
            v = verdict_from(outcome, key=key, rv=rv, fingerprint=fp, fingerprint_id=fpid, where=where,
                             seconds=time.perf_counter() - t0)
            if v.passed and earlier is not None:
                v = self._again(rv, key, earlier, v)
            seconds = time.perf_counter() - t0
            v = self._keep(v.model_copy(update={"seconds": round(seconds, 4)}), persist=not outcome.get("error"),
                           replace_failure=redo)
        if announce and (seconds > SLOW_S or where == "child" or not v.passed):
            print(f"kernel_variants: {rv.id} for {_describe(key)}: {v.summary()} "
                  f"({'in a child process, ' if where == 'child' else ''}{seconds:.1f} s)", file=sys.stderr)
        return v

    def _again(self, rv: RegisteredVariant, key: CallKey, earlier: Verdict, now: Verdict) -> Verdict:
        """``now`` (a pass of the edge cases) with what ``earlier`` covered: the failed check at a
        calibrated shape run again, the largest shapes it passed at kept."""
        from kernel_variants._dtypes import as_dtype

        if not earlier.passed and earlier.where == "shadow":
            from kernel_variants._tuning.verify import replay

            why = replay(earlier.evidence, rv, key.spec) if earlier.evidence else "its saved inputs are gone"
            if why is not None:
                return earlier.model_copy(update={"reason": f"{why} (the live call's inputs, replayed: "
                                                            f"{earlier.evidence})", "qualified_at": time.time()})
            return now.model_copy(update={"largest": _widest(now.largest, earlier.largest)})
        if not earlier.passed and earlier.failed_shape:
            at = earlier.failed_shape
            try:
                why = check_at(key.spec, rv, at, key.features, dtype=as_dtype(key.dtype), device=key.where)
            except Exception as exc:  # as in check(): no verdict on the kernel, the failure stands
                why = f"qualification itself failed at {at}: {type(exc).__name__}: {exc}"
            if why is not None:
                return earlier.model_copy(update={"reason": why, "qualified_at": time.time()})
            return now.model_copy(update={"cases": now.cases + 1, "largest": _widest(now.largest, at)})
        return now.model_copy(update={"largest": _widest(now.largest, earlier.largest)})

    def announced_policy(self) -> Policy:
        """The policy, said once on stderr when it is ``off``."""
        if not qualifies(self.policy) and not self._said_off:
            self._said_off = True
            print("kernel_variants: KV_QUALIFY=off: variants are chosen without being checked on this "
                  "device", file=sys.stderr)
        return self.policy

    def answer(self, facts: Facts, asked: Qualify, *, announce: bool = False) -> Facts:
        """``facts`` once ``asked`` is done: the variant qualified for the call's class (or checked
        at its shape), its verdict among the facts and that step marked done (``_decide``)."""
        rv = next(rv for rv in facts.entries if rv.id == asked.variant)
        key = facts.key
        if asked.at_shape:
            return dataclasses.replace(facts, verdicts={**facts.verdicts, rv.id: self.check(rv, key, key.shape)},
                                       checked=facts.checked | {rv.id})
        return dataclasses.replace(facts, verdicts={**facts.verdicts, rv.id: self.qualify(rv, key, announce=announce)},
                                   asked=facts.asked | {rv.id})

    def check(self, rv: RegisteredVariant, key: CallKey, shape: Shape, why: str | None = None, *,
              ran: bool = False) -> Verdict:
        """Note a check of ``rv`` at ``shape`` (``why``: its outcome, None for a pass, when ``ran``;
        else it runs now): a pass widens what the verdict covers, a failure fails the class (a
        kernel wrong at one size is not trusted at another)."""
        from kernel_variants._dtypes import as_dtype

        v = self.stored(rv, key)
        if v is None:
            v = self.qualify(rv, key)
        if not v.passed:
            return v
        if why is None and not ran:
            try:
                why = check_at(key.spec, rv, shape, key.features, dtype=as_dtype(key.dtype), device=key.where)
            except Exception as exc:  # the check could not be built (out of memory, say): no verdict on it
                return self._keep(v.model_copy(update={"passed": False, "reason": f"qualification itself failed "
                                                       f"at {shape}: {type(exc).__name__}: {exc}"}), persist=False)
        at = ", ".join(f"{a}={s}" for a, s in zip(key.spec.axes, shape, strict=True))
        if why is not None:
            return self._keep(v.model_copy(update={"passed": False, "failed_case": f"check at {at}",
                                                   "failed_shape": tuple(shape), "reason": why,
                                                   "qualified_at": time.time()}))
        largest = _widest(v.largest, shape)
        return v if largest == v.largest else self._keep(v.model_copy(update={"largest": largest}))

    def shadow_failed(self, rv: RegisteredVariant, key: CallKey, why: str, evidence: str) -> Verdict:
        """Fail ``rv``'s class: a shadowed live call at ``key`` disagreed with its oracle (``why``;
        ``evidence``: the file holding that call's inputs). Only a replay of that file that
        passes, under ``qualify(redo=True)``, lifts it."""
        with self._lock:
            v = self.stored(rv, key)
            if v is None:  # chosen unchecked (KV_QUALIFY=off, or forced)
                fp, fpid = self._where(key)
                v = verdict_from({}, key=key, rv=rv, fingerprint=fp, fingerprint_id=fpid, where="process", seconds=0.0)
            at = ", ".join(f"{a}={s}" for a, s in zip(key.spec.axes, key.shape, strict=True))
            return self._keep(v.model_copy(update={"passed": False, "failed_case": f"shadowed call at {at}",
                                                   "failed_shape": (), "reason": why, "where": "shadow",
                                                   "evidence": evidence, "qualified_at": time.time()}))

    def clear(self, op: str | None = None, variant: str | None = None) -> int:
        """Forget the verdicts (of ``op``, of ``variant``); returns how many went."""
        table = self._table()
        n = 0
        with table.store.transaction():
            for skey, _ in list(table.store.items()):
                parts = skey.split("|")
                if parts[0] + "|" != VERDICT_PREFIX or len(parts) < 4:
                    continue
                if (op is None or parts[2] == op) and (variant is None or parts[-1] == variant):
                    table.store.delete(skey)
                    n += 1
        self._errors.clear()
        self.forget()
        return n

    def forget(self) -> None:
        """Drop the stored verdicts read so far (another process may have written since); the
        errors of this process stay (its machine has not changed)."""
        self._cache.clear()


def _widest(a: Shape, b: Shape) -> Shape:
    """Per axis the larger of two shapes (either may be empty: none yet)."""
    if not a or not b:
        return tuple(a or b)
    return tuple(max(x, y) for x, y in zip(a, b, strict=True))


def _describe(key: CallKey) -> str:
    flags = " ".join(f"{k}={v}" for k, v in key.features.model_dump().items())
    return f"{key.op} on {key.where} {key.dtype} {flags}".rstrip()
