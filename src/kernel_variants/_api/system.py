"""What this installation holds and where: the registered ops, dtype names, sweeps from CSV
files, the device fingerprint and table (:func:`info`), and building what is compiled here
(:func:`build`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernel_variants._registry.case import Sweep, load_sweep_csv
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.dispatcher import dispatcher


def op_specs() -> list[OpSpec]:
    """Every registered op, in registration order (each with its ``name``, ``aliases``, ``axes``,
    ``features`` model, ``sweeps`` and ``default_sweep``)."""
    return dispatcher().registry.ops()


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name of a dtype as tables store it: ``"bf16"``, ``"bfloat16"`` and
    ``torch.bfloat16`` -> ``"bfloat16"``; ``ValueError`` naming the accepted names otherwise."""
    from kernel_variants._dtypes import canonical
    from kernel_variants._dtypes import dtype_name as _name

    return _name(dtype) if isinstance(dtype, torch.dtype) else canonical(dtype)


def read_sweep(path: str | Path, op: str | None = None) -> Sweep:
    """The sweep of a CSV file with a column per axis of ``op`` (default: the first registered
    op; an axis may go by one of its aliases, ``dim`` for ``D``), named after the file."""
    registry = dispatcher().registry
    return load_sweep_csv(path, registry.spec(op) if op is not None else registry.ops()[0])


@dataclass(frozen=True)
class SystemInfo:
    """What this machine's table is keyed by and where it lives, and what is loaded."""

    version: str  # of kernel_variants
    fingerprint: dict[str, str]  # what the device's measurements are keyed by
    fingerprint_id: str
    cache_dir: str  # the table's directory
    in_memory: bool  # the directory is unusable: the table lives in this process only
    read_only: bool  # its entries are used, new ones stay in memory
    table_entries: int
    call_path: str  # "compiled core", or "Python (why)"
    plugins: list[str]
    broken_plugins: dict[str, str]  # plugin name -> why it was left out
    op_plugins: dict[str, str]  # op name -> the plugin that registered it
    # op name -> variant id -> the code path it runs on this device ("avx512-bf16", "not built"),
    # for the variants whose path is chosen at run time (``Variant.code_path``)
    code_paths: dict[str, dict[str, str]] = field(default_factory=dict)


def info(device: str = "cpu") -> SystemInfo:
    """The fingerprint of ``device``, the table, the ops' call path and the plugins loaded."""
    from kernel_variants._runtime import callcore
    from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
    from kernel_variants._version import __version__

    d = dispatcher()
    fp = fingerprint(str(torch.device(device)))
    table = d.table
    paths: dict[str, dict[str, str]] = {}
    for rv in d.registry.variants():
        if rv.tactic is None and fp["device"] in rv.variant.capabilities.devices:
            path = rv.code_path()
            if path is not None:
                paths.setdefault(rv.op, {})[rv.id] = path
    return SystemInfo(__version__, fp, fingerprint_id(fp), str(table.directory), table.in_memory,
                      table.store.read_only, len(table), callcore.status()[1], d.registry.plugins(),
                      dict(d.registry.broken), {s.name: d.registry.op_plugin(s.name) for s in d.registry.ops()},
                      paths)


@dataclass
class BuildResult:
    """One compiled artefact :func:`build` built (a variant's, serving ``ops``, or the call core)."""

    variant: str  # the variant id, or "call core"
    ops: list[str]
    plugin: str
    ok: bool
    where: str | None  # where the build went
    seconds: float | None
    reason: str | None  # why it was not built, or the build's error
    qualified: int = 0  # classes (dtype, features) it passed on this machine's CPU
    failed: tuple[str, ...] = ()  # "op dtype: failed case" per class it failed


def build() -> list[BuildResult]:
    """Compile every variant built on this machine (one record per extension, however many ops
    it serves) and the ops' compiled call core, then qualify what was built on this machine's CPU
    (:func:`qualify`), so that no call pays for either."""
    from kernel_variants._api.qualification import qualify

    records: list[BuildResult] = []
    seen: dict[object, BuildResult] = {}
    for rv in dispatcher().registry.variants():
        make = rv.variant.build
        if make is None:
            continue
        if make in seen:  # one extension can serve several ops' variants
            seen[make].ops.append(rv.op)
            continue
        seen[make] = record = BuildResult(rv.id, [rv.op], rv.plugin, False, None, None, rv.unavailable_reason())
        records.append(record)
        if record.reason is None:
            _timed_build(record, make)
    built = [r.variant for r in records if r.ok]
    records.append(_call_core())
    verdicts = qualify(variants=built) if built else []
    for r in records[:-1]:
        mine = [v for v in verdicts if v.variant == r.variant and v.group.op in r.ops]
        r.failed = tuple(f"{v.group.op} {v.group.dtype}: {v.failed_case or v.reason}" for v in mine if not v.passed)
        r.qualified = len(mine) - len(r.failed)
    return records


def _call_core() -> BuildResult:
    """The dispatched ops' compiled call path, built like a variant (it runs no kernel: there is
    nothing to qualify)."""
    from kernel_variants._native import build
    from kernel_variants._runtime.core_build import CORE

    record = BuildResult("call core", [spec.name for spec in op_specs()], "kernel_variants", False, None, None,
                         build.toolchain_missing())
    if record.reason is None:
        _timed_build(record, lambda: build.build(CORE))
    return record


def _timed_build(record: BuildResult, make: Any) -> None:
    t0 = time.perf_counter()
    try:
        record.where = make()
        record.ok = True
    except Exception as exc:  # the build's own message is the verdict
        record.reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    record.seconds = round(time.perf_counter() - t0, 1)
