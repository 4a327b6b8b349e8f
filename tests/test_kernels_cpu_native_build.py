"""The cpu_native C++ build: announced, never started behind a listing or an explanation, not
blocked by a lock a killed build left, built once when several processes meet it first, and a
failed build makes the variant unavailable rather than the call fail. A complete build is loaded
as it is, asking no ninja (whichever is first on PATH); one whose stamp does not match what it
would be built from now is built again, not loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import kernel_variants as kv
from kernel_variants._cli import main
from kernel_variants._native import build as _build
from kernel_variants._native import stamp as _stamp
from kernel_variants._runtime.core_build import CORE
from kernel_variants.kernels.cpu_native._build import CONV, GDN, RMS, SSM, kernel


@pytest.fixture
def fresh_build_dir(monkeypatch, tmp_path):
    """An empty build cache, and cpp_extension.load replaced: the tests decide what a build does."""
    monkeypatch.setenv("KV_BUILD_DIR", str(tmp_path / "build"))
    _build.load_extension.cache_clear()
    calls = []

    def fake_load(name, sources, build_directory, **kw):
        calls.append(build_directory)
        from pathlib import Path

        assert not (Path(build_directory) / "lock").exists(), "a stale cpp_extension lock reached the build"
        (Path(build_directory) / f"{name}.so").write_text("")
        return types.SimpleNamespace(__file__=str(Path(build_directory) / f"{name}.so"))

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    # A complete build is imported without cpp_extension: the stand-in's empty file as its module.
    monkeypatch.setattr(_stamp, "import_so", lambda name, so: types.SimpleNamespace(__file__=str(so)))
    monkeypatch.setattr(_build, "_imported", {})
    kv.reload()
    yield calls
    _build.load_extension.cache_clear()
    kv.reload()


def test_each_torch_install_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    # Two virtualenvs with the same torch release and checkout: their ninja files name
    # different torch headers, so one shared folder would be rebuilt each time they take turns.
    import torch

    mine = _build._name_and_dir(CONV)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    other = _build._name_and_dir(CONV)
    assert mine[0] != other[0] and mine[1] != other[1]
    assert mine[1].parent == other[1].parent  # the same cache, a folder each


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock semantics as on Linux")
def test_a_new_build_removes_the_folders_it_supersedes_and_no_other(fresh_build_dir, monkeypatch, tmp_path):
    # Every edit of the sources (or upgrade) builds a new folder of a few MB: the ones built
    # for the same checkout, torch install and flags go; another install's, one with a build
    # under way (its lock held) and one of unknown origin stay.
    import fcntl
    import json

    first = _build.build(CONV)
    assert json.loads((_build._name_and_dir(CONV)[1] / _build._ORIGIN).read_text()) == _build._origin(CONV)
    cache = _build._name_and_dir(CONV)[1].parent
    busy = cache / "busy"
    unknown = cache / "unknown"
    other_torch = cache / "other-torch"
    for folder in (busy, unknown, other_torch):
        folder.mkdir()
    (busy / _build._ORIGIN).write_text(json.dumps(_build._origin(CONV)))
    (other_torch / _build._ORIGIN).write_text(json.dumps({**_build._origin(CONV), "torch": "/elsewhere"}))
    real_tag = _build._build_tag
    monkeypatch.setattr(_build, "_build_tag", lambda *a: real_tag(*a) + "0")  # the sources edited
    _build.load_extension.cache_clear()
    with open(busy / "kv-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        second = _build.build(CONV)
    assert second != first and len(fresh_build_dir) == 2
    assert sorted(p.name for p in cache.iterdir()) == sorted([os.path.basename(second), "busy", "unknown",
                                                             "other-torch"])
    _build.load_extension.cache_clear()
    _build.build(CONV)  # loading what is built removes nothing
    assert len(list(cache.iterdir())) == 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock semantics as on Linux")
def test_a_new_build_removes_a_deleted_install_s_folder_unloaded_for_a_week(fresh_build_dir, monkeypatch, tmp_path):
    # A virtualenv or checkout deleted (a CI clone, a rebuilt venv) leaves its folder, which no
    # origin matches again. Gone and unloaded for a week, it goes; gone but loaded lately (a
    # cache shared by containers that mount their installs elsewhere) or present, it stays.
    import json
    import time

    _build.build(CONV)
    cache = _build._name_and_dir(CONV)[1].parent
    mine = _build._origin(CONV)
    week_ago = time.time() - _build._ORPHAN_GRACE_S - 60
    folders = {"gone-torch-old": ({**mine, "torch": str(tmp_path / "deleted-venv")}, week_ago),
               "gone-sources-old": ({**mine, "sources": str(tmp_path / "deleted-clone")}, week_ago),
               "gone-torch-recent": ({**mine, "torch": str(tmp_path / "deleted-venv")}, time.time() - 3600),
               "present-old": ({**mine, "flags": "-O2"}, week_ago),
               "not-a-record": ([1, 2], week_ago)}
    for name, (record, when) in folders.items():
        (cache / name).mkdir()
        (cache / name / _build._ORIGIN).write_text(json.dumps(record))
        os.utime(cache / name / _build._ORIGIN, (when, when))
    real_tag = _build._build_tag
    monkeypatch.setattr(_build, "_build_tag", lambda *a: real_tag(*a) + "0")  # the sources edited
    _build.load_extension.cache_clear()
    second = _build.build(CONV)
    assert sorted(p.name for p in cache.iterdir()) == sorted([os.path.basename(second), "gone-torch-recent",
                                                             "present-old", "not-a-record"])


def test_listing_and_explaining_never_build(fresh_build_dir, capsys):
    assert main(["list", "--op", "fn"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if " cpu_native " in ln)
    assert "not built yet" in line
    import torch

    text = str(kv.explain("causal_conv1d_fn", torch.zeros(1, 4, 8), torch.zeros(8, 4)))
    assert "-> cpu_native" in text and "not built yet" in text
    assert fresh_build_dir == [], "listing or explaining started a build"


def test_a_build_announces_itself_once_and_kv_build_reports_where(fresh_build_dir, capsys):
    # The stand-in build makes an empty module: kv build qualifies what it built and says so.
    assert main(["build"]) == 1
    out, err = capsys.readouterr()
    kernels = [ext.name for ext in (CONV, RMS, SSM, GDN)]
    assert out.count("FAILED") == len(kernels)
    assert all("has no attribute" in v.reason for v in kv.verdicts() if v.variant == "cpu_native")
    assert len(fresh_build_dir) == len(kernels) + 1, ("one extension per op family, each serving all of its ops, "
                                                      "and the call core: each built once")
    for ext, what in [*((n, f"C++ kernel of {n}") for n in kernels), ("call_core", "C++ call core")]:
        notice = [ln for ln in err.splitlines() if f"building the cpu_native {what} " in ln]
        where = [d for d in fresh_build_dir if str(d) in "".join(notice)]
        assert len(notice) == 1 and len(where) == 1 and "about a minute" in notice[0], (ext, notice)
        assert f"cpu_native {ext} build finished in" in err
        assert str(where[0]) in out
    for op in ("causal_conv1d_fn", "causal_conv1d_update", "gemma_rms_norm", "add_gemma_rms_norm",
               "selective_state_update", "ssd_chunk_scan", "gated_delta_rule_update", "chunk_gated_delta_rule"):
        assert op in out
    _build.load_extension.cache_clear()
    assert main(["build"]) == 1  # the same (stand-in) build: its stored verdicts stand
    assert "building" not in capsys.readouterr().err, "an existing build is loaded silently"


def test_a_build_lock_left_by_a_killed_process_is_cleared(fresh_build_dir):
    """cpp_extension's lock file outlives a killed build, and the next process would wait on it
    forever."""
    _, build_dir = _build._name_and_dir(CONV)
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")
    _build.load_extension(CONV)  # the fake load asserts that the lock is gone
    assert fresh_build_dir == [str(build_dir)]


def test_a_failed_build_makes_the_variant_unavailable_and_the_call_goes_elsewhere(monkeypatch, fresh_build_dir):
    def broken(**kw):
        raise RuntimeError("error: no space left on device")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", broken)
    import torch

    x, w = torch.randn(1, 4, 8), torch.randn(8, 4)
    y = kv.causal_conv1d_fn(x, w)  # no error, and (warnings are errors here) no warning
    assert kv.explain("causal_conv1d_fn", x, w).chosen.id != "cpu_native"
    rv = next(rv for rv in kv.variants("causal_conv1d_fn") if rv.id == "cpu_native")
    assert "build failed" in rv.unavailable_reason() and "no space left" in rv.unavailable_reason()
    assert y.shape == x.shape


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_four_processes_meeting_a_first_build_build_once_and_all_succeed(tmp_path):
    """Concurrent first use builds once: an OS lock, which a killed holder releases, not a lock file."""
    log = tmp_path / "builds.log"
    code = textwrap.dedent(f"""
        import time, types
        from pathlib import Path
        from torch.utils import cpp_extension
        from kernel_variants._native import build as _build, stamp as _stamp
        from kernel_variants.kernels.cpu_native._build import CONV

        def fake_load(name, sources, build_directory, **kw):
            so = Path(build_directory) / f"{{name}}.so"
            if not so.exists():
                with open({str(log)!r}, "a") as f:
                    f.write("build\\n")
                time.sleep(1.0)
                so.write_text("")
            return types.SimpleNamespace(__file__=str(so))

        cpp_extension.load = fake_load
        _stamp.import_so = lambda name, so: types.SimpleNamespace(__file__=str(so))
        print(_build.build(CONV))
    """)
    env = {**os.environ, "KV_BUILD_DIR": str(tmp_path / "build")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-500:] for _, err in outs]
    assert log.read_text().count("build") == 1
    assert len({out.strip() for out, _ in outs}) == 1


# A loaded build asks nothing of ninja: this child refuses cpp_extension.load, loads the built
# extension with a ninja first on PATH that leaves a marker and fails, calls it, and only then
# asks for ninja itself (the control: the stand-in is the one a build would run).
_LOAD_WITH_OTHER_NINJA = """
import json, os, sys, time
import torch
from torch.utils import cpp_extension

def refuse(*args, **kwargs):
    raise AssertionError("cpp_extension.load was called for a built extension")

cpp_extension.load = refuse
import kernel_variants as kv
from kernel_variants._runtime import callcore
from kernel_variants.kernels import cpu_native
from kernel_variants._native import build as _build
from kernel_variants.kernels.cpu_native._build import CONV, RMS
from kernel_variants.ops.causal_conv1d import _reference
from kernel_variants.ops.gemma_rms_norm import _spec

which, marker = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(0)
t0 = time.perf_counter()
if which == "call_core":
    on, path = callcore.status()
    seconds = time.perf_counter() - t0
    assert on, path
    os.environ["KV_FORCE"] = "gemma_rms_norm=reference"  # a dispatched call, served through the core
    kv.reload()
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    for _ in range(2):
        torch.testing.assert_close(kv.gemma_rms_norm(x, w), _spec.reference_fn(x, w), rtol=0, atol=0)
elif which == "causal_conv1d":
    _build.load_extension(CONV)
    seconds = time.perf_counter() - t0
    x, w, b = torch.randn(2, 16, 64, generator=g), torch.randn(64, 4, generator=g), torch.randn(64, generator=g)
    torch.testing.assert_close(cpu_native.causal_conv1d_fn(x, w, b, activation="silu"),
                               _reference.causal_conv1d_fn(x, w, b, activation="silu"), rtol=1e-5, atol=1e-5)
else:
    _build.load_extension(RMS)
    seconds = time.perf_counter() - t0
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    torch.testing.assert_close(cpu_native.gemma_rms_norm(x, w), _spec.reference_fn(x, w), rtol=1e-5, atol=1e-5)
assert not os.path.exists(marker), "the other ninja ran"
print(json.dumps({"load_s": seconds, "control": _build.toolchain_missing()}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a shell script as the stand-in ninja")
@pytest.mark.parametrize("ext", [CORE, CONV, RMS], ids=lambda e: e.name)
def test_a_built_extension_loads_without_ninja_whichever_ninja_is_first_on_path(ext, tmp_path):
    """Two ninja releases (the system's, a virtualenv's) read each other's records as stale: a
    process whose PATH found the other one recompiled inside its first call, silently."""
    if _build.toolchain_missing(ext) is not None:
        pytest.skip(f"not built, and cannot be here: {_build.toolchain_missing(ext)}")
    folder = _build.build(ext)  # in the shared cache: a build only where kv build has not made this one
    before = {p.name: p.stat().st_mtime_ns for p in sorted(os.scandir(folder), key=lambda p: p.name)
              if p.name != _build._ORIGIN}  # a load refreshes its record's age
    fake = tmp_path / "bin"
    fake.mkdir()
    marker = tmp_path / "ninja-ran"
    (fake / "ninja").write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(fake), os.environ.get("PATH", "")])}
    done = subprocess.run([sys.executable, "-c", _LOAD_WITH_OTHER_NINJA, ext.name, str(marker)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{ext.name}: loaded in {report['load_s'] * 1e3:.1f} ms with a failing ninja first on PATH")
    assert "building" not in done.stderr
    assert report["control"] is not None and marker.exists(), "the stand-in ninja was not the one on PATH"
    after = {p.name: p.stat().st_mtime_ns for p in sorted(os.scandir(folder), key=lambda p: p.name)
             if p.name != _build._ORIGIN}
    assert after == before, "something in the build folder was rewritten"


def _stale_by(how: str, ext: _build.Extension, csrc) -> None:
    name, build_dir = _build._name_and_dir(ext)
    if how == "sources edited":  # into the same folder: the tag is pinned by the caller
        (csrc / ext.sources[0]).write_text((csrc / ext.sources[0]).read_text() + "\n// edited\n")
    elif how == "shared object rewritten":  # by a build that did not stamp it (an older release's)
        (build_dir / f"{name}.so").write_text("relinked")
    elif how == "no stamp":  # a folder an older release built: ninja is asked once, then it is stamped
        (build_dir / _stamp.STAMP).unlink()
    else:  # a stamp that does not parse: a torn write
        (build_dir / _stamp.STAMP).write_text("{")


@pytest.mark.parametrize("how", ["sources edited", "shared object rewritten", "no stamp", "torn stamp"])
def test_a_folder_whose_stamp_does_not_match_is_built_again_not_loaded(how, fresh_build_dir, monkeypatch,
                                                                      tmp_path, capsys):
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(RMS.csrc, csrc)
    rms = kernel(RMS.name, csrc)
    monkeypatch.setattr(_build, "_build_tag", lambda *a: "pinned-0000000000000000")
    first = _build.build(rms)
    assert _build.is_built(rms) and len(fresh_build_dir) == 1
    _stale_by(how, rms, csrc)
    monkeypatch.setattr(_build, "_imported", {})  # a new process: nothing loaded yet
    _build.load_extension.cache_clear()
    assert not _build.is_built(rms) and _build.load_built(rms) is None
    capsys.readouterr()
    assert _build.build(rms) == first and fresh_build_dir == [first, first]
    assert "building the cpu_native" in capsys.readouterr().err
    monkeypatch.setattr(_build, "_imported", {})
    assert _build.is_built(rms), "the new build is stamped"


def test_sources_edited_while_they_compile_leave_the_build_unstamped(fresh_build_dir, monkeypatch, tmp_path):
    """Such a build is of neither version, so no later process loads it as its folder's."""
    import shutil

    from torch.utils import cpp_extension

    csrc = tmp_path / "csrc"
    shutil.copytree(RMS.csrc, csrc)
    rms = kernel(RMS.name, csrc)
    compile_ = cpp_extension.load

    def edited_meanwhile(**kw):
        (csrc / rms.sources[0]).write_text("// edited during the build\n")
        return compile_(**kw)

    monkeypatch.setattr(cpp_extension, "load", edited_meanwhile)
    folder = _build.build(rms)
    assert not (Path(folder) / _stamp.STAMP).exists()
    assert (Path(folder) / _build._ORIGIN).exists(), "its record stays, for the next build to prune it"
