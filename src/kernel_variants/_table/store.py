"""The table's storage: diskcache when the directory works, a dict when it does not.

Keys are text and values JSON text stored inline. Nothing is ever unpickled: a cache directory
may be shared, and unpickling is code execution, so the disk class below refuses every row that
is not raw text, and never deletes a file a row names.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import diskcache

TOKEN_KEY = "t|token"  # renewed by every write of a measurement or winner row
_BOOKKEEPING = ("t|", "i|", "q|")  # token, snapshots, verdicts: rows beside the timings


class CalibrationWarning(UserWarning):
    """The table could not be used as it was (corrupt, unwritable, or entries out of date)."""


class HostileRow(ValueError):
    pass


class JSONOnlyDisk(diskcache.Disk):
    """Keys are text and values JSON text stored inline; any other row is refused, not read."""

    def get(self, key, raw):
        if not raw or not isinstance(key, str):
            raise HostileRow("a non-text key")
        return key

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if not isinstance(value, str):
            raise TypeError(f"calibration table values are JSON text, got {type(value).__name__}")
        return super().store(value, read, key=key)

    def fetch(self, mode, filename, value, read):
        if mode != diskcache.core.MODE_RAW or not isinstance(value, str):
            raise HostileRow("a value that is not inline text")
        return value

    def remove(self, file_path):
        # Values are always inline, so a row that names a file was planted: deleting what it
        # names (diskcache joins it onto the directory, and an absolute path wins) would let a
        # shared cache directory delete any file. Nothing is ever removed from disk.
        return None


def is_corrupt(exc: sqlite3.DatabaseError) -> bool:
    """A damaged file, as opposed to one that is busy, read-only, on a full disk or unreadable.

    Only the first is moved aside; the others keep the table in memory and leave the file be.
    """
    if not isinstance(exc, sqlite3.OperationalError):
        return True  # "file is not a database", "database disk image is malformed"
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text or "no such table" in text


class Store:
    """diskcache when the directory works, a dict when it does not; the same few methods."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cache: diskcache.Cache | None = None
        self.memory: dict[str, str] | None = None
        self.read_only = False  # in memory, seeded from a table file that cannot be written
        self._open()

    def _open(self) -> None:
        try:
            self.cache = self._connect()
        except sqlite3.DatabaseError as exc:
            if is_corrupt(exc):
                self.move_aside(exc)
            else:
                self.to_memory(exc)
        except OSError as exc:
            self.to_memory(exc)

    def _connect(self) -> diskcache.Cache:
        cache = diskcache.Cache(str(self.directory), disk=JSONOnlyDisk, disk_min_file_size=1 << 24,
                                timeout=60, eviction_policy="none", size_limit=1 << 40)
        len(cache)  # touches the database, so a corrupt file fails here rather than mid-call
        return cache

    def close(self) -> None:
        """Close this thread's database connection (diskcache opens another if used again)."""
        if self.cache is not None:
            self.cache.close()

    def to_memory(self, exc: BaseException) -> None:
        """Keep the table in memory for this process, starting from what the file holds when it
        can still be read: a table shipped read-only (an image, a shared mount) is used as is."""
        rows = self._read_only_rows()
        if rows is None:
            what = "keeping the table in memory for this process (set KV_CACHE_DIR to a writable directory)"
        else:
            what = (f"using its {len(rows)} entries read-only; measurements taken by this process stay in "
                    "memory (set KV_CACHE_DIR to a writable directory to keep them)")
        warnings.warn(
            f"calibration table directory {self.directory} is not usable ({type(exc).__name__}: {exc}); {what}",
            CalibrationWarning, stacklevel=4,
        )
        self.cache, self.memory = None, rows or {}
        self.read_only = rows is not None

    def _read_only_rows(self) -> dict[str, str] | None:
        """Every JSON row of the table file, opened read-only; None when there is none to read."""
        path = self.directory / "cache.db"
        if not path.is_file():
            return None
        try:
            con = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=5)
            try:
                found = con.execute("SELECT key, mode, value FROM Cache WHERE raw = 1 AND typeof(key) = 'text'")
                # Only inline text rows: anything else is refused here as the disk class refuses it.
                return {k: v for k, mode, v in found.fetchall()
                        if mode == diskcache.core.MODE_RAW and isinstance(v, str)}
            finally:
                con.close()
        except (sqlite3.Error, OSError):
            return None

    def move_aside(self, exc: BaseException) -> None:
        """A corrupt table is kept for inspection under another name; a fresh one replaces it."""
        if self.cache is not None:
            with contextlib.suppress(Exception):
                self.cache.close()
        aside = self.directory.with_name(f"{self.directory.name}.corrupt-{int(time.time())}-{os.getpid()}")
        try:
            shutil.move(str(self.directory), str(aside))
            where = f"moved to {aside}"
        except OSError as move_exc:
            where = f"could not be moved aside ({move_exc})"
        warnings.warn(
            f"calibration table in {self.directory} is corrupt ({type(exc).__name__}: {exc}); it was "
            f"{where} and a fresh table started",
            CalibrationWarning, stacklevel=4,
        )
        try:
            self.cache = self._connect()
        except (OSError, sqlite3.DatabaseError) as again:
            self.to_memory(again)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        if self.cache is None:
            yield
            return
        with self.cache.transact():
            yield

    def items(self) -> Iterator[tuple[str, str | None]]:
        """Every (key, JSON) pair; a row that is not text gives (its key, None)."""
        if self.cache is None:
            yield from list(self.memory.items())
            return
        # Keys are listed straight from SQLite: diskcache's own key iterator would unpickle a
        # non-raw key (and stop at the first one our disk refuses).
        uri = (self.directory / "cache.db").resolve().as_uri() + "?mode=ro"  # '#', '?', '%' escaped
        con = sqlite3.connect(uri, uri=True, timeout=60)
        try:
            rows = con.execute("SELECT key, raw = 1 AND typeof(key) = 'text' FROM Cache").fetchall()
        finally:
            con.close()
        for key, text in rows:
            if not text:
                yield repr(key)[:40], None
                continue
            try:
                yield key, self.cache.get(key)
            except HostileRow:
                yield key, None

    def set(self, key: str, value: str) -> None:
        if self.cache is None:
            self.memory[key] = value
        else:
            self.cache.set(key, value)
        self._touched(key)

    def _touched(self, key: str) -> None:
        """A measurement or winner changed: renew the write token, which makes every snapshot
        of the table's rows out of date (see _table/index.py)."""
        if key.startswith(("m|", "w|")):
            token = json.dumps({"token": uuid.uuid4().hex})  # JSON, as every value in the table
            if self.cache is None:
                self.memory[TOKEN_KEY] = token
            else:
                self.cache.set(TOKEN_KEY, token)

    def get(self, key: str) -> str | None:
        if self.cache is None:
            return self.memory.get(key)
        try:
            return self.cache.get(key)
        except HostileRow:
            return None

    def delete(self, key: str) -> None:
        if self.cache is None:
            self.memory.pop(key, None)
        else:
            self.cache.delete(key)
        self._touched(key)

    def __len__(self) -> int:
        """Rows of measurements and winners (not the write token, snapshots and qualification
        verdicts kept beside them)."""
        n = len(self.memory) if self.cache is None else len(self.cache)
        return n - sum(1 for k in self._bookkeeping_keys())

    def _bookkeeping_keys(self) -> list[str]:
        if self.cache is None:
            return [k for k in self.memory if k.startswith(_BOOKKEEPING)]
        uri = (self.directory / "cache.db").resolve().as_uri() + "?mode=ro"
        con = sqlite3.connect(uri, uri=True, timeout=60)
        try:
            return [k for (k,) in con.execute("SELECT key FROM Cache WHERE key >= 'i|' AND key < 'u'")
                    if isinstance(k, str) and k.startswith(_BOOKKEEPING)]
        finally:
            con.close()


# Keys that serving processes met without a measurement (KV_RECORD=1), for calibrating offline.

RECORD_FILE = "recorded.db"
RECORD_LIMIT = 10_000  # keys not yet calibrated; beyond this new keys are not recorded (one warning)
_DONE_KEPT = 10_000  # calibrated keys kept for `kv table` to show; the oldest go first


class Recorder:
    """The record of uncalibrated call keys: a small SQLite file beside the table.

    ``add`` is what a serving process runs, once per key: one ``INSERT`` (no timing, no device
    sync). SQLite serialises processes that write at once; a writer that finds the file busy
    for longer than a moment, or unwritable, gives up on that key rather than hold up a call.
    The record is bounded: at most ``limit`` keys wait for calibration.
    """

    def __init__(self, directory: Path, limit: int = RECORD_LIMIT) -> None:
        self.path = Path(directory) / RECORD_FILE
        self.limit = limit
        self._con: sqlite3.Connection | None = None
        self._pid = 0

    def _connect(self, create: bool) -> sqlite3.Connection | None:
        if self._con is not None and self._pid == os.getpid():
            return self._con
        if not create and not self.path.is_file():
            return None
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(str(self.path), timeout=0.5, isolation_level=None, check_same_thread=False)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute("CREATE TABLE IF NOT EXISTS recorded (id TEXT PRIMARY KEY, doc TEXT NOT NULL, "
                        "first_seen REAL NOT NULL, last_seen REAL NOT NULL, seen INTEGER NOT NULL, done_at REAL)")
        except sqlite3.Error:
            con.close()
            raise
        self._con, self._pid = con, os.getpid()  # a forked child opens its own connection
        return con

    def add(self, key_id: str, doc: dict) -> str:
        """Record one key: "added", "seen" (already waiting), or "full" (not recorded).
        Raises ``sqlite3.Error`` or ``OSError`` when the record cannot be written."""
        con = self._connect(create=True)
        now = time.time()
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        with _immediate(con):
            row = con.execute("SELECT done_at FROM recorded WHERE id = ?", (key_id,)).fetchone()
            if row is not None:
                con.execute("UPDATE recorded SET seen = seen + 1, last_seen = ?, done_at = NULL, doc = ? WHERE id = ?",
                            (now, text, key_id))
                return "seen"
            (waiting,) = con.execute("SELECT count(*) FROM recorded WHERE done_at IS NULL").fetchone()
            if waiting >= self.limit:
                return "full"
            con.execute("INSERT INTO recorded VALUES (?, ?, ?, ?, 1, NULL)", (key_id, text, now, now))
            return "added"

    def entries(self, pending_only: bool = False) -> list[dict]:
        """Every recorded key (oldest first): its document plus ``id``, ``seen`` (processes that
        met it), ``first_seen``, ``last_seen`` and ``done_at`` (None while waiting)."""
        con = self._connect(create=False)
        if con is None:
            return []
        sql = "SELECT id, doc, first_seen, last_seen, seen, done_at FROM recorded"
        if pending_only:
            sql += " WHERE done_at IS NULL"
        out = []
        for kid, text, first, last, seen, done in con.execute(sql + " ORDER BY first_seen, id").fetchall():
            try:
                doc = json.loads(text)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append({**doc, "id": kid, "seen": seen, "first_seen": first, "last_seen": last, "done_at": done})
        return out

    def mark_done(self, ids: list[str]) -> None:
        con = self._connect(create=False)
        if con is None or not ids:
            return
        now = time.time()
        with _immediate(con):
            con.executemany("UPDATE recorded SET done_at = ? WHERE id = ?", [(now, i) for i in ids])
            con.execute("DELETE FROM recorded WHERE id IN (SELECT id FROM recorded WHERE done_at IS NOT NULL "
                        "ORDER BY done_at DESC LIMIT -1 OFFSET ?)", (_DONE_KEPT,))

    def close(self) -> None:
        if self._con is not None and self._pid == os.getpid():
            self._con.close()
        self._con = None


@contextlib.contextmanager
def _immediate(con: sqlite3.Connection) -> Iterator[None]:
    """One write transaction (taken at once, so that two processes never both read then write)."""
    con.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
