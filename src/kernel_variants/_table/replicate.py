"""Rows between the processes of one job (ranks of the same fingerprint): one shape's rows,
sent whole, so that every rank decides that shape alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from pydantic import ValidationError

from kernel_variants._registry.keys import Shape
from kernel_variants._table.rows import Group, Measurement, Winner, mkey, wkey
from kernel_variants._table.table import CalibrationTable


def rows_at(table: CalibrationTable, fingerprint_id: str, group: Group, shape: Shape, versions: dict[tuple[str, str], str]) -> list[str]:
    """The JSON rows of one shape (its current measurements, then its winner), for another
    process to ``ingest``."""
    out = []
    for (op, vid), version in versions.items():
        if op != group.op:
            continue
        raw = table.store.get(mkey(fingerprint_id, group, shape, vid))
        with contextlib.suppress(ValidationError):
            if raw is not None and Measurement.model_validate_json(raw).version == version:
                out.append(raw)
    raw = table.store.get(wkey(fingerprint_id, group, shape))
    if raw is not None:
        out.append(raw)
    return out


def ingest(table: CalibrationTable, rows: Iterable[str]) -> int:
    """Write rows another process of the same fingerprint sent (``rows_at``): a measurement
    where it is newer than the local one, a winner as it is (so that both decide alike).
    Returns how many were written; a row that does not validate is skipped."""
    n = 0
    with table._lock, table.store.transaction():
        for raw in rows:
            try:
                row: Measurement | Winner = (Measurement if '"measured_at"' in raw else Winner).model_validate_json(raw)
            except ValidationError:
                continue
            if isinstance(row, Measurement):
                mine = table.store.get(row.storage_key())
                with contextlib.suppress(ValidationError):
                    if mine is not None and Measurement.model_validate_json(mine).measured_at >= row.measured_at:
                        continue
            table.store.set(row.storage_key(), row.model_dump_json())
            n += 1
    table.forget()
    return n
