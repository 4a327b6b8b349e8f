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
import threading
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
    seen: list[Case] = []
    for label, case in class_cases(spec, caps, features, dtype=dtype, device=device):
        seen.append(case)
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
    if len(seen) > 1:
        ran += 1
        why = _reused_output(rv.variant.fn, seen[0], seen[1])
        if why is not None:
            return {"cases": ran, "failed_case": f"two calls in a row ({str(dtype)[6:]})", "reason": why}
    return {"cases": ran, "failed_case": "", "reason": "", "largest": largest}


def _reused_output(fn: Callable[..., Any], first: Case, second: Case) -> str | None:
    """Why the result of one call changes when ``fn`` is called again (it hands out a buffer it
    reuses: the caller's first result would be overwritten), or None."""
    import torch

    from ._verify import copy_case

    def tensors(out: Any) -> list[torch.Tensor]:
        return [t for t in (out if isinstance(out, tuple | list) else (out,)) if isinstance(t, torch.Tensor)]

    outs = tensors(copy_case(first).call(fn))
    kept = [t.clone() for t in outs]
    copy_case(second).call(fn)
    for t, k in zip(outs, kept, strict=True):
        # NaN-aware and bit-exact where it matters: the same call's own result, before and after
        if not torch.equal(torch.nan_to_num(t, 1.5, 2.5, 3.5), torch.nan_to_num(k, 1.5, 2.5, 3.5)):
            return "an output changed when it was called again (it returns a buffer it reuses)"
    return None


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
    """The cases' outcome for ``rv`` (see ``_run_cases``) and where it ran ("process", "child").
    A failure of the machinery itself (no fork, a case that cannot be built) is an error outcome,
    never an exception: the caller's call goes on with another variant."""
    where = "child" if isolated(rv) else "process"
    try:
        if where == "process":
            return _run_cases(spec, rv, features, dtype, device), where
        if device == "cpu" and hasattr(os, "fork"):
            return _forked(lambda: _run_cases(spec, rv, features, dtype, device), timeout_s), where
        return _spawned(spec, rv, features, dtype, device, timeout_s), where
    except Exception as exc:  # OSError from fork or pipe, ChildProcessError, a case builder's bug
        return _error(f"qualification itself failed: {type(exc).__name__}: {exc}"), where


def _forked(work: Callable[[], dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    """``work()`` in a forked child; its death (a signal, an exit, a hang) is the outcome."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        os.close(r)
        os.close(w)
        raise
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
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # a host that reaps its children itself (SIGCHLD ignored)
        return _error("its process's exit status could not be read (SIGCHLD is ignored here)")
    if hung:
        return _failed(f"hung: no verdict within {timeout_s:.0f} s (killed)")
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return _outcome(b"".join(chunks), sig, os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1)


def _failed(reason: str) -> dict[str, Any]:
    return {"cases": 0, "failed_case": "", "reason": reason}


def _error(reason: str) -> dict[str, Any]:
    """An outcome that says nothing about the variant (the machine, the runtime, the check
    itself failed): it bars the variant in this process only, and is never stored."""
    return {**_failed(reason), "error": True}


# Deaths a kernel causes; a SIGKILL (the OOM killer, an operator) or SIGTERM says nothing of it.
KERNEL_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT})


def _outcome(data: bytes, sig: int | None, code: int) -> dict[str, Any]:
    """What a child's output, its signal (None: it exited) and exit status say of its variant."""
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig not in KERNEL_SIGNALS:
            return _error(f"its process was killed by {name} (not a kernel fault: qualified again later)")
        return _failed(f"crashed: its process was killed by {name}")
    try:
        result = json.loads(data.decode() or "null")
    except ValueError:
        result = None
    if isinstance(result, dict) and isinstance(result.get("error"), str):
        return _error(f"qualification itself failed: {result['error']}")
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
    found = [ln[len(_RESULT):] for ln in done.stdout.splitlines() if ln.startswith(_RESULT)]
    sig = -done.returncode if done.returncode < 0 else None
    outcome = _outcome(found[-1] if found else b"", sig, max(done.returncode, 0))
    if outcome.get("reason") and not found:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        outcome["reason"] += f" ({tail[0][:300]})" if tail[0] else ""
    return outcome


_RESULT = b"kernel_variants qualification: "  # the child's result line, whatever else it prints


def child_main(job: dict[str, Any]) -> None:
    """The spawned child: qualify one variant of the installed registry, print the outcome."""
    from kernel_variants._dtypes import as_dtype

    from ._dispatcher import dispatcher

    try:
        registry = dispatcher().registry
        spec = registry.spec(job["op"])
        rv = registry.get(spec.name, job["variant"])
    except (KeyError, ValueError) as exc:
        result = _error(f"not registered in a fresh process ({exc}); a plugin registered in-process "
                        "only cannot be isolated")
    else:
        if rv.version != job["version"]:
            result = _error("a fresh process loads another version of it")
        elif (why := rv.ensure_built()) is not None:
            result = _error(why)
        else:
            result = _run_cases(spec, rv, spec.features(**job["features"]), as_dtype(job["dtype"]), job["device"])
    sys.stdout.buffer.write(_RESULT + json.dumps(result).encode() + b"\n")
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


def verdict_fingerprint(fp: dict[str, str]) -> dict[str, str]:
    """The part of a device fingerprint a verdict is valid for: not the CPU's thread count, which
    changes timings but not whether a kernel is right (a verdict holds for every process)."""
    return {k: v for k, v in fp.items() if k != "threads"}


class Qualifier:
    """The verdicts of one table, and the one rule of who may be chosen: a variant may run a
    call when it passed its class's cases on this device (the reference always may).

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
        from ._fingerprint import fingerprint, fingerprint_id

        fp = verdict_fingerprint(fingerprint(key.where))
        return fp, fingerprint_id(fp)

    def stored(self, rv: RegisteredVariant, key: CallKey) -> Verdict | None:
        """The current verdict of ``rv`` for ``key``'s class (None: none, or of another version)."""
        _, fpid = self._where(key)
        skey = verdict_key(fpid, Group.of(key), rv.id)
        v = self._errors.get(skey)
        if v is None:
            if skey not in self._cache:
                table = self._table()
                self._cache[skey] = parse_verdict(table._guard(table.store.get, skey))
            v = self._cache[skey]
        return v if v is not None and v.version == rv.version else None

    def _keep(self, v: Verdict, *, persist: bool = True) -> Verdict:
        skey = v.storage_key()
        before = self._errors.get(skey) or self._cache.get(skey)
        if persist:
            table = self._table()
            table._guard(table.store.set, skey, v.model_dump_json())
            self._cache[skey] = v
            self._errors.pop(skey, None)
        else:
            self._errors[skey] = v
        if not v.passed and (before is None or before.passed):
            self._on_failure()
        return v

    def qualify(self, rv: RegisteredVariant, key: CallKey, *, announce: bool = False) -> Verdict:
        """Run ``rv``'s cases for ``key``'s class now (building it first) and keep the verdict.
        ``announce`` (a call's first use): say on stderr what ran, when it took longer than a
        second, ran in a child process or failed (kv qualify and kv calibrate report their own).
        An outcome that says nothing about the variant (its build failed, the child was killed
        by the system, the check itself broke) bars it in this process only: not stored."""
        from kernel_variants._dtypes import as_dtype

        with self._lock:
            fp, fpid = self._where(key)
            t0 = time.perf_counter()
            why = rv.ensure_built()
            if why is not None:
                outcome, where = _error(f"cannot run here: {why}"), "process"
            else:
                outcome, where = run_qualification(key.spec, rv, key.features, dtype=as_dtype(key.dtype),
                                                   device=key.where)
            seconds = time.perf_counter() - t0
            v = self._keep(verdict_from(outcome, key=key, rv=rv, fingerprint=fp, fingerprint_id=fpid, where=where,
                                        seconds=seconds), persist=not outcome.get("error"))
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
        """Those of ``entries`` whose verdict for ``key``'s class is a failure, with why."""
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
            try:
                why = check_at(key.spec, rv, shape, key.features, dtype=as_dtype(key.dtype), device=key.where)
            except Exception as exc:  # the check could not be built (out of memory, say): no verdict on it
                return self._keep(v.model_copy(update={"passed": False, "reason": f"qualification itself failed "
                                                       f"at {shape}: {type(exc).__name__}: {exc}"}), persist=False)
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
        self._errors.clear()
        self.forget()
        return n

    def forget(self) -> None:
        """Drop the stored verdicts read so far (another process may have written since); the
        errors of this process stay (its machine has not changed)."""
        self._cache.clear()


def _describe(key: CallKey) -> str:
    flags = " ".join(f"{k}={v}" for k, v in key.features.model_dump().items())
    return f"{key.op} on {key.where} {key.dtype} {flags}".rstrip()
