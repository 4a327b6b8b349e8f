"""Where a qualification runs: in this process for a variant declared pure, else in a child,
so that a kernel that segfaults, dies of SIGILL, aborts on a corrupted heap or hangs is a failed
verdict and the caller lives on. On the CPU the child is forked (it has this process's plugins,
and costs milliseconds); on an accelerator, whose runtime does not survive fork, it is a fresh
interpreter that loads the installed plugins."""

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
from collections.abc import Callable
from typing import Any

from kernel_variants._registry.keys import Features
from kernel_variants._registry.registry import RegisteredVariant, Registry, make_plugin_manager
from kernel_variants._registry.spec import OpSpec
from kernel_variants._tuning.cases import error, failed, run_cases

CHILD_TIMEOUT_S = 300.0  # a class's cases take well under a second; minutes mean a hung kernel


def isolated(rv: RegisteredVariant) -> bool:
    """Whether ``rv`` qualifies in a child process: it says so, or it does not say it is pure."""
    return rv.variant.isolate is not False


def run_qualification(spec: OpSpec, rv: RegisteredVariant, features: Features, *, dtype: Any, device: str,
                      timeout_s: float = CHILD_TIMEOUT_S) -> tuple[dict[str, Any], str]:
    """The cases' outcome for ``rv`` (see ``run_cases``) and where it ran ("process", "child").
    A failure of the machinery itself (no fork, a case that cannot be built) is an error outcome,
    never an exception: the caller's call goes on with another variant."""
    where = "child" if isolated(rv) else "process"
    try:
        if where == "process":
            return run_cases(spec, rv, features, dtype, device), where
        if device == "cpu" and hasattr(os, "fork"):
            return _forked(lambda: run_cases(spec, rv, features, dtype, device), timeout_s), where
        return _spawned(spec, rv, features, dtype, device, timeout_s), where
    except Exception as exc:  # OSError from fork or pipe, ChildProcessError, a case builder's bug
        return error(f"qualification itself failed: {type(exc).__name__}: {exc}"), where


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
        return error("its process's exit status could not be read (SIGCHLD is ignored here)")
    if hung:
        return failed(f"hung: no verdict within {timeout_s:.0f} s (killed)")
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return _outcome(b"".join(chunks), sig, os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1)


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
            return error(f"its process was killed by {name} (not a kernel fault: qualified again later)")
        return failed(f"crashed: its process was killed by {name}")
    try:
        result = json.loads(data.decode() or "null")
    except ValueError:
        result = None
    if isinstance(result, dict) and isinstance(result.get("error"), str):
        return error(f"qualification itself failed: {result['error']}")
    if not isinstance(result, dict) or code != 0:
        return failed(f"crashed: its process exited with status {code} before giving a verdict")
    return result


_CHILD = """
import json, sys
from kernel_variants._tuning.isolate import child_main
child_main(json.loads(sys.argv[1]))
"""


def _spawned(spec: OpSpec, rv: RegisteredVariant, features: Features, dtype: Any, device: str,
             timeout_s: float) -> dict[str, Any]:
    """``run_cases`` in a fresh interpreter that loads the installed plugins (an accelerator's
    runtime does not survive fork)."""
    from kernel_variants._dtypes import dtype_name

    job = {"op": spec.name, "variant": rv.id, "version": rv.version, "features": features.model_dump(),
           "dtype": dtype_name(dtype), "device": device}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(job)], capture_output=True,
                              timeout=timeout_s, check=False, env={**os.environ, "KV_QUALIFY": "off"})
    except subprocess.TimeoutExpired:
        return failed(f"hung: no verdict within {timeout_s:.0f} s (killed)")
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

    try:
        registry = Registry(make_plugin_manager())
        spec = registry.spec(job["op"])
        rv = registry.get(spec.name, job["variant"])
    except (KeyError, ValueError) as exc:
        result = error(f"not registered in a fresh process ({exc}); a plugin registered in-process "
                        "only cannot be isolated")
    else:
        if rv.version != job["version"]:
            result = error("a fresh process loads another version of it")
        elif (why := rv.ensure_built()) is not None:
            result = error(why)
        else:
            result = run_cases(spec, rv, spec.features(**job["features"]), as_dtype(job["dtype"]), job["device"])
    sys.stdout.buffer.write(_RESULT + json.dumps(result).encode() + b"\n")
    sys.stdout.flush()
