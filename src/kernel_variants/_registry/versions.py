"""A variant's full version: its declared version, its source's hash and the versions of the
dependencies it declares (torch, triton, the CANN toolkit, the compiler, the CPU's ISA), so that
a table row measured with other code or another stack is told stale, and only that row."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from kernel_variants._registry.models import Variant


def _source_hash(variant: Variant, plugin: str, deps: Mapping[str, str] | None = None) -> str:
    """The variant's source files' hash, with its dependencies' versions folded in when given."""
    h = hashlib.sha256()
    own = inspect.getsourcefile(variant.fn)
    if own is not None:
        h.update(Path(own).read_bytes())
    # else a builtin or C function: no source to read, the declared version must do
    here = Path(own).parent if own is not None else Path.cwd()
    for p in variant.sources:
        path = here / p  # relative paths are relative to the variant's module, not the cwd
        try:
            h.update(path.read_bytes())
        except OSError as exc:
            raise ValueError(
                f"plugin {plugin!r}: variant {variant.id!r} declares source {p!r}, which cannot be read "
                f"({exc.strerror or exc}); its version would not follow its code"
            ) from None
    if deps:
        h.update(json.dumps(dict(deps), sort_keys=True).encode())
    return h.hexdigest()[:10]


DEFAULT_DEPENDS: tuple[str, ...] = ("torch",)
_TRITON_DISTS = ("triton", "pytorch-triton", "pytorch-triton-rocm")
ABSENT = "absent"


def _dist(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken metadata directory: the name's version cannot be told
            return "unknown"
    return ABSENT


def _cann() -> str:
    home = os.environ.get("ASCEND_TOOLKIT_HOME", "")
    if not home:
        return ABSENT
    try:
        with open(os.path.join(home, "version.cfg"), encoding="utf-8") as f:
            words = f.read().split()
    except OSError:
        return "unknown"
    return words[0] if words else "unknown"


def _compiler() -> str:
    cxx = (os.environ.get("CXX") or "").split()
    exe = cxx[0] if cxx else next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if exe is None or shutil.which(exe) is None:
        return ABSENT
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    first = (out.stdout or out.stderr).strip().splitlines()
    return first[0][:200] if first else "unknown"


def _isa() -> str:
    import torch  # only variants that declare "isa" (a CPU kernel) ask, and they import torch anyway

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old torch without the query
        return "unknown"


_NAMED: dict[str, Callable[[], str]] = {
    "triton": lambda: _dist(*_TRITON_DISTS),
    "cann": _cann,
    "compiler": _compiler,
    "isa": _isa,
    "python": platform.python_version,
}


@functools.cache
def dependency_version(name: str) -> str:
    """The installed version of one declared dependency (see ``DEPENDS_HELP`` in _registry/models.py), read
    once per process."""
    resolve = _NAMED.get(name)
    return resolve() if resolve is not None else _dist(name)


def resolve_depends(variant: Variant, plugin: str) -> dict[str, str]:
    """``variant``'s declared dependencies with their versions now, sorted by name."""
    declared = DEFAULT_DEPENDS if variant.depends is None else variant.depends
    if callable(declared):
        try:
            got = declared()
        except Exception as exc:
            raise ValueError(f"plugin {plugin!r}: variant {variant.id!r}: depends() raised "
                             f"{type(exc).__name__}: {exc}") from None
        if not isinstance(got, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and k and len(k) <= 100
                                                   and len(v) <= 200 for k, v in got.items()):
            raise ValueError(f"plugin {plugin!r}: variant {variant.id!r}: depends() must return a mapping of "
                             f"names to version strings, got {got!r:.200}")
        return dict(sorted(got.items()))
    return {name: dependency_version(name) for name in sorted(set(declared))}


def full_version(variant: Variant, plugin: str, deps: Mapping[str, str]) -> str:
    """The declared version and one hash of the variant's source and its dependencies'
    versions: what its stored timings are valid for."""
    return f"{variant.version}+{_source_hash(variant, plugin, deps)}"


def source_version(variant: Variant, plugin: str) -> str:
    """The version as releases before per-variant dependencies wrote it (declared version and
    source hash only): how a legacy row tells whether the kernel's code has changed since."""
    return f"{variant.version}+{_source_hash(variant, plugin)}"
