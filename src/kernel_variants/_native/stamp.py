"""A build folder's stamp, and a complete build imported from its shared object.

A build writes the stamp last, once its shared object is complete: what the build was made from
(the sources' content, torch's version, flags, $CXX, torch's and the sources' folders) and the
shared object it made (size and modification time). A load compares the stamp with the inputs it
would build from and imports the shared object directly, without asking ninja whether the build
is current: ninja's answer depends on which ninja a process finds first on its PATH (two
releases read each other's records as stale and recompile).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

#: Each build folder's OS lock: held exclusively by its builder and by a prune removing it, shared
#: while its build is imported.
LOCK = "kv-build.lock"

#: Written in a build folder once its build is complete (atomically: a reader sees all of it or
#: none): what it was built from, and the shared object it made.
STAMP = "kv-stamp.json"


def _so_record(so: Path) -> dict[str, object]:
    st = so.stat()
    return {"file": so.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def stamped(build_dir: Path, name: str, inputs: dict[str, object]) -> bool:
    """Whether ``build_dir`` holds a complete build of ``inputs``: its stamp names them, and the
    shared object is still the one that build made (one rewritten since, by a build that did
    not stamp it, may be half-written)."""
    try:
        stamp = json.loads((build_dir / STAMP).read_text())
        so = _so_record(build_dir / f"{name}.so")
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp.get("inputs") == inputs and stamp.get("so") == so


def _compiler() -> str:
    """The compiler's first line of ``--version``: recorded to say what made a build, not compared
    on load, since which ``c++`` a process finds depends on its PATH (the very thing that differs
    between the processes sharing a build)."""
    cxx = (os.environ.get("CXX") or "c++").split()
    try:
        done = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cxx[0]} ({type(exc).__name__})"
    return (done.stdout.strip().splitlines() or [cxx[0]])[0]


def write_stamp(build_dir: Path, name: str, inputs: dict[str, object]) -> None:
    stamp = {"inputs": inputs, "so": _so_record(build_dir / f"{name}.so"), "compiler": _compiler(),
             "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    part = build_dir / f"{STAMP}.{os.getpid()}.part"
    part.write_text(json.dumps(stamp, sort_keys=True, indent=1) + "\n")
    os.replace(part, build_dir / STAMP)


def import_so(name: str, so: Path) -> ModuleType:
    """The built shared object imported as the module its build named (``PyInit_<name>``), as
    cpp_extension itself imports it after a build."""
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"{so} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def shared_lock(build_dir: Path) -> Iterator[None]:
    """The folder's lock held shared while its build is imported: a builder or a prune (each
    holds it exclusively) waits, or passes the folder by. Opened read-only, so that a cache this
    process cannot write still serves."""
    import fcntl

    try:
        fd = os.open(build_dir / LOCK, os.O_RDONLY)
    except FileNotFoundError:  # every build makes it before stamping: someone removed it
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock
