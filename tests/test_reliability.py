"""Reliability findings that need real processes: fork() after a parallel region, and four
processes meeting one first build."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")


def test_a_forked_childs_first_dispatched_call_completes():
    """Finding 6: with GNU OpenMP, a child forked after the parent ran a parallel region hung in
    its first one. The child now runs one intra-op thread (or dies of SIGALRM, failing here)."""
    code = textwrap.dedent("""
        import os, signal, sys, torch
        import kernel_variants as kv
        x, w = torch.randn(8, 256, 512), torch.randn(512, 4)
        kv.causal_conv1d_fn(x, w)  # a parallel region in the parent
        threads = torch.get_num_threads()
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # default action: a hung child dies instead of hanging the test
            kv.causal_conv1d_fn(x, w)
            kv.gemma_rms_norm(torch.randn(64, 256), torch.zeros(256))
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert torch.get_num_threads() == threads, "the parent's threads changed"
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child exit {proc.returncode} (-14: hung until SIGALRM)\n{proc.stderr[-2000:]}"


def test_four_processes_meeting_a_first_build_build_once_and_all_succeed(tmp_path):
    """Finding 3's other half: concurrent first use builds once (an OS lock, not a lock file)."""
    log = tmp_path / "builds.log"
    code = textwrap.dedent(f"""
        import time, types
        from pathlib import Path
        from torch.utils import cpp_extension
        from kernel_variants.kernels.cpu_native import _build

        def fake_load(name, sources, build_directory, **kw):
            so = Path(build_directory) / f"{{name}}.so"
            if not so.exists():
                with open({str(log)!r}, "a") as f:
                    f.write("build\\n")
                time.sleep(1.0)
                so.write_text("")
            return types.SimpleNamespace(__file__=str(so))

        cpp_extension.load = fake_load
        print(_build.build(_build.CONV))
    """)
    env = {**os.environ, "KV_BUILD_DIR": str(tmp_path / "build")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-500:] for _, err in outs]
    assert log.read_text().count("build") == 1
    assert len({out.strip() for out, _ in outs}) == 1
