"""Selecting a variant per call: pure selection (``select``), the process-wide dispatcher, and
``make_op``, which turns an op spec into its dispatched public function."""

from ._dispatcher import Dispatcher, VariantFailed, dispatcher, force, parse_force, reset
from ._op import call_key, explain, make_op
from ._select import Decision, NoVariantError, TraceRow, select

__all__ = [
    "Decision",
    "Dispatcher",
    "NoVariantError",
    "TraceRow",
    "VariantFailed",
    "call_key",
    "dispatcher",
    "explain",
    "force",
    "make_op",
    "parse_force",
    "reset",
    "select",
]
