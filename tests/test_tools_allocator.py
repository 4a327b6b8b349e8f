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
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    return {**env, **extra}


def _allocator(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", "import _report; print(_report.allocator())"], cwd=TOOLS,
                          env=env, capture_output=True, text=True, check=True, timeout=120)
    return done.stdout.strip()


def test_the_report_names_glibc_with_its_defaults_and_tuned():
    assert _allocator(_env()) == "glibc defaults"
    tuned = _allocator(_env(**ALLOC_ENV))
    assert tuned.startswith("glibc, tuned (") and all(f"{k}={v}" in tuned for k, v in ALLOC_ENV.items())
    # One tunable alone does not make large outputs reusable: still the defaults.
    assert _allocator(_env(MALLOC_MMAP_THRESHOLD_=ALLOC_ENV["MALLOC_MMAP_THRESHOLD_"])) == "glibc defaults"


def test_the_vllm_tool_restarts_itself_under_the_tuned_glibc_unless_told_not_to():
    # The tool's start, up to where it would measure: execve reports instead of restarting, and
    # the dispatcher (the tool's first step after the allocator) ends the run.
    probe = ("import os, runpy, sys\n"
             "import kernel_variants._runtime.dispatcher as d\n"
             "d.dispatcher = lambda: sys.exit(3)\n"
             "os.execve = lambda exe, argv, env: (print('restart', env.get('MALLOC_TRIM_THRESHOLD_'), *argv[2:]),"
             " sys.exit(0))\n"
             f"sys.path.insert(0, {str(TOOLS)!r})\n"
             f"runpy.run_path({str(TOOLS / 'bench_vllm_cpu.py')!r}, run_name='__main__')\n")

    def run(*argv: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", probe, *argv], env=_env(**env), capture_output=True,
                              text=True, timeout=300, check=False)

    reusing = run("--grid")
    assert reusing.returncode == 0, reusing.stderr[-2000:]
    assert reusing.stdout.splitlines()[0] == f"restart {ALLOC_ENV['MALLOC_TRIM_THRESHOLD_']} --grid"
    # Told to keep glibc's defaults, or already tuned: no restart, on to the measurement.
    for done in (run("--grid", "--allocator", "default"), run("--grid", **ALLOC_ENV)):
        assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
        assert "restart" not in done.stdout
