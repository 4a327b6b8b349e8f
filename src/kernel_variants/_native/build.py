"""Build / load a C++ extension of the package: each its own shared object, so a failed build of
one leaves the others usable.

A complete build is imported straight from its shared object, after checking the stamp its
build wrote (the sources' content, flags, $CXX, torch's version and folder): ninja is run only to
build one that is missing. Asking ninja about an existing build is not safe: the ninja a process
finds depends on its PATH, and two ninja releases (a virtualenv's and the system's) read each
other's records as stale, so a process started the other way recompiled inside its first call
(up to minutes, with no notice and ``is_built()`` True).

Only the standard library is imported at module level, and nothing of kernel_variants: the
runtime loads its call core through this, and the kernels theirs, without either importing the
other. torch and the compiler are touched in `load_extension()`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kernel_variants._native import stamp as _stamp


@dataclass(frozen=True)
class Extension:
    """One extension: its sources (compiled in this order), the headers they include (part of
    its version too), both in ``csrc``, which is also its include path; ``what`` names it in a
    build notice."""

    name: str
    csrc: Path
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    what: str


# No -march=native: the cached .so must run on any x86-64 sharing the cache
# dir, and AVX2 / AVX-512 code is compiled per file and chosen at runtime.
# -fopenmp: at::parallel_for is an inline OpenMP region in ATen's headers and
# silently runs serially without it; the runtime comes from libtorch's libgomp.
# -fno-trapping-math / -fno-math-errno: what torch itself is built with; lets
# GCC if-convert and vectorise the portable build's scalar SiLU (~4x faster).
# -Wno-psabi: silences GCC notes about the vector ABI of ATen's inline
# helpers, which otherwise bury real errors in a failed build's log.
_CFLAGS: tuple[str, ...] = (
    "-O3",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-Wno-psabi",
    *(("-fopenmp",) if sys.platform.startswith("linux") else ()),
)

_LOG_TAIL_LINES = 20


def source_files(ext: Extension) -> list[Path]:
    """Files whose content defines the extension's version."""
    return [ext.csrc / name for name in ext.sources + ext.headers]


def _hash_sources(ext: Extension) -> hashlib._Hash:
    h = hashlib.sha256()
    for path in source_files(ext):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h


def _build_tag(torch_version: str, origin: dict[str, str], ext: Extension) -> str:
    # The .so links against this torch build and this Python's ABI, so both (plus compiler and
    # flags: the origin) key the cache along with the sources' content.
    h = _hash_sources(ext)
    h.update(json.dumps({**origin, "torch_version": torch_version}, sort_keys=True).encode())
    return f"{torch_version.split('+')[0]}-{h.hexdigest()[:16]}"


def user_cache() -> Path:
    """``$XDG_CACHE_HOME/kernel_variants``, or ``~/.cache/kernel_variants``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernel_variants"


def build_root() -> Path:
    """Where builds go: ``KV_BUILD_DIR``, else ``build`` in the user cache."""
    env = os.environ.get("KV_BUILD_DIR")
    return Path(env) if env else user_cache() / "build"


def _build_dir(tag: str) -> Path:
    return build_root() / tag


@contextlib.contextmanager
def _compiler_env() -> Iterator[None]:
    """cpp_extension invokes $CXX or plain `c++`; fall back to g++ if needed."""
    cxx = os.environ.get("CXX")
    if cxx:
        if shutil.which(cxx.split()[0]) is None:
            raise RuntimeError(f"no C++ compiler found ($CXX={cxx!r} is not on PATH)")
        yield
        return
    if shutil.which("c++"):
        yield
        return
    gxx = shutil.which("g++")
    if gxx is None:
        raise RuntimeError("no C++ compiler found (tried $CXX, c++, g++)")
    os.environ["CXX"] = gxx
    try:
        yield
    finally:
        os.environ.pop("CXX", None)


def _log_summary(text: str) -> tuple[str, str]:
    """(first compiler error line or '', the log's error lines plus its tail)."""
    lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln and not ln.startswith("[")]
    first = errors[0].strip() if errors else ""
    keep = [*errors[:_LOG_TAIL_LINES // 2], "...", *lines[-_LOG_TAIL_LINES // 2 :]]
    return first, "\n".join(keep)


def _torch_dir() -> str:
    import torch

    # The folder as cpp_extension names it in the build file's include paths (not resolved: two
    # virtualenvs whose torch is one linked install still write two different build files).
    return os.path.dirname(os.path.abspath(torch.__file__))


def _name_and_dir(ext: Extension) -> tuple[str, Path]:
    import torch

    tag = _build_tag(str(torch.__version__), _origin(ext), ext)
    return f"kv_{ext.name}_cpu_" + tag.rsplit("-", 1)[1][:12], _build_dir(tag)


#: Written in each build folder: what it was built for, its sources' content aside.
_ORIGIN = "kv-origin.json"


def _origin(ext: Extension) -> dict[str, str]:
    """A build's inputs but the sources' content (and torch's version, which the folder of
    torch's install stands for): a later build with the same origin supersedes it. The source
    directory and torch's are in it because ninja's build file names the sources and torch's
    headers by path: a second checkout or virtualenv sharing the cache would otherwise rewrite
    it and recompile in silence (2 minutes on 2 cores), each time the two take turns."""
    return {"ext": ext.name, "sources": str(ext.csrc), "torch": _torch_dir(), "cxx": os.environ.get("CXX", ""),
            "flags": " ".join(_CFLAGS), "python": sys.implementation.cache_tag or "", "machine": platform.machine()}


#: How long a folder whose torch install or sources are gone is kept since its last load: a
#: cache shared between containers that mount their virtualenvs at different paths sees the
#: others' installs as gone, and must not take turns deleting and rebuilding (2 minutes each).
_ORPHAN_GRACE_S = 7 * 24 * 3600


def _orphaned(record: Path, folder_of: dict[str, str]) -> bool:
    """Whether the install or checkout a build served is gone from this machine and the folder
    went unloaded for a week (each load rewrites its record, so the record's age is that)."""
    gone = not (os.path.isdir(folder_of.get("torch", "")) and os.path.isdir(folder_of.get("sources", "")))
    return gone and time.time() - record.stat().st_mtime > _ORPHAN_GRACE_S


def _prune_superseded(build_dir: Path, origin: dict[str, str]) -> None:
    """Remove the other folders built for ``origin`` (builds of this checkout's earlier sources
    for this torch install, which nothing loads again; a process that loaded one keeps its
    mapping), and those of a deleted virtualenv or checkout, unloaded for a week. A folder whose
    lock is held (a build under way) is left."""
    import fcntl

    for other in sorted(build_dir.parent.iterdir()):
        if other == build_dir or not other.is_dir():
            continue
        try:
            record = other / _ORIGIN
            theirs = json.loads(record.read_text())
            if theirs != origin and not (isinstance(theirs, dict) and _orphaned(record, theirs)):
                continue
            with open(other / _stamp.LOCK, "w") as handle:  # held while the folder goes
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(other, ignore_errors=True)
        except (OSError, ValueError):  # unreadable, or its lock held: a build under way there
            continue


def toolchain_missing(ext: Extension | None = None) -> str | None:
    """Why an extension cannot be built here (no compiler, no ninja), or None; builds nothing.
    With ``ext``: None where ``ext`` is built, which loads without either (a serving machine or
    PATH without ninja still runs what ``kv build`` built)."""
    if ext is not None and is_built(ext):
        return None
    from torch.utils import cpp_extension

    try:
        with _compiler_env():
            cpp_extension.verify_ninja_availability()
    except RuntimeError as exc:
        return f"cannot build cpu_native kernel: {str(exc).splitlines()[0]}"
    return None


def _inputs(ext: Extension) -> dict[str, object]:
    """What a build of ``ext`` is made from, as its stamp records it and a load compares: the
    sources' content (in full: the folder's name holds 16 hex digits of a hash), torch's version
    and the origin (flags, $CXX, torch's and the sources' folders, Python, machine)."""
    import torch

    return {"sources_sha256": _hash_sources(ext).hexdigest(), "torch_version": str(torch.__version__),
            "origin": _origin(ext)}


def is_built(ext: Extension) -> bool:
    """Whether loading is quick: loaded already, or a complete build for these sources, flags
    and torch is on disk (its stamp matches). Runs neither ninja nor the compiler."""
    name, build_dir = _name_and_dir(ext)
    return str(build_dir / f"{name}.so") in _imported or _stamp.stamped(build_dir, name, _inputs(ext))


# A build's .so path -> its module. Two threads may both import it the first time: CPython hands
# the second the module the first initialised, and no lock held here waits on the folder's lock.
_imported: dict[str, ModuleType] = {}


def _load_stamped(name: str, build_dir: Path, inputs: dict[str, object], *, locked: bool) -> ModuleType | None:
    """The complete build in ``build_dir`` imported, or None where there is none. ``locked``:
    the caller holds the folder's lock (exclusively: a shared one would wait on it)."""
    so = build_dir / f"{name}.so"
    if str(so) in _imported:
        return _imported[str(so)]
    if not _stamp.stamped(build_dir, name, inputs):
        return None
    with contextlib.nullcontext() if locked else _stamp.shared_lock(build_dir):
        if not _stamp.stamped(build_dir, name, inputs):  # pruned or rebuilt while this waited
            return None
        module = _imported.setdefault(str(so), _stamp.import_so(name, so))
    with contextlib.suppress(OSError):
        os.utime(build_dir / _ORIGIN)  # the record's age is the time since a load (_orphaned)
    return module


def load_built(ext: Extension) -> ModuleType | None:
    """The complete build of ``ext`` for these sources, flags and torch, imported from its shared
    object; None where there is none. Never builds: runs neither ninja nor the compiler. Raises
    ImportError or OSError where the build does not import."""
    name, build_dir = _name_and_dir(ext)
    return _load_stamped(name, build_dir, _inputs(ext), locked=False)


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One builder at a time, held by an OS lock that dies with its process.

    cpp_extension's own baton is a plain ``lock`` file that a killed build leaves behind, and
    the next process waits on it forever. Whoever holds this lock is the only builder, so a
    ``lock`` file found while holding it is such a leftover and is removed.
    """
    import fcntl

    with open(build_dir / _stamp.LOCK, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if this process dies
        with contextlib.suppress(FileNotFoundError):
            (build_dir / "lock").unlink()
        yield


@contextlib.contextmanager
def _notice(build_dir: Path, ext: Extension) -> Iterator[None]:
    """One line before a build and a heartbeat while it runs, on stderr: a first call that
    compiles for a minute must not look like a hung process."""
    import threading

    start = time.monotonic()
    print(f"kernel_variants: building the cpu_native {ext.what} ({len(ext.sources)} files) in "
          f"{build_dir}; "
          "this takes about a minute, once per machine and torch install "
          "(`kv build` does it ahead of time)", file=sys.stderr, flush=True)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(15):
            print(f"kernel_variants: still building cpu_native {ext.name} ({time.monotonic() - start:.0f} s)",
                  file=sys.stderr, flush=True)

    ticker = threading.Thread(target=beat, name="kv-build-notice", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        print(f"kernel_variants: cpu_native {ext.name} build finished in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)


@functools.cache
def load_extension(ext: Extension) -> ModuleType:
    """Import the extension: its complete build where there is one (no ninja, no compiler), else
    compiled now (once per source, flags and torch install), announced on stderr.

    Raises RuntimeError with a one-line reason (plus the build log tail) if
    the toolchain is missing, the build fails or a complete build does not import.
    """
    name, build_dir = _name_and_dir(ext)
    inputs = _inputs(ext)
    return _load_or_none(ext, name, build_dir, inputs, locked=False) or _build_and_load(ext, name, build_dir, inputs)


def _load_or_none(ext: Extension, name: str, build_dir: Path, inputs: dict[str, object], *, locked: bool
                  ) -> ModuleType | None:
    try:
        return _load_stamped(name, build_dir, inputs, locked=locked)
    except (ImportError, OSError) as exc:  # stamped, yet it does not import (a torch changed in place)
        raise RuntimeError(f"cpu_native {ext.name}: the build in {build_dir} does not load "
                           f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                           "remove that folder and run kv build") from exc


def _build_and_load(ext: Extension, name: str, build_dir: Path, inputs: dict[str, object]) -> ModuleType:
    from torch.utils import cpp_extension

    with _compiler_env():
        try:
            cpp_extension.verify_ninja_availability()
        except RuntimeError as exc:
            raise RuntimeError(f"cannot build cpu_native kernel: ninja not available ({exc})") from exc
        build_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(build_dir):
            built = _load_or_none(ext, name, build_dir, inputs, locked=True)  # made by one this waited for
            if built is not None:
                return built
            with contextlib.suppress(FileNotFoundError):
                (build_dir / _stamp.STAMP).unlink()  # ninja may rewrite the .so: nothing may load it meanwhile
            with _notice(build_dir, ext):
                try:
                    module = cpp_extension.load(
                        name=name,
                        sources=[str(ext.csrc / s) for s in ext.sources],
                        extra_cflags=list(_CFLAGS),
                        extra_include_paths=[str(ext.csrc)],
                        build_directory=str(build_dir),
                        verbose=False,
                    )
                except (RuntimeError, OSError, ImportError) as exc:
                    first, log = _log_summary(str(exc))
                    head = str(exc).strip().splitlines()[:1]
                    reason = first or ": ".join([type(exc).__name__, *head])
                    raise RuntimeError(
                        f"cpu_native {ext.name} build failed ({reason}) [build dir {build_dir}]\n{log}"
                    ) from exc
            _imported[str(build_dir / f"{name}.so")] = module
            # Each edit of the sources (or upgrade of this package) builds a new folder of a few
            # MB; the ones it supersedes go, so that the cache does not grow with every version.
            origin = _origin(ext)
            with contextlib.suppress(OSError):
                (build_dir / _ORIGIN).write_text(json.dumps(origin, sort_keys=True) + "\n")
                _prune_superseded(build_dir, origin)
            # Sources edited while they compiled make a build of neither version: not stamped, so
            # no later process loads it as the build of what its folder's name says.
            if _hash_sources(ext).hexdigest() == inputs["sources_sha256"]:
                with contextlib.suppress(OSError):  # unstamped, it is built again (by ninja) next time
                    _stamp.write_stamp(build_dir, name, inputs)
            return module


def build(ext: Extension) -> str:
    """Build (or load) the extension now; returns where it lives."""
    return str(Path(load_extension(ext).__file__).parent)
