"""Moving a calibration table between machines as one versioned JSON document.

A table measured on one machine serves every machine with the same fingerprint (device, and its
driver or runtime) and the same variant versions (each variant's version holds its source's hash
and its declared dependencies' versions, so a machine with another torch or Triton finds the
affected rows stale, and only those): ``export_table`` writes this device's part of the table,
``import_table`` merges a document into the local table. An import validates the
whole document first and then writes it in one transaction, so a malformed or hostile file
changes nothing; a document from another fingerprint is refused unless forced, and one from
another kind of CPU (or one exported before a CPU's kind was kept) even then: its timings and
verdicts are not this CPU's, under any fingerprint.
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kernel_variants._registry.models import valid_candidate
from kernel_variants._table.fingerprint import (
    cpu_kind,
    describe_cpu,
    fingerprint,
    fingerprint_id,
    lacks_cpu_kind,
)
from kernel_variants._table.rows import (
    DEFAULT_MARGIN,
    VERDICT_PREFIX,
    Measurement,
    Verdict,
    Winner,
    parse_verdict,
    verdict_fingerprint,
)
from kernel_variants._table.table import CalibrationTable

# 2: rows of table schema 3 (per-variant dependencies, samples, pruned rows); a document of 1
# was written by an earlier release, whose fingerprints held package versions: refused, saying so.
DOCUMENT_SCHEMA = 2
DOCUMENT_FORMAT = "kernel_variants.table"
# A 69-shape sweep of three variants is about 150 kB; anything near this cap is not a table.
MAX_DOCUMENT_BYTES = 64 << 20
_MAX_US = 1e9  # a thousand seconds per call: beyond that a figure is corrupt, not slow
_MAX_COUNT = 1 << 31
_FUTURE_S = 86400.0  # clocks of a fleet disagree a little; a timestamp a day ahead is forged


class ExchangeError(ValueError):
    """A document that cannot be imported here; the message is one line and says why."""


class TableDocument(BaseModel):
    """Every measurement and winner of one device fingerprint, as exported."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["kernel_variants.table"] = DOCUMENT_FORMAT
    schema_version: Literal[1, 2] = DOCUMENT_SCHEMA
    fingerprint: dict[str, str] = Field(max_length=64)
    fingerprint_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    created_at: float
    measurements: list[Measurement]
    winners: list[Winner]
    # Qualification verdicts of the same fingerprint: a fleet of one machine type qualifies once.
    # (Absent from documents of earlier releases: nothing qualified there.)
    verdicts: list[Verdict] = Field(default_factory=list)

    @model_validator(mode="after")
    def _sound(self) -> TableDocument:
        now = time.time()
        if fingerprint_id(self.fingerprint) != self.fingerprint_id:
            raise ValueError(f"fingerprint_id {self.fingerprint_id} does not match the fingerprint, whose id is "
                             f"{fingerprint_id(self.fingerprint)} (the fingerprint was edited after export)")
        if any(len(k) > 200 or len(v) > 1000 for k, v in self.fingerprint.items()):
            raise ValueError("fingerprint: keys or values too long")
        _check_time("created_at", self.created_at, now)
        seen: set[str] = set()
        rows = (("measurements", self.measurements, measurement_problem, "measured",
                 lambda m: m.fingerprint != self.fingerprint, "a second entry for the same variant and shape"),
                ("winners", self.winners, winner_problem, "decided", lambda w: False, "a second winner for the same shape"))
        for field_name, entries, problem_of, done, other_fp, twice in rows:
            for i, row in enumerate(entries):
                problem = problem_of(row, now)
                if problem is None and (row.fingerprint_id != self.fingerprint_id or other_fp(row)):
                    problem = f"{done} on another fingerprint than the document's"
                if problem is None and row.storage_key() in seen:
                    problem = twice
                if problem is not None:
                    raise ValueError(f"{field_name}[{i}] ({row.variant} at {_shape(row.shape)}): {problem}")
                seen.add(row.storage_key())
        mine = verdict_fingerprint(self.fingerprint)
        for i, v in enumerate(self.verdicts):
            problem = None
            if v.fingerprint != mine or v.fingerprint_id != fingerprint_id(mine):
                problem = "qualified on another fingerprint than the document's"
            elif not valid_candidate(v.variant):
                problem = f"variant id {v.variant!r} is not a valid id"
            elif v.qualified_at > now + _FUTURE_S:
                problem = "qualified_at lies in the future"
            elif v.storage_key() in seen:
                problem = "a second verdict for the same variant and class"
            if problem is not None:
                raise ValueError(f"verdicts[{i}] ({v.variant}): {problem}")
            seen.add(v.storage_key())
        return self


def _shape(s: tuple[int, ...]) -> str:
    return ",".join(map(str, s))


def _check_time(name: str, t: float, now: float) -> None:
    if not (math.isfinite(t) and 0 <= t <= now + _FUTURE_S):
        raise ValueError(f"{name}: expected a Unix time no later than now, got {t}")


def _common_problem(shape: tuple[int, ...], variant: str, best_us: float | None, t: float, now: float,
                    t_name: str) -> str | None:
    if not shape or not all(1 <= s < _MAX_COUNT for s in shape):
        return f"shape sizes must be between 1 and {_MAX_COUNT - 1}"
    if not valid_candidate(variant):
        return f"variant id {variant[:80]!r} is not a valid id"
    if best_us is not None and not (math.isfinite(best_us) and 0 < best_us <= _MAX_US):
        return f"best_us must be a positive number of microseconds up to {_MAX_US:g}, got {best_us}"
    if not (math.isfinite(t) and 0 <= t <= now + _FUTURE_S):
        return f"{t_name} must be a Unix time no later than now, got {t}"
    return None


def measurement_problem(m: Measurement, now: float | None = None) -> str | None:
    """Why ``m`` is not a believable measurement (None when it is)."""
    now = time.time() if now is None else now
    problem = _common_problem(m.shape, m.variant, m.best_us, m.measured_at, now, "measured_at")
    if problem is not None:
        return problem
    if m.status in ("ok", "pruned") and (m.best_us is None or m.median_us is None):
        return f"an {m.status} measurement needs best_us and median_us"
    if not all(math.isfinite(t) and 0 < t <= _MAX_US for t in m.samples_us):
        return f"samples_us must be positive numbers of microseconds up to {_MAX_US:g}"
    if m.noise is not None and not (math.isfinite(m.noise) and 0 <= m.noise <= _MAX_US):
        return f"noise must be a non-negative number, got {m.noise}"
    if m.status == "pruned" and (m.pruned_at is None or not (math.isfinite(m.pruned_at) and 0 < m.pruned_at <= _MAX_US)):
        return f"a pruned measurement needs pruned_at, a positive ratio, got {m.pruned_at}"
    if any(len(k) > 100 or len(v) > 200 for k, v in m.deps.items()):
        return "deps: names or versions too long"
    if m.median_us is not None and not (math.isfinite(m.median_us) and 0 < m.median_us <= _MAX_US):
        return f"median_us must be a positive number of microseconds up to {_MAX_US:g}, got {m.median_us}"
    if m.spread is not None and not (math.isfinite(m.spread) and 0 <= m.spread <= _MAX_US):
        return f"spread must be a non-negative number, got {m.spread}"
    if not (0 <= m.windows < _MAX_COUNT and 0 <= m.iters < _MAX_COUNT):
        return f"windows and iters must be counts below {_MAX_COUNT}, got {m.windows} and {m.iters}"
    if len(m.version) > 200 or len(m.reason) > 10_000 or len(m.method) > 200:
        return "version, reason or method text too long"
    return None


def winner_problem(w: Winner, now: float | None = None) -> str | None:
    """Why ``w`` is not a believable winner (None when it is)."""
    now = time.time() if now is None else now
    problem = _common_problem(w.shape, w.variant, w.best_us, w.decided_at, now, "decided_at")
    if problem is None and w.runner_up is not None and not valid_candidate(w.runner_up):
        problem = f"runner_up {w.runner_up[:80]!r} is not a valid id"
    if problem is None and w.lead is not None and not (math.isfinite(w.lead) and -1 < w.lead <= _MAX_US):
        problem = f"lead must be a finite ratio above -1, got {w.lead}"
    if problem is None and w.noise is not None and not (math.isfinite(w.noise) and 0 <= w.noise <= _MAX_US):
        problem = f"noise must be a non-negative number, got {w.noise}"
    return problem


def build_document(table: CalibrationTable, device: str = "cpu") -> TableDocument:
    """This device's measurements, winners and verdicts from ``table``, as a document.

    Entries the table itself could not read (malformed rows) are left out, as load() ignores them.
    """
    fp = fingerprint(str(torch.device(device)))
    fpid = fingerprint_id(fp)
    now = time.time()
    ms: list[Measurement] = []
    ws: list[Winner] = []
    vs: list[Verdict] = []
    vfp = verdict_fingerprint(fp)
    vprefix = f"{VERDICT_PREFIX}{fingerprint_id(vfp)}|"
    for key, raw in table.store.items():
        if raw is None:
            continue
        if key.startswith(vprefix):
            v = parse_verdict(raw)
            if v is not None and v.fingerprint == vfp:
                vs.append(v)
            continue
        try:
            if key.startswith(f"m|{fpid}|"):
                m = Measurement.model_validate_json(raw)
                if m.fingerprint == fp and measurement_problem(m, now) is None:
                    ms.append(m)
            elif key.startswith(f"w|{fpid}|"):
                w = Winner.model_validate_json(raw)
                if winner_problem(w, now) is None:
                    ws.append(w)
        except ValidationError:
            continue
    return TableDocument(fingerprint=fp, fingerprint_id=fpid, created_at=now,
                         measurements=sorted(ms, key=Measurement.storage_key),
                         winners=sorted(ws, key=Winner.storage_key), verdicts=sorted(vs, key=Verdict.storage_key))


def export_table(table: CalibrationTable, path_or_file: str | os.PathLike[str] | IO[str],
                 device: str = "cpu") -> TableDocument:
    """Write this device's part of ``table`` to ``path_or_file`` (a path, replaced atomically, or
    a text file)."""
    doc = build_document(table, device)
    # Without verdicts the document is as the previous release wrote it (which forbids new fields).
    text = doc.model_dump_json(indent=1, exclude=None if doc.verdicts else {"verdicts"}) + "\n"
    if hasattr(path_or_file, "write"):
        path_or_file.write(text)
        return doc
    path = Path(path_or_file)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, expected a file name", str(path))
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(path.parent))
    # Written beside the target and renamed, so a reader never sees half a document.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return doc


def parse_document(text: str | bytes, source: str = "document") -> TableDocument:
    """Validate a whole document; any problem is one ``ExchangeError`` line naming where."""
    if len(text) > MAX_DOCUMENT_BYTES:
        raise ExchangeError(f"{source}: larger than {MAX_DOCUMENT_BYTES >> 20} MiB, not a table document")
    try:
        return TableDocument.model_validate_json(text)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise ExchangeError(f"{source}: not a valid table document: {where + ': ' if where else ''}{msg}{more}") from None


def read_document(path: str | os.PathLike[str]) -> TableDocument:
    """Read and validate the document at ``path`` (reading at most the size cap)."""
    with open(path, "rb") as f:
        data = f.read(MAX_DOCUMENT_BYTES + 1)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ExchangeError(f"{path}: larger than {MAX_DOCUMENT_BYTES >> 20} MiB, not a table document")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ExchangeError(f"{path}: not a table document (not UTF-8 JSON text)") from None
    return parse_document(text, source=str(path))


@dataclass
class ImportReport:
    """What an import changed, in measurements: added, newer ones that replaced older, older ones
    skipped. The winners of the shapes it touched are re-decided from the merged measurements."""

    source: str
    fingerprint_id: str
    forced: bool = False  # the document's fingerprint differed and was replaced by this machine's
    added: int = 0
    updated: int = 0
    kept: int = 0  # the local entry was as new or newer
    stale: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (document, local) version
    unknown: list[str] = field(default_factory=list)  # variants not registered here
    verdicts: int = 0  # qualification verdicts taken (newer than the local ones)
    # A forced import brings no verdicts: they say what is right on the device they came from.
    verdicts_left: int = 0
    verdicts_empty: int = 0  # passes that ran no case: refused (a qualification runs at least one)


def _differences(theirs: dict[str, str], ours: dict[str, str]) -> str:
    keys = sorted(set(theirs) | set(ours))
    return ", ".join(f"{k} {theirs.get(k, '(none)')!r} in the document, {ours.get(k, '(none)')!r} here"
                     for k in keys if theirs.get(k) != ours.get(k))


def _same_cpu(theirs: dict[str, str], ours: dict[str, str], source: str) -> None:
    """Refuse a CPU document of another kind of CPU than this one, or of an unknown kind, forced
    or not: a forced import files rows under this machine's fingerprint, where they are used."""
    if ours.get("device") != "cpu":
        return
    if lacks_cpu_kind(theirs):
        raise ExchangeError(f"{source}: exported by an earlier kernel_variants release, which did not record the "
                            f"CPU's model and ISA level: it cannot be told this CPU's ({describe_cpu(ours)}); "
                            "export it again with this release, or calibrate here")
    if cpu_kind(theirs) != cpu_kind(ours):
        raise ExchangeError(f"{source}: measured on another CPU ({describe_cpu(theirs)}; this CPU is "
                            f"{describe_cpu(ours)}): its timings and verdicts do not hold here, --force or not; "
                            "calibrate here (kv calibrate)")


def import_document(doc: TableDocument, table: CalibrationTable, versions: dict[tuple[str, str], str], *,
                    force: bool = False, device: str = "cpu", source: str = "document") -> ImportReport:
    """Merge ``doc`` into ``table`` (whose registered variants have ``versions``), keeping the
    newer entry per key. Decisions made from the table before are the caller's to forget."""
    dev = torch.device(device)
    if doc.schema_version < DOCUMENT_SCHEMA:
        raise ExchangeError(f"{source}: written by an earlier kernel_variants release (document schema "
                            f"{doc.schema_version}, whose fingerprint held package versions and no per-variant "
                            "dependencies): its timings cannot be told current here; export it again with this "
                            "release, or recalibrate")
    if doc.fingerprint.get("device") != dev.type:
        raise ExchangeError(f"{source}: measured on a {doc.fingerprint.get('device', 'unknown')} device, "
                            f"not {dev.type} (pass the matching --device)")
    ours = fingerprint(str(dev))
    ours_id = fingerprint_id(ours)
    _same_cpu(doc.fingerprint, ours, source)
    report = ImportReport(source, ours_id)
    ms, ws = list(doc.measurements), list(doc.winners)
    if doc.fingerprint_id != ours_id:
        if not force:
            raise ExchangeError(f"{source}: measured on another device or software stack "
                                f"({_differences(doc.fingerprint, ours)}); pass --force to import it anyway")
        report.forced = True
        ms = [m.model_copy(update={"fingerprint": ours, "fingerprint_id": ours_id}) for m in ms]
        ws = [w.model_copy(update={"fingerprint_id": ours_id}) for w in ws]
    for m in ms:
        local = versions.get((m.group.op, m.variant))
        if local is None:
            if m.variant not in report.unknown:
                report.unknown.append(m.variant)
        elif local != m.version:
            report.stale[m.variant] = (m.version, local)
    # Winners are not taken from the document: each touched shape is re-decided below from the
    # merged measurements, so a kept local winner can never contradict newer imported timings.
    incoming = [(m.storage_key(), m.measured_at, m.model_dump_json(), Measurement) for m in ms]
    verdicts = [] if report.forced else list(doc.verdicts)
    report.verdicts_left = len(doc.verdicts) - len(verdicts)
    store = table.store
    with store.transaction():
        for key, at, text, model in incoming:
            raw = store.get(key)
            current = None
            if raw is not None:
                try:
                    current = model.model_validate_json(raw)
                except ValidationError:
                    current = None  # an unreadable local row loses to a valid one
            if current is not None:
                mine = current.measured_at if isinstance(current, Measurement) else current.decided_at
                if mine >= at:
                    report.kept += 1
                    continue
                report.updated += 1
            else:
                report.added += 1
            store.set(key, text)
        for v in verdicts:
            if v.passed and v.cases < 1:  # a pass that ran nothing is no qualification
                report.verdicts_empty += 1
                continue
            mine = parse_verdict(store.get(v.storage_key()))
            # A failure seen here stands: a pass from elsewhere does not clear a kernel that was
            # wrong on this machine (same fingerprint or not, its hardware may differ in flags).
            if mine is not None and (mine.version, mine.suite) == (v.version, v.suite) and not mine.passed \
                    and v.passed:
                continue
            if mine is None or mine.qualified_at < v.qualified_at:
                store.set(v.storage_key(), v.model_dump_json())
                report.verdicts += 1
    table.forget()
    for group, shape in dict.fromkeys((m.group, m.shape) for m in ms):
        table.decide_winner(ours_id, group, shape, versions, DEFAULT_MARGIN)
    if ms:
        table.prepare(versions, ours_id)
    return report


def import_table(table: CalibrationTable, versions: dict[tuple[str, str], str], path: str | os.PathLike[str],
                 force: bool = False, device: str = "cpu") -> ImportReport:
    """Validate the document at ``path``, then merge it into ``table`` (newer wins)."""
    return import_document(read_document(path), table, versions, force=force, device=device, source=str(path))
