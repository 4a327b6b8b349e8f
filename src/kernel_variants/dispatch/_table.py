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
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kernel_variants._paths import table_dir
from kernel_variants.registry import CallKey
from kernel_variants.registry._models import DTypeName
from kernel_variants.registry._spec import Shape

from ._fastindex import SNAPSHOT_PREFIX, TOKEN_KEY, FastIndex, decode, document, encode, index_from
from ._store import CalibrationWarning, HostileRow, JSONOnlyDisk, Store, is_corrupt

__all__ = ["CalibrationTable", "CalibrationWarning", "Group", "HostileRow", "JSONOnlyDisk", "Measurement",
           "Winner", "is_corrupt"]

# 2: a group is (op, dtype, the op's own feature flags); rows of 1 (causal_conv1d's fields
# inline) are migrated when the table loads.
SCHEMA = 2
# A challenger must be this much faster to take a shape from its winner: noise on a shared
# machine is a few percent, and choices that flip back and forth help nobody.
DEFAULT_MARGIN = 0.02
FeatureValue = bool | int | float | str


def check_margin(margin: float) -> float:
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError(f"margin: expected a fraction in [0, 1), got {margin!r}")
    return float(margin)


class Group(BaseModel):
    """The part of a call key other than the shape: timings are compared only within a group.

    ``features`` are the op's own flags as sorted (name, value) pairs, so that a group is the
    same whatever order an op declares them in.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    dtype: DTypeName
    features: tuple[tuple[str, FeatureValue], ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: object) -> object:
        """Schema 1 stored causal_conv1d's flags as fields of the group itself."""
        if isinstance(data, dict) and "features" not in data:
            flags = {k: v for k, v in data.items() if k not in ("op", "dtype")}
            data = {"op": data.get("op"), "dtype": data.get("dtype"), "features": flags}
        if isinstance(data, dict) and isinstance(data.get("features"), dict):
            data = {**data, "features": tuple(sorted(data["features"].items()))}
        elif isinstance(data, dict) and data.get("features") is not None:
            data = {**data, "features": tuple(sorted(tuple(p) for p in data["features"]))}
        return data

    @classmethod
    def of(cls, key: CallKey) -> Group:
        return cls(op=key.op, dtype=key.dtype, features=key.features.model_dump())

    def flags(self) -> dict[str, FeatureValue]:
        return dict(self.features)

    def slug(self) -> str:
        flags = ",".join(f"{k}={v}" for k, v in self.features)
        return f"{self.op}|{self.dtype}|{flags or '-'}"


class Measurement(BaseModel):
    """One variant timed (or rejected) on one shape of one group on one device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2] = SCHEMA
    fingerprint: dict[str, str]
    fingerprint_id: str
    group: Group
    shape: Shape
    variant: str
    version: str
    status: Literal["ok", "rejected"]
    reason: str = ""
    best_us: float | None = None
    median_us: float | None = None
    spread: float | None = None
    windows: int = 0
    iters: int = 0
    method: str = ""
    measured_at: float

    def storage_key(self) -> str:
        return _mkey(self.fingerprint_id, self.group, self.shape, self.variant)


class Winner(BaseModel):
    """The variant a shape goes to; it keeps the shape until a challenger beats it by the margin."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2] = SCHEMA
    fingerprint_id: str
    group: Group
    shape: Shape
    variant: str
    best_us: float
    decided_at: float

    def storage_key(self) -> str:
        return _wkey(self.fingerprint_id, self.group, self.shape)


def _mkey(fp: str, group: Group, shape: Shape, variant: str) -> str:
    return f"m|{fp}|{group.slug()}|{','.join(map(str, shape))}|{variant}"


def _wkey(fp: str, group: Group, shape: Shape) -> str:
    return f"w|{fp}|{group.slug()}|{','.join(map(str, shape))}"


class _Index:
    """The usable part of the table, in memory: current measurements and winners by group."""

    def __init__(self) -> None:
        self.shapes: dict[tuple[str, Group], dict[Shape, dict[str, Measurement]]] = {}
        self.winners: dict[tuple[str, Group, Shape], Winner] = {}


class CalibrationTable:
    """Per-variant timings per (device, op, group, shape), kept on disk.

    ``versions`` maps (op, variant id) to the registered variant's full version; measurements of
    another version are stale and ignored (with one warning per load naming them).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else table_dir()
        self._lock = threading.RLock()
        self._store: Store | None = None
        self._index: dict[str, _Index] = {}  # per device fingerprint
        self._fast: dict[str, FastIndex] = {}  # per device fingerprint
        self._warned: set[str] = set()  # fingerprints whose ignored entries this load has named
        self._versions: dict[tuple[str, str], str] = {}

    @property
    def store(self) -> Store:
        with self._lock:
            if self._store is None:
                self._store = Store(self.directory)
            return self._store

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

    def load(self, versions: dict[tuple[str, str], str], fingerprint_id: str) -> _Index:
        with self._lock:
            if versions != self._versions:
                self.forget()
                self._versions = dict(versions)
            index = self._index.get(fingerprint_id)
            if index is None:
                index = self._index[fingerprint_id] = self._guard(self._build_index, fingerprint_id)
            return index

    def _scan(self, fingerprint_id: str) -> tuple[list[Measurement], list[Winner], dict[str, int]]:
        """Every readable measurement and winner of ``fingerprint_id`` (any version), and how many
        rows were of other fingerprints or unreadable."""
        ms: list[Measurement] = []
        ws: list[Winner] = []
        counts = {"other_fp": 0, "bad": 0}
        for key, raw in self.store.items():
            if key.startswith((TOKEN_KEY, SNAPSHOT_PREFIX)):
                continue
            if raw is None:
                counts["bad"] += 1
                continue
            try:
                if key.startswith(("m|", "w|")) and '"schema_version":1' in raw.replace(" ", ""):
                    key, raw = self._migrate_row(key, raw)
                if key.startswith("m|"):
                    m = Measurement.model_validate_json(raw)
                    if m.fingerprint_id != fingerprint_id:
                        counts["other_fp"] += 1
                    else:
                        ms.append(m)
                elif key.startswith("w|"):
                    w = Winner.model_validate_json(raw)
                    if w.fingerprint_id == fingerprint_id:
                        ws.append(w)
                else:
                    counts["bad"] += 1
            except (ValidationError, ValueError):
                counts["bad"] += 1
        return ms, ws, counts

    def _warn_once(self, fingerprint_id: str, counts: dict[str, int], stale: dict[str, tuple[str, str]]) -> None:
        """One warning per load naming what is ignored, whichever path (full or fast) loaded."""
        if fingerprint_id in self._warned:
            return
        self._warned.add(fingerprint_id)
        reasons = []
        if counts.get("other_fp"):
            reasons.append(f"{counts['other_fp']} measured on another device or software stack (fingerprint differs)")
        for vid, (old, new) in sorted(stale.items()):
            reasons.append(f"variant {vid!r} changed since it was measured (version {old} -> {new}); recalibrate it")
        if counts.get("bad"):
            reasons.append(f"{counts['bad']} entries unreadable or malformed")
        if reasons:
            warnings.warn("calibration table: ignoring entries: " + "; ".join(reasons), CalibrationWarning, stacklevel=4)

    def _build_index(self, fingerprint_id: str) -> _Index:
        index = _Index()
        ms, ws, counts = self._scan(fingerprint_id)
        stale: dict[str, tuple[str, str]] = {}
        for m in ms:
            current = self._versions.get((m.group.op, m.variant))
            if current is None:
                continue  # a plugin not loaded now: its timings stay for when it is
            if current != m.version:
                stale[m.variant] = (m.version, current)
                continue
            index.shapes.setdefault((fingerprint_id, m.group), {}).setdefault(m.shape, {})[m.variant] = m
        for w in ws:
            index.winners[(w.fingerprint_id, w.group, w.shape)] = w
        self._warn_once(fingerprint_id, counts, stale)
        return index

    def _fast_index(self, versions: dict[tuple[str, str], str], fingerprint_id: str) -> FastIndex:
        """The decision-time view of this device's rows: from the snapshot row when it is current,
        else from a full scan, which then stores a fresh snapshot for the next process."""
        with self._lock:
            if versions != self._versions:
                self.forget()
                self._versions = dict(versions)
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
        fast = index_from(doc, self._versions) if doc is not None else None
        if fast is None:  # no snapshot, an old one, or a damaged one: from the rows, then stored
            ms, ws, counts = self._scan(fingerprint_id)
            doc = document(ms, ws, counts)
            if token is not None:  # a table that was never written has nothing worth a snapshot
                with contextlib.suppress(OSError, sqlite3.Error):
                    self.store.set(SNAPSHOT_PREFIX + fingerprint_id, encode(token, doc))
            fast = index_from(doc, self._versions)
            assert fast is not None, "a snapshot made here must read back"
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

    def lookup(self, key: CallKey, fingerprint_id: str, candidates: Iterable[str], versions: dict[tuple[str, str], str]):
        """(timings, winner, source, shape, rejected) for ``key`` among ``candidates``: at its own
        shape, else the nearest calibrated shape (log space) of the same group where a candidate
        was measured; ``rejected`` are the candidates that failed verification at that shape.
        None when no candidate has a figure."""
        group = self._fast_index(versions, fingerprint_id).groups.get(Group.of(key).slug())
        if group is None:
            return None
        allowed = set(candidates)
        source, at = "table", key.shape
        found = {v: t for v, t in group.times.get(at, {}).items() if v in allowed}
        if not found:
            source, at = "nearest", group.nearest(key.shape, allowed)
            if at is None:
                return None
            found = {v: t for v, t in group.times[at].items() if v in allowed}
        return found, group.winners.get(at), source, at, group.rejected.get(at, set()) & allowed

    def measurements(self, versions: dict[tuple[str, str], str], fingerprint_id: str):
        """Every current measurement and winner of this device: ((group, shape) -> {id: m}, winners)."""
        index = self.load(versions, fingerprint_id)
        rows = {(g, s): dict(by_v) for (fp, g), shapes in index.shapes.items() for s, by_v in shapes.items()}
        winners = {(g, s): w for (fp, g, s), w in index.winners.items()}
        return rows, winners

    # writing

    def record(self, m: Measurement) -> None:
        self._guard(self.store.set, m.storage_key(), m.model_dump_json())
        self.forget()

    def decide_winner(self, fingerprint_id: str, group: Group, shape: Shape, versions: dict[tuple[str, str], str],
                      margin: float) -> Winner | None:
        """Re-decide one shape's winner from its current measurements, atomically across processes."""
        with self._lock, self.store.transaction():
            timings: dict[str, float] = {}
            for (op, vid), version in versions.items():
                if op != group.op:
                    continue
                raw = self.store.get(_mkey(fingerprint_id, group, shape, vid))
                if raw is None:
                    continue
                try:
                    m = Measurement.model_validate_json(raw)
                except ValidationError:
                    continue
                if m.version == version and m.status == "ok" and m.best_us is not None:
                    timings[vid] = m.best_us
            wkey = _wkey(fingerprint_id, group, shape)
            if not timings:
                self.store.delete(wkey)
                self.forget()
                return None
            best = min(timings, key=timings.__getitem__)
            raw = self.store.get(wkey)
            current = None
            if raw is not None:
                with contextlib.suppress(ValidationError):
                    current = Winner.model_validate_json(raw).variant
            if current in timings and timings[best] >= timings[current] * (1 - margin):
                best = current  # not beaten by more than the margin: the incumbent stays
            w = Winner(fingerprint_id=fingerprint_id, group=group, shape=shape, variant=best,
                       best_us=timings[best], decided_at=time.time())
            self.store.set(wkey, w.model_dump_json())
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
        self._index.clear()
        self._fast.clear()
        self._warned.clear()

    def __len__(self) -> int:
        return len(self.store)
