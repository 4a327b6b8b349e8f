"""Selecting a variant per call: pure selection (``select``) and the process-wide dispatcher."""

from ._dispatcher import Dispatcher, VariantFailed, dispatcher, force, parse_force, reset
from ._select import Decision, NoVariantError, TraceRow, select, uncovered

__all__ = [
    "Decision",
    "Dispatcher",
    "NoVariantError",
    "TraceRow",
    "VariantFailed",
    "dispatcher",
    "force",
    "parse_force",
    "reset",
    "select",
    "uncovered",
]
