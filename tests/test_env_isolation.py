"""The test session's environment: a KV_* setting left in the developer's shell (KV_QUALIFY=off,
KV_FORCE, KV_CALL_CORE=0, one added later) changes nothing a test sees, at import or in a test;
KV_BUILD_DIR, where the built extensions live, is kept (conftest.KEPT_ENV says why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Run in a child pytest, with and without this suite's conftest: one test per leaked setting.
_TINY = """
import os

import torch

import kernel_variants as kv
from kernel_variants._runtime import callcore
from kernel_variants._runtime.dispatcher import dispatcher

AT_IMPORT = sorted(name for name in os.environ if name.startswith("KV_"))


def test_no_forced_variant():
    assert kv.explain("causal_conv1d_fn", torch.randn(1, 4, 8), torch.randn(8, 4)).source != "forced"


def test_the_default_qualification_policy():
    assert dispatcher().qualifier.policy == "require"


def test_the_call_core_not_turned_off():
    assert "KV_CALL_CORE" not in callcore.status()[1]


def test_only_the_build_folder_is_kept_at_import():
    assert AT_IMPORT == ["KV_BUILD_DIR"] and os.environ["KV_BUILD_DIR"] == os.environ["EXPECTED_BUILD_DIR"]
"""

_LEAKED = {"KV_QUALIFY": "off", "KV_FORCE": "causal_conv1d_fn=aten", "KV_CALL_CORE": "0", "KV_RECORD": "1",
           "KV_STRICT_PLUGINS": "1", "KV_SHADOW": "1", "KV_NOT_YET_INVENTED": "1"}


def _child_pytest(tmp_path: Path, *plugin: str) -> subprocess.CompletedProcess[str]:
    from kernel_variants._paths import build_dir

    (tmp_path / "test_tiny.py").write_text(_TINY)
    env = {**os.environ, **_LEAKED, "KV_BUILD_DIR": str(build_dir()), "EXPECTED_BUILD_DIR": str(build_dir()),
           "KV_CACHE_DIR": str(tmp_path / "cache"),  # what the conftest-less run may write goes there
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
                           "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_leaked_kv_settings_change_nothing_in_a_test_session(tmp_path):
    bare = _child_pytest(tmp_path)  # the control: each setting does change what a test sees
    assert "4 failed" in bare.stdout, bare.stdout[-3000:] + bare.stderr[-2000:]
    isolated = _child_pytest(tmp_path, "-p", "conftest")
    assert isolated.returncode == 0, isolated.stdout[-3000:] + isolated.stderr[-2000:]
    assert "4 passed" in isolated.stdout
