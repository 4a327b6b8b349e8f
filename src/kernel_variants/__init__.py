"""kernel_variants: several implementations of one kernel side by side, each call going to the
variant measured fastest for its shape on this device.

Public API: the ops (:func:`causal_conv1d_fn`, :func:`causal_conv1d_update`), inspection
(:func:`variants`, :func:`explain`), pinning (:func:`force`), and for plugin authors the
:mod:`kernel_variants.registry` module.
"""

from __future__ import annotations

# The subpackage kernel_variants/variants/ shares its name with the variants() function below.
# Importing it first means the function, defined afterwards, is what the package attribute holds;
# the subpackage stays reachable as a module (``from kernel_variants.variants import reference``).
import kernel_variants.variants as _variants_pkg  # noqa: F401
from kernel_variants._version import __version__
from kernel_variants.dispatch import Decision, NoVariantError, VariantFailed, force
from kernel_variants.dispatch import reset as _reset
from kernel_variants.dispatch._api import TableRow, calibrate, clear_table, table
from kernel_variants.dispatch._calibrate import CalibrationResult, Progress
from kernel_variants.dispatch._table import CalibrationWarning, Measurement
from kernel_variants.dispatch._dispatcher import dispatcher as _dispatcher
from kernel_variants.ops import causal_conv1d_fn, causal_conv1d_update, explain
from kernel_variants.registry import Capabilities, Variant, hookimpl
from kernel_variants.registry._models import OpName
from kernel_variants.registry._registry import DuplicateVariantError, RegisteredVariant


def variants(op: OpName | None = None) -> list[RegisteredVariant]:
    """Every registered variant (of ``op``, if given), with its plugin, full version and probe."""
    return _dispatcher().registry.variants(op)


def reload() -> None:
    """Re-read plugins and the KV_* environment variables, forgetting in-process decisions."""
    _reset()


__all__ = [
    "CalibrationResult",
    "CalibrationWarning",
    "Capabilities",
    "Measurement",
    "Progress",
    "TableRow",
    "calibrate",
    "clear_table",
    "table",
    "Decision",
    "DuplicateVariantError",
    "NoVariantError",
    "RegisteredVariant",
    "Variant",
    "VariantFailed",
    "__version__",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "explain",
    "force",
    "hookimpl",
    "reload",
    "variants",
]
