"""The calibration table: per-variant timings per call key, on disk with diskcache, as JSON.

Storage keys hold the device fingerprint, op, feature group, shape and variant id; values are
JSON documents validated on read. Nothing is ever unpickled: a cache directory may be shared,
and unpickling is code execution, so the disk class below refuses every non-raw row.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import ValidationError

from kernel_variants._paths import table_dir
from kernel_variants._policy import Figures, Found, winner_of
from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.spec import Shape
from kernel_variants._table.fingerprint import is_legacy
from kernel_variants._table.ignored import DROPPED_VERDICTS, MINE, Sorter, reasons
from kernel_variants._table.index import (
    SNAPSHOT_PREFIX,
    FastIndex,
    decode,
    document,
    encode,
    index_from,
)
from kernel_variants._table.renames import Mover, Renames, mentions
from kernel_variants._table.rows import (
    DEFAULT_MARGIN,
    SCHEMA,
    VERDICT_PREFIX,
    Group,
    Measurement,
    StaleRow,
    Winner,
    mkey,
    stale_reason,
    wkey,
)
from kernel_variants._table.store import TOKEN_KEY, CalibrationWarning, Store, is_corrupt


class CalibrationTable:
    """Per-variant timings per (device, op, group, shape), kept on disk.

    ``versions`` maps (op, variant id) to the registered variant's full version; measurements of
    another version are stale and ignored (with one warning per load naming them).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else table_dir()
        self._lock = threading.RLock()
        self._store: Store | None = None
        self._fast: dict[str, FastIndex] = {}  # per device fingerprint
        self._warned: set[str] = set()  # fingerprints whose ignored entries this load has named
        self._versions: dict[tuple[str, str], str] = {}
        # While `kv calibrate --stale` re-measures them, stale and legacy rows are not news.
        self.quiet_stale = False
        self.renames: Renames = {}  # retired variant ids -> their tactics (see _table.renames)

    @property
    def store(self) -> Store:
        with self._lock:
            if self._store is None:
                self._store = Store(self.directory)
            return self._store

    def close(self) -> None:
        """Close this thread's connection to the table file (a later read or write opens it
        again)."""
        with self._lock:
            if self._store is not None:
                self._store.close()

    @property
    def in_memory(self) -> bool:
        return self.store.cache is None

    def _guard(self, fn, *args):
        """Run a store operation; a table that turns out corrupt is moved aside (one that is busy
        or unwritable is left alone and the table kept in memory), then the operation retried."""
        try:
            return fn(*args)
        except sqlite3.DatabaseError as exc:
            if is_corrupt(exc):
                self.store.move_aside(exc)
            else:
                self.store.to_memory(exc)
            self.forget()
            return fn(*args)

    # reading

    def _scan(self, fingerprint_id: str) -> tuple[list[Measurement], list[Winner], dict[str, int], list[Measurement]]:
        """Every readable measurement and winner of ``fingerprint_id`` (any version), how many
        rows were ignored and why (``_table/ignored.py: Sorter``), and the legacy measurements of
        this device (written before per-variant versions, or before a CPU's kind was kept: see
        ``_table/fingerprint.py: is_legacy``). This CPU's verdicts of before its kind was kept
        are dropped as they are met (counted under ``DROPPED_VERDICTS``)."""
        ms: list[Measurement] = []
        ws: list[Winner] = []
        legacy: list[Measurement] = []
        counts = {"other_fp": 0, "bad": 0, "legacy": 0, "legacy_cpu": 0, "threads": 0, DROPPED_VERDICTS: 0}
        # Rows of this CPU at another intra-op thread count are told apart because it is the
        # usual reason: a forked child runs one thread (see the package's at-fork handler), so
        # its rows are filed apart from its parent's, not lost.
        sorter = Sorter(fingerprint_id)
        mover = Mover(self.renames)
        for key, raw in self.store.items():
            if key.startswith(VERDICT_PREFIX):
                counts[DROPPED_VERDICTS] += sorter.drop_old_verdict(self.store, key, raw)
                continue
            if key.startswith((TOKEN_KEY, SNAPSHOT_PREFIX)):
                continue  # bookkeeping: not timings
            if raw is None:
                counts["bad"] += 1
                continue
            try:
                if key.startswith(("m|", "w|")) and '"schema_version":1' in raw.replace(" ", ""):
                    key, raw = self._migrate_row(key, raw)
                if key.startswith("m|"):
                    m = mover.measurement(self.store, key, Measurement.model_validate_json(raw))
                    if m is None:
                        continue
                    kind = sorter.sort(m.fingerprint, m.fingerprint_id)
                    if kind == MINE:
                        ms.append(m)
                    else:
                        counts[kind] = counts.get(kind, 0) + 1
                        if kind in ("legacy", "legacy_cpu"):
                            legacy.append(m)
                elif key.startswith("w|"):
                    w = mover.winner(self.store, key, Winner.model_validate_json(raw))
                    if w.fingerprint_id == fingerprint_id:
                        ws.append(w)
                else:
                    counts["bad"] += 1
            except (ValidationError, ValueError):
                counts["bad"] += 1
        mover.warn()
        return ms, ws, counts, legacy

    def _warn_once(self, fingerprint_id: str, counts: dict[str, int], stale: dict[str, tuple[str, str]]) -> None:
        """One warning per load naming what is ignored, whichever path (full or fast) loaded."""
        if fingerprint_id in self._warned:
            return
        self._warned.add(fingerprint_id)
        if self.quiet_stale:
            counts, stale = {**counts, "legacy": 0, "legacy_cpu": 0}, {}
        said, remeasured = reasons(counts, stale)
        if said:
            hint = "; `kv table --stale` lists them, `kv calibrate --stale` re-measures them" if remeasured else ""
            warnings.warn("calibration table: ignoring entries: " + "; ".join(said) + hint, CalibrationWarning,
                          stacklevel=4)

    def _for_versions(self, versions: dict[tuple[str, str], str]) -> None:
        """Read for these registered versions: another set (a plugin loaded or edited since)
        makes everything read so far, and what was warned about, out of date."""
        if versions != self._versions:
            self.forget()
            self._versions = dict(versions)

    def _fast_index(self, versions: dict[tuple[str, str], str], fingerprint_id: str) -> FastIndex:
        """The decision-time view of this device's rows: from the snapshot row when it is current,
        else from a full scan, which then stores a fresh snapshot for the next process."""
        with self._lock:
            self._for_versions(versions)
            fast = self._fast.get(fingerprint_id)
            if fast is None:
                fast = self._fast[fingerprint_id] = self._guard(self._load_fast, fingerprint_id)
            return fast

    def prepare(self, versions: dict[tuple[str, str], str], fingerprint_id: str) -> None:
        """Store a current snapshot now (after a calibration or an import), so that the next
        process's first call reads one row instead of every row."""
        self.forget()
        self._fast_index(versions, fingerprint_id)

    def _load_fast(self, fingerprint_id: str) -> FastIndex:
        token = self.store.get(TOKEN_KEY)
        doc = decode(self.store.get(SNAPSHOT_PREFIX + fingerprint_id), token)
        fast = index_from(doc, self._versions) if doc is not None and not mentions(doc, self.renames) else None
        if fast is None:  # no snapshot, an old one, or a damaged one: from the rows, then stored
            ms, ws, counts, _ = self._scan(fingerprint_id)
            dropped = counts.pop(DROPPED_VERDICTS)  # said once, now: they are gone
            doc = document(ms, ws, counts)
            if token is not None:  # a table that was never written has nothing worth a snapshot
                with contextlib.suppress(OSError, sqlite3.Error):
                    self.store.set(SNAPSHOT_PREFIX + fingerprint_id, encode(token, doc))
            fast = index_from(doc, self._versions)
            assert fast is not None, "a snapshot made here must read back"
            if dropped:
                fast.counts = {**fast.counts, DROPPED_VERDICTS: dropped}
        self._warn_once(fingerprint_id, fast.counts, fast.stale)
        return fast

    def _migrate_row(self, key: str, raw: str) -> tuple[str, str]:
        """A schema-1 row, rewritten under its schema-2 key (the group's slug changed); the old
        row goes, so two schemas never mix. A read-only table migrates in memory only."""
        row: Measurement | Winner = (Measurement if key.startswith("m|") else Winner).model_validate_json(raw)
        row = row.model_copy(update={"schema_version": SCHEMA})
        new_key, new_raw = row.storage_key(), row.model_dump_json()
        with contextlib.suppress(OSError, sqlite3.Error):
            existing = self.store.get(new_key)
            if existing is None:
                self.store.set(new_key, new_raw)
            else:  # written by this release already: that row is newer
                new_raw = existing
            self.store.delete(key)
        return new_key, new_raw

    def figures(self, key: CallKey, fingerprint_id: str, candidates: Iterable[str],
                versions: dict[tuple[str, str], str]) -> Figures | None:
        """The figures for ``key`` among ``candidates`` at its own shape, else at the nearest
        calibrated shape (log space) of its group where a candidate was measured (which counts
        is the decision's rule, ``_policy.choose``). None when no candidate has a figure."""
        group = self._fast_index(versions, fingerprint_id).groups.get(Group.of(key).slug())
        if group is None:
            return None
        allowed = set(candidates)

        def found(source: str, shape: Shape) -> Found | None:
            times = {v: t for v, t in group.times.get(shape, {}).items() if v in allowed}
            if not times:
                return None
            pruned = {v: b for v, b in group.pruned.get(shape, {}).items() if v in allowed}
            return Found(times, group.winners.get(shape), source, shape,
                         group.rejected.get(shape, set()) & allowed, pruned)

        here = found("table", key.shape)
        if here is not None:  # the nearest is this shape: no search
            return Figures(here, None)
        at = group.nearest(key.shape, allowed)
        return None if at is None else Figures(None, found("nearest", at))

    def measurements(self, versions: dict[tuple[str, str], str], fingerprint_id: str):
        """Every current measurement and winner of this device: ((group, shape) -> {id: m}, winners)."""
        with self._lock:
            self._for_versions(versions)
        ms, ws, counts, _ = self._guard(self._scan, fingerprint_id)
        rows: dict[tuple[Group, Shape], dict[str, Measurement]] = {}
        stale: dict[str, tuple[str, str]] = {}
        for m in ms:
            current = versions.get((m.group.op, m.variant))
            if current is not None and current != m.version:
                stale[m.variant] = (m.version, current)
            elif current is not None:  # (a plugin not loaded now: its rows stay for when it is)
                rows.setdefault((m.group, m.shape), {})[m.variant] = m
        self._warn_once(fingerprint_id, counts, stale)
        return rows, {(w.group, w.shape): w for w in ws}

    def stale(self, versions: dict[tuple[str, str], str], deps: Mapping[tuple[str, str], dict[str, str]],
              fingerprint_id: str, sources: Mapping[tuple[str, str], str] | None = None) -> list[StaleRow]:
        """This device's measurements that no longer match the registered variant's version
        (its source, declared version or a dependency changed), and rows of this device written
        by an earlier release, unless since re-measured. Variants not registered now are left out."""
        ms, _, _, legacy = self._guard(self._scan, fingerprint_id)
        current = {m.storage_key() for m in ms if versions.get((m.group.op, m.variant)) == m.version}
        out = []
        for m in [*ms, *legacy]:
            now = versions.get((m.group.op, m.variant))
            old = is_legacy(m.fingerprint)
            if now is None or (now == m.version and not old):
                continue
            if old and mkey(fingerprint_id, m.group, m.shape, m.variant) in current:
                continue  # measured again since: the old row is only clutter
            out.append(StaleRow(m.group, m.shape, m.variant, m.version, now,
                                stale_reason(m, deps.get((m.group.op, m.variant), {}),
                                             (sources or {}).get((m.group.op, m.variant), "")), old, m.measured_at,
                                m.storage_key(), wkey(m.fingerprint_id, m.group, m.shape)))
        return sorted(out, key=lambda r: (r.group.slug(), r.shape, r.variant))

    def drop(self, keys: Iterable[str]) -> int:
        """Delete rows by storage key (legacy rows once re-measured); returns how many there were."""
        n = 0
        with self._lock, self.store.transaction():
            for key in dict.fromkeys(keys):
                if self.store.get(key) is not None:
                    self.store.delete(key)
                    n += 1
        self.forget()
        return n

    # writing

    def record(self, m: Measurement) -> None:
        self._guard(self.store.set, m.storage_key(), m.model_dump_json())
        self.forget()

    def decide_winner(self, fingerprint_id: str, group: Group, shape: Shape, versions: dict[tuple[str, str], str],
                      margin: float) -> Winner | None:
        """Re-decide one shape's winner from its current measurements, atomically across processes.

        The fastest figure wins a shape that has no winner yet. A recorded winner keeps it unless
        a challenger leads it by more than ``margin`` and by more than the two figures' combined
        noise (a pruned variant counts with its first-round figure: measured, and slower)."""
        with self._lock, self.store.transaction():
            timed: dict[str, Measurement] = {}
            for (op, vid), version in versions.items():
                if op != group.op:
                    continue
                raw = self.store.get(mkey(fingerprint_id, group, shape, vid))
                if raw is None:
                    continue
                try:
                    m = Measurement.model_validate_json(raw)
                except ValidationError:
                    continue
                if m.version == version and m.timed:
                    timed[vid] = m
            slot = wkey(fingerprint_id, group, shape)
            if not timed:
                self.store.delete(slot)
                self.forget()
                return None
            raw = self.store.get(slot)
            current = None
            if raw is not None:
                with contextlib.suppress(ValidationError):
                    current = Winner.model_validate_json(raw).variant
            r = winner_of({v: (m.best_us, m.noise) for v, m in timed.items()}, current, margin)
            w = Winner(fingerprint_id=fingerprint_id, group=group, shape=shape, variant=r.winner,
                       best_us=timed[r.winner].best_us, runner_up=r.runner_up, lead=r.lead, noise=r.noise,
                       confidence=r.confidence, decided_at=time.time())
            self.store.set(slot, w.model_dump_json())
        self.forget()
        return w

    def store_results(self, measurements: Iterable[Measurement], versions: dict[tuple[str, str], str],
                      margin: float) -> dict[Shape, Winner | None]:
        """Record ``measurements`` and re-decide the winner of every shape they cover."""
        shapes: dict[tuple[str, Group, Shape], None] = {}
        for m in measurements:
            self.record(m)
            shapes[(m.fingerprint_id, m.group, m.shape)] = None
        return {shape: self.decide_winner(fp, group, shape, versions, margin) for fp, group, shape in shapes}

    def clear(self, op: str | None = None, variant: str | None = None,
              versions: dict[tuple[str, str], str] | None = None, margin: float = DEFAULT_MARGIN) -> int:
        """Delete measurements (and winners) of ``op``, or of ``variant`` only; returns how many
        measurements went. Shapes whose winner was ``variant`` are re-decided from what is left
        when ``versions`` is given (else their winner is dropped)."""
        n = 0
        redecide: list[Winner] = []
        with self._lock:
            for key, raw in list(self.store.items()):
                parts = key.split("|")
                if len(parts) < 3 or parts[0] not in ("m", "w") or (op is not None and parts[2] != op):
                    continue
                if parts[0] == "m" and variant is not None and parts[-1] != variant:
                    continue
                if parts[0] == "w" and variant is not None:
                    try:
                        w = Winner.model_validate_json(raw or "")
                    except ValidationError:
                        w = None
                    if w is not None and w.variant != variant:
                        continue
                    if w is not None:
                        redecide.append(w)
                self.store.delete(key)
                n += parts[0] == "m"
        self.forget()
        if versions is not None:
            for w in redecide:
                self.decide_winner(w.fingerprint_id, w.group, w.shape, versions, margin)
        return n

    def forget(self) -> None:
        """Drop the in-memory index: the next read sees what other processes or imports wrote."""
        self._fast.clear()
        self._warned.clear()

    def __len__(self) -> int:
        return len(self.store)
