"""The calibration table: per-variant timings per call key, on disk with diskcache, as JSON.

Storage keys hold the device fingerprint, op, feature group, shape and variant id; values are
JSON documents validated on read. Nothing is ever unpickled: a cache directory may be shared,
and unpickling is code execution, so the disk class below refuses every non-raw row.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kernel_variants._paths import table_dir
from kernel_variants.registry import CallKey
from kernel_variants.registry._models import DTypeName
from kernel_variants.registry._spec import Shape

from ._fastindex import SNAPSHOT_PREFIX, TOKEN_KEY, FastIndex, decode, document, encode, index_from
from ._fingerprint import device_part, is_legacy
from ._fingerprint import fingerprint_id as identify
from ._store import CalibrationWarning, HostileRow, JSONOnlyDisk, Store, is_corrupt

VERDICT_PREFIX = "q|"  # qualification verdicts (see _qualify), stored beside the timings

__all__ = ["CalibrationTable", "CalibrationWarning", "Group", "HostileRow", "JSONOnlyDisk", "Measurement",
           "StaleRow", "Winner", "is_corrupt"]

# 2: a group is (op, dtype, the op's own feature flags); rows of 1 (causal_conv1d's fields
# inline) are migrated when the table loads.
# 3: per-window samples, noise, pruned rows, each row's dependency versions; winners say how
# sure they are. The fingerprint no longer holds torch's and kernel_variants' versions: rows
# written with those (``is_legacy``) are ignored with one warning, never mixed with new ones.
SCHEMA = 3
# A challenger must be this much faster to take a shape from its winner: noise on a shared
# machine is a few percent, and choices that flip back and forth help nobody. It is the floor:
# where the measured noise of the two is larger, the lead must exceed that instead.
DEFAULT_MARGIN = 0.02
# After the first round of a shape, a candidate slower than the best by more than this is timed
# no further (recorded as pruned, with the ratio).
DEFAULT_PRUNE = 3.0
FeatureValue = bool | int | float | str


def check_margin(margin: float) -> float:
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError(f"margin: expected a fraction in [0, 1), got {margin!r}")
    return float(margin)


def check_prune(prune: float | None) -> float | None:
    """None (prune nothing) or a factor above 1."""
    if prune is None:
        return None
    if isinstance(prune, bool) or not isinstance(prune, (int, float)) or not (1 < prune < math.inf):
        raise ValueError(f"prune: expected a factor above 1 (or None for no pruning), got {prune!r}")
    return float(prune)


def combined_noise(*noises: float | None) -> float:
    """The noise of a comparison of figures with these relative noises (independent: in quadrature)."""
    return math.sqrt(sum((n or 0.0) ** 2 for n in noises))


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

    schema_version: Literal[1, 2, 3] = SCHEMA
    fingerprint: dict[str, str]
    fingerprint_id: str
    group: Group
    shape: Shape
    variant: str
    version: str
    # "pruned": timed for the first round only, ``pruned_at`` times slower than the best there;
    # ``best_us`` is that round's figure. Measured slower, never unmeasured.
    status: Literal["ok", "rejected", "pruned"]
    reason: str = ""
    best_us: float | None = None
    median_us: float | None = None
    spread: float | None = None
    windows: int = 0
    iters: int = 0
    method: str = ""
    samples_us: tuple[float, ...] = Field(default=(), max_length=10_000)  # each window's mean
    noise: float | None = None  # (median - best) / best: how far a typical window is from the best
    pruned_at: float | None = None
    deps: dict[str, str] = Field(default_factory=dict, max_length=64)  # the variant's dependencies then
    measured_at: float

    def storage_key(self) -> str:
        return _mkey(self.fingerprint_id, self.group, self.shape, self.variant)

    @property
    def timed(self) -> bool:
        """Has a figure (fully timed, or pruned after its first round)."""
        return self.status in ("ok", "pruned") and self.best_us is not None


Confidence = Literal["", "clear", "within noise", "single"]


class Winner(BaseModel):
    """The variant a shape goes to; it keeps the shape until a challenger beats it by the margin
    and by the measured noise.

    How sure it is: ``lead`` is the runner-up's time over the winner's, minus one (negative when
    a faster challenger did not lead by enough to take the shape), ``noise`` the two figures'
    combined noise, and ``confidence`` "clear" (the lead exceeds the margin and the noise),
    "within noise" (it does not: either could be faster) or "single" (nothing to compare)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2, 3] = SCHEMA
    fingerprint_id: str
    group: Group
    shape: Shape
    variant: str
    best_us: float
    runner_up: str | None = None
    lead: float | None = None
    noise: float | None = None
    confidence: Confidence = ""
    decided_at: float

    def storage_key(self) -> str:
        return _wkey(self.fingerprint_id, self.group, self.shape)


def _mkey(fp: str, group: Group, shape: Shape, variant: str) -> str:
    return f"m|{fp}|{group.slug()}|{','.join(map(str, shape))}|{variant}"


def _wkey(fp: str, group: Group, shape: Shape) -> str:
    return f"w|{fp}|{group.slug()}|{','.join(map(str, shape))}"


@dataclass(frozen=True)
class StaleRow:
    """A measurement of this device that no longer matches its variant: why, and where it is."""

    group: Group
    shape: Shape
    variant: str
    measured: str  # the version it was measured with
    current: str  # the registered version now
    why: str
    legacy: bool  # written by an earlier release (its fingerprint held package versions)
    measured_at: float
    key: str  # its storage key
    winner_key: str  # the storage key of the winner row it was decided under


def stale_reason(m: Measurement, deps_now: dict[str, str], source_now: str = "") -> str:
    """Why ``m`` no longer matches the variant registered now (whose dependencies are
    ``deps_now`` and whose version without them is ``source_now``)."""
    if is_legacy(m.fingerprint):
        versions = ", ".join(f"{k} {m.fingerprint[k]}" for k in ("kernel_variants", "torch") if k in m.fingerprint)
        why = f"measured by an earlier release ({versions}), before staleness was kept per variant"
        if source_now and m.version != source_now:
            why += "; its source has changed since"
        return why
    changed = [f"{k} {m.deps.get(k, '(none)')} -> {deps_now.get(k, '(none)')}"
               for k in sorted(set(m.deps) | set(deps_now)) if m.deps.get(k) != deps_now.get(k)]
    return "; ".join(changed) if changed else "its source or declared version changed"


def _other_threads(fp: dict[str, str], fingerprint_id: str) -> bool:
    """Whether ``fp`` is the fingerprint ``fingerprint_id`` of this CPU but for its thread count."""
    now = str(torch.get_num_threads())
    return fp.get("device") == "cpu" and fp.get("threads") not in (None, now) and identify(
        {**fp, "threads": now}) == fingerprint_id


class Found(NamedTuple):
    """What the table has for a call: each candidate's µs (pruned ones with their first-round
    figure), the recorded winner, "table" (this shape) or "nearest", the shape the figures are
    from, the candidates rejected there, and those pruned there with their bound."""

    timings: dict[str, float]
    winner: str | None
    source: str
    at: Shape
    rejected: set[str]
    pruned: dict[str, float]


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
        # While `kv calibrate --stale` re-measures them, stale and legacy rows are not news.
        self.quiet_stale = False

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

    def _scan(self, fingerprint_id: str) -> tuple[list[Measurement], list[Winner], dict[str, int], list[Measurement]]:
        """Every readable measurement and winner of ``fingerprint_id`` (any version), how many
        rows were of other fingerprints, unreadable, or legacy, and the legacy measurements of
        this device (written before per-variant versions: see ``_fingerprint.is_legacy``)."""
        ms: list[Measurement] = []
        ws: list[Winner] = []
        legacy: list[Measurement] = []
        counts = {"other_fp": 0, "bad": 0, "legacy": 0, "threads": 0}
        mine: dict[str, bool] = {}  # a legacy fingerprint id -> whether it is this device's
        # Another fingerprint id -> whether it is this CPU at another intra-op thread count. Told
        # apart because it is the usual reason: a forked child runs one thread (see the package's
        # at-fork handler), so its rows are filed apart from its parent's, not lost.
        retuned: dict[str, bool] = {}
        for key, raw in self.store.items():
            if key.startswith((TOKEN_KEY, SNAPSHOT_PREFIX, VERDICT_PREFIX)):
                continue  # bookkeeping and qualification verdicts: not timings
            if raw is None:
                counts["bad"] += 1
                continue
            try:
                if key.startswith(("m|", "w|")) and '"schema_version":1' in raw.replace(" ", ""):
                    key, raw = self._migrate_row(key, raw)
                if key.startswith("m|"):
                    m = Measurement.model_validate_json(raw)
                    if m.fingerprint_id == fingerprint_id and not is_legacy(m.fingerprint):
                        ms.append(m)
                    elif is_legacy(m.fingerprint) and mine.setdefault(
                            m.fingerprint_id, identify(device_part(m.fingerprint)) == fingerprint_id):
                        counts["legacy"] += 1
                        legacy.append(m)
                    else:
                        if m.fingerprint_id not in retuned:
                            retuned[m.fingerprint_id] = _other_threads(m.fingerprint, fingerprint_id)
                        counts["threads" if retuned[m.fingerprint_id] else "other_fp"] += 1
                elif key.startswith("w|"):
                    w = Winner.model_validate_json(raw)
                    if w.fingerprint_id == fingerprint_id:
                        ws.append(w)
                else:
                    counts["bad"] += 1
            except (ValidationError, ValueError):
                counts["bad"] += 1
        return ms, ws, counts, legacy

    def _warn_once(self, fingerprint_id: str, counts: dict[str, int], stale: dict[str, tuple[str, str]]) -> None:
        """One warning per load naming what is ignored, whichever path (full or fast) loaded."""
        if fingerprint_id in self._warned:
            return
        self._warned.add(fingerprint_id)
        reasons = []
        if self.quiet_stale:
            counts, stale = {**counts, "legacy": 0}, {}
        if counts.get("legacy"):
            reasons.append(f"{counts['legacy']} measured on this device by an earlier kernel_variants release "
                           "(before staleness was kept per variant; they cannot be told current)")
        if counts.get("threads"):
            reasons.append(f"{counts['threads']} measured on this CPU with another intra-op thread count (this "
                           f"process runs {torch.get_num_threads()}; a forked child runs one)")
        if counts.get("other_fp"):
            reasons.append(f"{counts['other_fp']} measured on another device or software stack (fingerprint differs)")
        for vid, (old, new) in sorted(stale.items()):
            reasons.append(f"variant {vid!r} changed since it was measured (version {old} -> {new})")
        if counts.get("bad"):
            reasons.append(f"{counts['bad']} entries unreadable or malformed")
        if reasons:
            hint = "; `kv table --stale` lists them, `kv calibrate --stale` re-measures them" if (
                stale or counts.get("legacy")) else ""
            warnings.warn("calibration table: ignoring entries: " + "; ".join(reasons) + hint, CalibrationWarning,
                          stacklevel=4)

    def _build_index(self, fingerprint_id: str) -> _Index:
        index = _Index()
        ms, ws, counts, _ = self._scan(fingerprint_id)
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
            ms, ws, counts, _ = self._scan(fingerprint_id)
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

    def lookup(self, key: CallKey, fingerprint_id: str, candidates: Iterable[str],
               versions: dict[tuple[str, str], str]) -> Found | None:
        """The figures for ``key`` among ``candidates``: at its own shape, else the nearest
        calibrated shape (log space) of the same group where a candidate was measured. None when
        no candidate has a figure."""
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
        pruned = {v: b for v, b in group.pruned.get(at, {}).items() if v in allowed}
        return Found(found, group.winners.get(at), source, at, group.rejected.get(at, set()) & allowed, pruned)

    def measurements(self, versions: dict[tuple[str, str], str], fingerprint_id: str):
        """Every current measurement and winner of this device: ((group, shape) -> {id: m}, winners)."""
        index = self.load(versions, fingerprint_id)
        rows = {(g, s): dict(by_v) for (fp, g), shapes in index.shapes.items() for s, by_v in shapes.items()}
        winners = {(g, s): w for (fp, g, s), w in index.winners.items()}
        return rows, winners

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
            if old and _mkey(fingerprint_id, m.group, m.shape, m.variant) in current:
                continue  # measured again since: the old row is only clutter
            out.append(StaleRow(m.group, m.shape, m.variant, m.version, now,
                                stale_reason(m, deps.get((m.group.op, m.variant), {}),
                                             (sources or {}).get((m.group.op, m.variant), "")), old, m.measured_at,
                                m.storage_key(), _wkey(m.fingerprint_id, m.group, m.shape)))
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
                raw = self.store.get(_mkey(fingerprint_id, group, shape, vid))
                if raw is None:
                    continue
                try:
                    m = Measurement.model_validate_json(raw)
                except ValidationError:
                    continue
                if m.version == version and m.timed:
                    timed[vid] = m
            wkey = _wkey(fingerprint_id, group, shape)
            if not timed:
                self.store.delete(wkey)
                self.forget()
                return None
            t = {v: m.best_us for v, m in timed.items()}
            best = min(t, key=t.__getitem__)
            raw = self.store.get(wkey)
            current = None
            if raw is not None:
                with contextlib.suppress(ValidationError):
                    current = Winner.model_validate_json(raw).variant
            if current in t and current != best:
                lead = t[current] / t[best] - 1
                if lead <= max(margin, combined_noise(timed[current].noise, timed[best].noise)):
                    best = current  # not clearly beaten: the incumbent stays
            others = sorted((v for v in t if v != best), key=t.__getitem__)
            w = Winner(fingerprint_id=fingerprint_id, group=group, shape=shape, variant=best, best_us=t[best],
                       decided_at=time.time(), confidence="single")
            if others:
                runner = others[0]
                lead = t[runner] / t[best] - 1
                noise = combined_noise(timed[runner].noise, timed[best].noise)
                w = w.model_copy(update={"runner_up": runner, "lead": lead, "noise": noise,
                                         "confidence": "clear" if lead > max(margin, noise) else "within noise"})
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

    def rows_at(self, fingerprint_id: str, group: Group, shape: Shape, versions: dict[tuple[str, str], str]) -> list[str]:
        """The JSON rows of one shape (its current measurements, then its winner), for another
        process to ``ingest``."""
        out = []
        for (op, vid), version in versions.items():
            if op != group.op:
                continue
            raw = self.store.get(_mkey(fingerprint_id, group, shape, vid))
            with contextlib.suppress(ValidationError):
                if raw is not None and Measurement.model_validate_json(raw).version == version:
                    out.append(raw)
        raw = self.store.get(_wkey(fingerprint_id, group, shape))
        if raw is not None:
            out.append(raw)
        return out

    def ingest(self, rows: Iterable[str]) -> int:
        """Write rows another process of the same fingerprint sent (``rows_at``): a measurement
        where it is newer than the local one, a winner as it is (so that both decide alike).
        Returns how many were written; a row that does not validate is skipped."""
        n = 0
        with self._lock, self.store.transaction():
            for raw in rows:
                try:
                    row: Measurement | Winner = (Measurement if '"measured_at"' in raw else Winner).model_validate_json(raw)
                except ValidationError:
                    continue
                if isinstance(row, Measurement):
                    mine = self.store.get(row.storage_key())
                    with contextlib.suppress(ValidationError):
                        if mine is not None and Measurement.model_validate_json(mine).measured_at >= row.measured_at:
                            continue
                self.store.set(row.storage_key(), row.model_dump_json())
                n += 1
        self.forget()
        return n

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
