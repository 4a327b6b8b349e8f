"""Rows kept under a variant id that a tactic now replaces (``Variant.replaces``: the per-config
``triton_d32_t64`` became the tactic ``triton:d32_t64``).

Such a row is never read as it is (no registered candidate has its name, so it would silently
vanish) nor under another meaning: the table's full read moves it to its new name on disk, a
measurement under its new key (unless one was written there already: that one is newer), a
winner in place, and one :class:`CalibrationWarning` names what moved. A snapshot that still
holds an old name is rebuilt from the rows, so the move happens on the first read after an
upgrade. A moved row keeps its version: when the code changed with the rename it is stale
(``kv calibrate --stale`` re-measures it), else it is current under its new name.
"""

from __future__ import annotations

import contextlib
import sqlite3
import warnings
from collections.abc import Mapping
from typing import Any

from kernel_variants._table.rows import Measurement, Winner
from kernel_variants._table.store import CalibrationWarning, Store

Renames = Mapping[tuple[str, str], str]  # (op, old variant id) -> "variant:tactic"


def mentions(doc: dict[str, Any], renames: Renames) -> bool:
    """Whether a snapshot document holds a figure or a winner under an old name."""
    if not renames:
        return False
    try:
        for slug, g in doc["groups"].items():
            op = slug.split("|", 1)[0]
            names = [tag.split("\n", 1)[0] for tag in g["variants"]] + [w for w in g["winners"] if isinstance(w, str)]
            if any((op, name) in renames for name in names):
                return True
    except (KeyError, TypeError, AttributeError):
        return True  # malformed: rebuilt from the rows anyway
    return False


class Mover:
    """Moves rows of old names as a full read meets them, and warns once per read naming them."""

    def __init__(self, renames: Renames) -> None:
        self.renames = dict(renames)
        self.moved: dict[str, str] = {}

    def measurement(self, store: Store, key: str, m: Measurement) -> Measurement | None:
        """``m`` under its new name (moved on disk), ``m`` itself when its name is current, or
        None when a row of the new name exists already (the full read meets that one too)."""
        new = self.renames.get((m.group.op, m.variant))
        if new is None:
            return m
        self.moved[m.variant] = new
        moved = m.model_copy(update={"variant": new})
        with contextlib.suppress(OSError, sqlite3.Error):
            exists = store.get(moved.storage_key()) is not None
            if not exists:
                store.set(moved.storage_key(), moved.model_dump_json())
            store.delete(key)
            if exists:
                return None
        return moved

    def winner(self, store: Store, key: str, w: Winner) -> Winner:
        new, runner = (self.renames.get((w.group.op, v)) if v else None for v in (w.variant, w.runner_up))
        if new is None and runner is None:
            return w
        for old, now in ((w.variant, new), (w.runner_up, runner)):
            if now is not None and old is not None:
                self.moved[old] = now
        moved = w.model_copy(update={"variant": new or w.variant, "runner_up": runner or w.runner_up})
        with contextlib.suppress(OSError, sqlite3.Error):
            store.set(key, moved.model_dump_json())
        return moved

    def warn(self) -> None:
        if self.moved:
            names = ", ".join(f"{old} -> {new}" for old, new in sorted(self.moved.items()))
            warnings.warn(f"calibration table: rows of retired variant ids moved to the tactics that replace "
                          f"them: {names} (re-measure them with kv calibrate --stale if their code changed)",
                          CalibrationWarning, stacklevel=5)
            self.moved = {}
