"""First contact: what a user installs from an index is what the checkout runs.

The full round trip (wheel into a fresh virtualenv, conformance subset and a smoke calibration
from there) is ``tools/wheel_roundtrip.sh``, which ``.ci/run`` runs; this test checks the cheap
part on every test run: the wheel holds every file git tracks under ``src/``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked_package_files() -> set[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "src/kernel_variants"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return {p.removeprefix("src/") for p in out}


def test_the_wheel_holds_every_tracked_package_file(tmp_path):
    # Without build isolation the backend is the test extra's setuptools>=70.1 (no download).
    tracked = _tracked_package_files()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("kernel_variants-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        packaged = set(z.namelist())
    missing = sorted(tracked - packaged)
    assert not missing, f"tracked files missing from the wheel: {missing}"
