"""Qualification: no variant is timed or chosen for a class of calls before it passed, on this
device, the op's named edge cases built for that class.

A class is (op, device fingerprint, dtype, features): what a calibration group is, on one device.
Its cases are the op's ``edge_cases`` at the class's features and dtype, at sizes the variant
takes (``Capabilities.fit``), plus each ``out=`` form the variant declares; ``_verify.verify``
judges each. The verdict (passed, or the first failing case and why) is stored in the table
beside the timings, keyed by the class and the variant, and is valid for the variant's full
version: a new version qualifies again.

A variant that runs compiled code (``Variant.isolate``, the default for anything not declared
pure) is qualified in a child process, so that a kernel that segfaults, dies of SIGILL, aborts
on a corrupted heap or hangs is a failed verdict and the caller lives on. On the CPU the child
is forked (it has this process's plugins, and costs milliseconds); on an accelerator, whose
runtime does not survive fork, it is a fresh interpreter that loads the installed plugins.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kernel_variants.registry import CallKey, Case, Features, OpSpec
from kernel_variants.registry._registry import RegisteredVariant
from kernel_variants.registry._spec import Shape

from ._table import VERDICT_PREFIX, Group

Policy = Literal["require", "strict", "off"]
POLICIES: tuple[str, ...] = ("require", "strict", "off")
CHILD_TIMEOUT_S = 300.0  # a class's cases take well under a second; minutes mean a hung kernel
SLOW_S = 1.0  # a qualification that takes longer is announced on stderr


def policy_from(raw: str) -> Policy:
    """``KV_QUALIFY``: ``require`` (the default), ``strict`` or ``off``."""
    value = raw.strip().lower() or "require"
    if value not in POLICIES:
        raise ValueError(f"KV_QUALIFY: expected one of {', '.join(POLICIES)}, got {raw!r}")
    return value  # type: ignore[return-value]


class Verdict(BaseModel):
    """Whether one variant qualified for one class of calls on one device, and on what."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    fingerprint: dict[str, str]
    fingerprint_id: str
    group: Group
    variant: str
    version: str  # the variant's full version it was qualified at
    passed: bool
    cases: int  # cases run (each out= form of a case counts as one)
    failed_case: str = ""
    reason: str = ""
    where: Literal["process", "child"] = "process"
    seconds: float = 0.0
    # Per shape axis, the largest size a passing check ran at (edge cases and calibrated shapes):
    # beyond it in some axis, the variant runs a shape it was never compared at.
    largest: Shape = ()
    qualified_at: float

    def storage_key(self) -> str:
        return verdict_key(self.fingerprint_id, self.group, self.variant)

    def summary(self) -> str:
        if self.passed:
            return f"qualified ({self.cases} cases)"
        return f"failed qualification: {self.failed_case}: {self.reason}" if self.failed_case else \
            f"failed qualification: {self.reason}"


def verdict_key(fingerprint_id: str, group: Group, variant: str) -> str:
    return f"{VERDICT_PREFIX}{fingerprint_id}|{group.slug()}|{variant}"


def class_cases(spec: OpSpec, caps: Any, features: Features, *, dtype: Any, device: str) -> Iterator[tuple[str, Case]]:
    """Each named edge case of ``spec`` built for the class ``features`` at ``dtype``: its own
    options with the class's features over them, at the nearest sizes ``caps`` takes; a case
    that is no call of this class (an empty decode, which the contract refuses) is left out."""
    named: Mapping[str, Mapping[str, Any]] = spec.edge_cases or dict(spec.conformance(caps))
    want = features.model_dump()
    seen: set[str] = set()
    for label, options in named.items():
        opts = {**options, **want}
        shape = caps.fit(spec.axes, tuple(opts.pop("shape")))
        if shape is None:
            continue
        ident = repr((shape, sorted(opts.items(), key=lambda kv: kv[0])))
        if ident in seen:  # the class's features made it another case's twin
            continue
        try:
            case = spec.make_case(shape, dtype=dtype, device=device, **opts)
            key = spec.key_of_case(case)
        except (ValueError, TypeError):
            continue
        if key.features != features or caps.uncovered(key) is not None:
            continue
        seen.add(ident)
        yield label, case


def _run_cases(spec: OpSpec, rv: RegisteredVariant, features: Features, dtype: Any, device: str) -> dict[str, Any]:
    """Every case of the class on ``rv``: how many ran, the first failure, the largest sizes."""
    from ._verify import out_forms, reference_result, verify

    caps = rv.variant.capabilities
    ran, largest = 0, [0] * len(spec.axes)
    for label, case in class_cases(spec, caps, features, dtype=dtype, device=device):
        expected = reference_result(case)
        for form in (None, *out_forms(spec, caps, case)):
            ran += 1
            why = verify(rv.variant.fn, case, expected, out=form)
            if why is not None:
                name = label if form is None else f"{label}, out= {form.replace('_', ' ')}"
                return {"cases": ran, "failed_case": f"{name} ({str(dtype)[6:]})", "reason": why}
        largest = [max(a, b) for a, b in zip(largest, spec.key_of_case(case).shape, strict=True)]
    if ran == 0:
        return _failed("no edge case of this class fits its declared limits")
    return {"cases": ran, "failed_case": "", "reason": "", "largest": largest}


def check_at(spec: OpSpec, rv: RegisteredVariant, shape: Shape, features: Features, *, dtype: Any,
             device: str, seed: int = 0) -> str | None:
    """One check at ``shape`` with the op's traps in it (``check_options``): None when right."""
    from ._verify import verify

    case = spec.make_case(tuple(shape), dtype=dtype, device=device, seed=seed,
                          **{**features.model_dump(), **spec.check_options})
    return verify(rv.variant.fn, case)


def isolated(rv: RegisteredVariant) -> bool:
    """Whether ``rv`` qualifies in a child process: it says so, or it does not say it is pure."""
    return rv.variant.isolate is not False


def run_qualification(spec: OpSpec, rv: RegisteredVariant, features: Features, *, dtype: Any, device: str,
                      timeout_s: float = CHILD_TIMEOUT_S) -> tuple[dict[str, Any], str]:
    """The cases' outcome for ``rv`` (see ``_run_cases``) and where it ran ("process", "child")."""
    if not isolated(rv):
        return _run_cases(spec, rv, features, dtype, device), "process"
    if device == "cpu" and hasattr(os, "fork"):
        return _forked(lambda: _run_cases(spec, rv, features, dtype, device), timeout_s), "child"
    return _spawned(spec, rv, features, dtype, device, timeout_s), "child"


def _forked(work: Callable[[], dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    """``work()`` in a forked child; its death (a signal, an exit, a hang) is the outcome."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 0
        try:
            os.close(r)
            faulthandler.disable()  # a crash here is a verdict, reported by the parent: no dump
            # The cases' tensors are freed (by reference count) when work() returns: a heap the
            # kernel corrupted aborts here, before a verdict is sent. (A full gc.collect() costs
            # ~100 ms in a process that has imported torch: no cycles hold tensors here.)
            result = work()
            payload = json.dumps(result).encode()
            while payload:
                payload = payload[os.write(w, payload):]
        except BaseException as exc:  # the child reports whatever happened, then exits
            code = 3
            with contextlib.suppress(Exception):
                os.write(w, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(code)
    os.close(w)
    return _collect(pid, r, timeout_s)


def _collect(pid: int, r: int, timeout_s: float) -> dict[str, Any]:
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    hung = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = True
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            data = os.read(r, 1 << 16)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(r)
    if hung:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if hung:
        return _failed(f"hung: no verdict within {timeout_s:.0f} s (killed)")
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return _outcome(b"".join(chunks), sig, os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1)


def _failed(reason: str) -> dict[str, Any]:
    return {"cases": 0, "failed_case": "", "reason": reason}


def _outcome(data: bytes, sig: int | None, code: int) -> dict[str, Any]:
    """What a child's output, its signal (None: it exited) and exit status say of its variant."""
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return _failed(f"crashed: its process was killed by {name}")
    try:
        result = json.loads(data.decode() or "null")
    except ValueError:
        result = None
    if isinstance(result, dict) and "error" in result:
        return _failed(f"qualification itself failed: {result['error']}")
    if not isinstance(result, dict) or code != 0:
        return _failed(f"crashed: its process exited with status {code} before giving a verdict")
    return result


_CHILD = """
import json, sys
from kernel_variants.dispatch._qualify import child_main
child_main(json.loads(sys.argv[1]))
"""


def _spawned(spec: OpSpec, rv: RegisteredVariant, features: Features, dtype: Any, device: str,
             timeout_s: float) -> dict[str, Any]:
    """``_run_cases`` in a fresh interpreter that loads the installed plugins (an accelerator's
    runtime does not survive fork)."""
    from kernel_variants._dtypes import dtype_name

    job = {"op": spec.name, "variant": rv.id, "version": rv.version, "features": features.model_dump(),
           "dtype": dtype_name(dtype), "device": device}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(job)], capture_output=True,
                              timeout=timeout_s, check=False, env={**os.environ, "KV_QUALIFY": "off"})
    except subprocess.TimeoutExpired:
        return _failed(f"hung: no verdict within {timeout_s:.0f} s (killed)")
    lines = done.stdout.strip().splitlines()
    sig = -done.returncode if done.returncode < 0 else None
    return _outcome(lines[-1] if lines else b"", sig, max(done.returncode, 0))


def child_main(job: dict[str, Any]) -> None:
    """The spawned child: qualify one variant of the installed registry, print the outcome."""
    from kernel_variants._dtypes import as_dtype

    from ._dispatcher import dispatcher

    registry = dispatcher().registry
    spec = registry.spec(job["op"])
    try:
        rv = registry.get(spec.name, job["variant"])
    except KeyError:
            result = _failed("not registered in a fresh process (a plugin registered in-process only "
                         "cannot be isolated)")
    else:
        if rv.version != job["version"]:
            result = _failed("a fresh process loads another version of it")
        else:
            why = rv.ensure_built()
            result = _run_cases(spec, rv, spec.features(**job["features"]), as_dtype(job["dtype"]), job["device"]) \
                if why is None else _failed(why)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def verdict_from(outcome: Mapping[str, Any], *, key: CallKey, rv: RegisteredVariant, fingerprint: dict[str, str],
                 fingerprint_id: str, where: str, seconds: float) -> Verdict:
    passed = not outcome.get("reason") and outcome.get("cases", 0) > 0
    return Verdict(fingerprint=fingerprint, fingerprint_id=fingerprint_id, group=Group.of(key), variant=rv.id,
                   version=rv.version, passed=passed, cases=int(outcome.get("cases", 0)),
                   failed_case=str(outcome.get("failed_case", "")), reason=str(outcome.get("reason", "")),
                   where=where, seconds=round(seconds, 4),  # type: ignore[arg-type]
                   largest=tuple(outcome.get("largest") or ()), qualified_at=time.time())


def parse_verdict(raw: str | None) -> Verdict | None:
    if raw is None:
        return None
    try:
        return Verdict.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None


def beyond(verdict: Verdict, shape: Shape, axes: tuple[str, ...]) -> str | None:
    """Which axes of ``shape`` exceed every size ``verdict`` checked its variant at, as text."""
    if not verdict.largest or len(verdict.largest) != len(shape):
        return None
    over = [f"{a}={v} > {m}" for a, v, m in zip(axes, shape, verdict.largest, strict=True) if v > m]
    return ", ".join(over) or None


NOT_YET = "not qualified on this device yet (its first call qualifies it; `kv qualify` does it ahead)"


class Qualifier:
    """The verdicts of one table, and the one rule of who may be chosen: a variant may run a
    call when it passed its class's cases on this device (the reference always may)."""

    def __init__(self, table: Callable[[], Any], policy: Policy) -> None:
        self._table = table
        self.policy = policy
        self._cache: dict[str, Verdict | None] = {}
        self._said_off = False

    def _where(self, key: CallKey) -> tuple[dict[str, str], str]:
        from ._fingerprint import fingerprint, fingerprint_id

        fp = fingerprint(key.where)
        return fp, fingerprint_id(fp)

    def stored(self, rv: RegisteredVariant, key: CallKey) -> Verdict | None:
        """The current verdict of ``rv`` for ``key``'s class (None: none, or of another version)."""
        _, fpid = self._where(key)
        skey = verdict_key(fpid, Group.of(key), rv.id)
        if skey not in self._cache:
            self._cache[skey] = parse_verdict(self._table().store.get(skey))
        v = self._cache[skey]
        return v if v is not None and v.version == rv.version else None

    def _keep(self, v: Verdict) -> Verdict:
        table = self._table()
        table._guard(table.store.set, v.storage_key(), v.model_dump_json())
        self._cache[v.storage_key()] = v
        return v

    def qualify(self, rv: RegisteredVariant, key: CallKey, *, announce: bool = False) -> Verdict:
        """Run ``rv``'s cases for ``key``'s class now (building it first) and keep the verdict.
        ``announce`` (a call's first use): say on stderr what ran, when it took longer than a
        second, ran in a child process or failed (kv qualify and kv calibrate report their own)."""
        from kernel_variants._dtypes import as_dtype

        fp, fpid = self._where(key)
        t0 = time.perf_counter()
        why = rv.ensure_built()
        if why is not None:
            outcome, where = _failed(f"cannot run here: {why}"), "process"
        else:
            outcome, where = run_qualification(key.spec, rv, key.features, dtype=as_dtype(key.dtype),
                                               device=key.where)
        seconds = time.perf_counter() - t0
        v = self._keep(verdict_from(outcome, key=key, rv=rv, fingerprint=fp, fingerprint_id=fpid, where=where,
                                    seconds=seconds))
        if announce and (seconds > SLOW_S or where == "child" or not v.passed):
            print(f"kernel_variants: {rv.id} for {_describe(key)}: {v.summary()} "
                  f"({'in a child process, ' if where == 'child' else ''}{seconds:.1f} s)", file=sys.stderr)
        return v

    def barred(self, rv: RegisteredVariant, key: CallKey, *, may_run: bool, announce: bool = False) -> str | None:
        """Why ``rv`` may not be chosen for ``key`` (None: it may). ``may_run``: qualify it now
        if it has no verdict (never while a graph is captured or traced, nor for ``explain``);
        ``announce``: say so on stderr (a call's first use on a machine)."""
        if self.policy == "off" or rv.variant.fn is key.spec.reference.fn:
            if self.policy == "off" and not self._said_off:
                self._said_off = True
                print("kernel_variants: KV_QUALIFY=off: variants are chosen without being checked on this "
                      "device", file=sys.stderr)
            return None
        v = self.stored(rv, key)
        if v is None:
            if not may_run:
                return NOT_YET
            v = self.qualify(rv, key, announce=announce)
        if v.passed and self.policy == "strict" and may_run and beyond(v, key.shape, key.spec.axes):
            v = self.check(rv, key, key.shape)
        return None if v.passed else v.summary()

    def failed(self, entries: list[RegisteredVariant], key: CallKey) -> dict[str, str]:
        """Those of ``entries`` whose stored verdict for ``key``'s class is a failure, with why."""
        if self.policy == "off":
            return {}
        out = {}
        for rv in entries:
            v = self.stored(rv, key)
            if v is not None and not v.passed:
                out[rv.id] = v.summary()
        return out

    def check(self, rv: RegisteredVariant, key: CallKey, shape: Shape, why: str | None = None) -> Verdict:
        """Note a check of ``rv`` at ``shape`` (``why``: its outcome; run now when not given): a
        pass widens what the verdict covers, a failure fails the class (a kernel wrong at one
        size is not trusted at another)."""
        from kernel_variants._dtypes import as_dtype

        v = self.stored(rv, key)
        if v is None:
            v = self.qualify(rv, key)
        if not v.passed:
            return v
        if why is None:
            why = check_at(key.spec, rv, shape, key.features, dtype=as_dtype(key.dtype), device=key.where)
        at = ", ".join(f"{a}={s}" for a, s in zip(key.spec.axes, shape, strict=True))
        if why is not None:
            return self._keep(v.model_copy(update={"passed": False, "failed_case": f"check at {at}",
                                                   "reason": why, "qualified_at": time.time()}))
        largest = tuple(max(a, b) for a, b in zip(v.largest or shape, shape, strict=True))
        return v if largest == v.largest else self._keep(v.model_copy(update={"largest": largest}))

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
        self.forget()
        return n

    def forget(self) -> None:
        self._cache.clear()


def _describe(key: CallKey) -> str:
    flags = " ".join(f"{k}={v}" for k, v in key.features.model_dump().items())
    return f"{key.op} on {key.where} {key.dtype} {flags}".rstrip()
