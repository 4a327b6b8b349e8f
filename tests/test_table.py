"""The calibration table on disk: its rows are JSON and never unpickled, corruption and a busy
or read-only database are told apart, concurrent and killed writers leave a readable table, each
device fingerprint has its own index, a decision reads one snapshot row, older schemas are
migrated, documents are exchanged; and in a pre-fork server (the parent opened the table, a
forked child wrote to it, then the parent wrote again) every row survives, and a new process
reads it.

The fork runs in a script of its own, as a server would run it, not inside pytest: a child of
pytest would inherit its capture, fixtures and threads. The child writes through the table (or
recorder) object it inherited, so the connection opened before the fork is the one at stake.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers.calibration import QUICK, conv_call, fpid, group, measurement, run
from helpers.variants import variant

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.store import CalibrationWarning
from kernel_variants._table.table import SCHEMA, CalibrationTable

FN = "causal_conv1d_fn"
SHAPES = [(1, 16, 8), (2, 32, 16)]
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")


def test_a_corrupt_table_is_moved_aside_and_the_op_keeps_working(tmp_path, monkeypatch):
    cache = tmp_path / "corrupt"
    cache.mkdir()
    (cache / "cache.db").write_bytes(b"this is not a database" * 100)
    monkeypatch.setenv("KV_CACHE_DIR", str(cache))
    kv.reload()
    args, kw = conv_call()
    with pytest.warns(CalibrationWarning, match="corrupt.*moved to"):
        out = kv.causal_conv1d_fn(*args, **kw)
    assert out.shape == args[0].shape
    assert any(p.name.startswith("corrupt.corrupt-") for p in tmp_path.iterdir())
    kv.calibrate(FN, SHAPES[:1], variants=["reference"], **QUICK)
    assert len(kv.table(FN)) == 1


def test_a_truncated_table_is_moved_aside(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_CACHE_DIR", str(tmp_path / "t"))
    kv.reload()
    kv.calibrate(FN, SHAPES, variants=["reference"], **QUICK)
    db = tmp_path / "t" / "cache.db"
    db.write_bytes(db.read_bytes()[:1000])
    kv.reload()
    with pytest.warns(CalibrationWarning, match="corrupt"):
        rows = kv.table(FN)
    assert rows == []


def test_an_unusable_directory_keeps_the_table_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KV_CACHE_DIR", str(blocker / "cache"))
    kv.reload()
    with pytest.warns(CalibrationWarning, match="not usable.*in memory"):
        kv.calibrate(FN, SHAPES[:1], variants=["reference"], **QUICK)
    assert dispatcher().table.in_memory
    assert kv.table(FN)[0].winner == "reference"


def _open_files_under(folder) -> list[str]:
    fds = "/proc/self/fd"
    return [t for t in (os.path.realpath(f"{fds}/{fd}") for fd in os.listdir(fds)) if t.startswith(str(folder))]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_reload_lets_go_of_the_previous_table_file(tmp_path, monkeypatch):
    # A benchmark measures into a throwaway table and removes its folder; a server reloads on a
    # signal: neither may keep the old database open (one connection leaked per reload).
    monkeypatch.setenv("KV_CACHE_DIR", str(tmp_path / "first"))
    monkeypatch.setenv("KV_RECORD", "1")  # the record of uncalibrated calls, beside the table
    kv.reload()
    kv.calibrate(FN, SHAPES[:1], variants=["reference"], **QUICK)
    args, kw = conv_call()
    kv.causal_conv1d_fn(*args, **kw)
    assert len(kv.recorded()) == 1
    assert len(_open_files_under(tmp_path / "first")) >= 2
    monkeypatch.setenv("KV_CACHE_DIR", str(tmp_path / "second"))
    kv.reload()
    assert _open_files_under(tmp_path / "first") == []
    assert len(kv.table(FN)) == 0  # the new dispatcher reads its own table


def test_a_pickled_row_is_never_unpickled(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    t.record(measurement("a", 100.0, "1"))
    marker = tmp_path / "pwned"
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    con = sqlite3.connect(tmp_path / "t" / "cache.db")
    con.execute(
        "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, filename, value)"
        " VALUES (?, 0, 0, NULL, 0, 0, NULL, 0, 4, NULL, ?)", (sqlite3.Binary(payload), sqlite3.Binary(payload)))
    con.execute(
        "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, filename, value)"
        " VALUES ('m|x', 1, 0, NULL, 0, 0, NULL, 0, 4, NULL, ?)", (sqlite3.Binary(payload),))
    con.commit()
    con.close()
    t = CalibrationTable(tmp_path / "t")
    with pytest.warns(CalibrationWarning, match="2 entries unreadable or malformed"):
        rows, _ = t.measurements({(FN, "a"): "1"}, fpid())
    assert not marker.exists()
    assert set(rows[(group(), (1, 16, 8))]) == {"a"}


_WORKER = textwrap.dedent("""
    import sys, kernel_variants as kv
    seed = int(sys.argv[1])
    shapes = [(1 + (seed + i) % 3, 16, 4 + i) for i in range(6)]
    kv.calibrate("causal_conv1d_fn", shapes, dtype="float32", timing=kv.TimingConfig(warmup=1, windows=1, iters=2),
                 progress=lambda p: print(p.done, flush=True))
""")


def _worker_env(cache):
    return {**os.environ, "KV_CACHE_DIR": str(cache), "PYTHONWARNINGS": "error::UserWarning"}


def test_four_processes_calibrating_into_one_table(tmp_path):
    cache = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(i)], env=_worker_env(cache),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    t = CalibrationTable(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows, winners = t.measurements(dispatcher().versions(), fpid())
    expected = {(1 + (s + i) % 3, 16, 4 + i) for s in range(4) for i in range(6)}
    assert {shape for (_, shape) in rows} == expected
    runnable = {rv.id for rv in kv.variants(FN) if rv.unavailable_reason() is None}
    assert all(set(by_v) == runnable for by_v in rows.values())
    assert {shape for (_, shape) in winners} == expected


def test_a_process_killed_mid_calibration_leaves_a_readable_table(tmp_path):
    cache = tmp_path / "killed"
    with subprocess.Popen([sys.executable, "-c", _WORKER, "0"], env=_worker_env(cache),
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as p:
        for line in p.stdout:
            if int(line) >= 5:
                p.send_signal(signal.SIGKILL)
                break
        p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    t = CalibrationTable(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows, _ = t.measurements(dispatcher().versions(), fpid())
    measured = sum(len(v) for v in rows.values())
    runnable = sum(1 for rv in kv.variants(FN) if rv.unavailable_reason() is None)
    assert 4 <= measured < 6 * runnable


def test_values_on_disk_are_json(tmp_path, monkeypatch):
    kv.calibrate(FN, SHAPES[:1], variants=["reference"], **QUICK)
    con = sqlite3.connect(os.path.join(os.environ["KV_CACHE_DIR"], "cache.db"))
    modes = {row[0] for row in con.execute("SELECT mode FROM Cache")}
    values = [row[0] for row in con.execute("SELECT value FROM Cache")]
    con.close()
    assert modes == {1}  # diskcache's raw mode: inline text, no pickle
    assert all(isinstance(json.loads(v), dict) for v in values)


def test_import_re_decides_winners_from_the_merged_timings(with_variants):
    """A newer imported timing that dethrones the local winner wins, whatever the winner rows say."""
    from kernel_variants._table.exchange import build_document, import_document

    with_variants(variant("a", varlen=True), variant("b", varlen=True))
    versions = dispatcher().versions()
    va, vb = versions[(FN, "a")], versions[(FN, "b")]
    t = dispatcher().table
    t.record(measurement("a", 100.0, va))
    t.record(measurement("b", 50.0, vb))
    assert t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02).variant == "b"
    doc = build_document(t, "cpu").model_copy(update={"measurements": [measurement("b", 500.0, vb)]})
    import_document(doc, t, versions)
    _, winners = t.measurements(versions, fpid())
    assert winners[(group(), (1, 16, 8))].variant == "a"


def test_a_row_naming_a_file_never_makes_the_table_delete_it(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    t.record(measurement("a", 100.0, "1"))
    victim = tmp_path / "victim" / "important"
    victim.parent.mkdir()
    victim.write_text("keep me")
    con = sqlite3.connect(tmp_path / "t" / "cache.db")
    con.execute(
        "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, filename, value)"
        " VALUES ('m|x|causal_conv1d_fn|y', 1, 0, NULL, 0, 0, NULL, 0, 2, ?, NULL)", (str(victim),))
    con.commit()
    con.close()
    t.clear(FN)  # deletes the planted row; diskcache would delete the file a row names with it
    assert victim.read_text() == "keep me"


def test_a_busy_table_is_not_called_corrupt(tmp_path):
    from kernel_variants._table.store import is_corrupt

    assert not is_corrupt(sqlite3.OperationalError("database is locked"))
    assert not is_corrupt(sqlite3.OperationalError("attempt to write a readonly database"))
    assert is_corrupt(sqlite3.DatabaseError("file is not a database"))


def test_a_cache_path_with_uri_characters_works(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_CACHE_DIR", str(tmp_path / "odd #1 ?x %20"))
    kv.reload()
    kv.calibrate(FN, SHAPES[:1], variants=["reference"], **QUICK)
    kv.reload()
    assert [r.shape for r in kv.table(FN)] == [SHAPES[0]]
    assert not any(".corrupt-" in p.name for p in tmp_path.iterdir())


def test_each_device_fingerprint_has_its_own_index(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    t.record(measurement("a", 100.0, "1"))
    t.record(measurement("a", 7.0, "1", shape=(2, 16, 8), fp="other-device"))
    versions = {(FN, "a"): "1"}
    with pytest.warns(CalibrationWarning):
        mine, _ = t.measurements(versions, fpid())
    with pytest.warns(CalibrationWarning):
        other, _ = t.measurements(versions, "other-device")
    assert [s for _, s in mine] == [(1, 16, 8)] and [s for _, s in other] == [(2, 16, 8)]


def test_a_table_written_by_the_previous_release_is_migrated_not_mixed():
    """Schema 1 kept causal_conv1d's flags inline in the group and keyed rows by another slug:
    such rows are read, rewritten under the new key, and the old rows go."""
    kv.calibrate(FN, SHAPES[:1], variants=["reference"], **QUICK)
    table = dispatcher().table
    (key, raw), = [(k, r) for k, r in table.store.items() if k.startswith("m|")]
    doc = json.loads(raw)
    group = doc["group"]
    old_group = {"op": group["op"], "dtype": group["dtype"], **dict(group["features"])}
    old = {**doc, "schema_version": 1, "group": old_group}
    old_key = (f"m|{doc['fingerprint_id']}|{FN}|float32|W4|silu|bs|"
               f"{','.join(map(str, doc['shape']))}|reference")
    table.store.delete(key)
    table.store.set(old_key, json.dumps(old))
    table.forget()
    kv.reload()
    row = kv.table(FN)[0]
    assert row.times_us["reference"] == doc["best_us"]
    keys = [k for k, _ in dispatcher().table.store.items() if k.startswith("m|")]
    assert keys == [key], "the old row was rewritten under the new key, and only once"
    assert json.loads(dispatcher().table.store.get(key))["schema_version"] == SCHEMA


def test_a_read_only_table_is_read_and_new_measurements_stay_in_memory(monkeypatch):
    """A table shipped read-only (an image, a shared mount) is still the table: its rows decide.
    (Tests run as root, whom file modes do not stop, so the refused write is simulated where
    diskcache would meet it.)"""
    from kernel_variants._table.store import Store

    kv.calibrate(FN, SHAPES, **QUICK)
    winner = {r.shape: r.winner for r in kv.table(FN)}[SHAPES[0]]

    def refuse(self):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(Store, "_connect", refuse)
    kv.reload()
    with pytest.warns(CalibrationWarning, match="not usable.*read-only") as caught:
        with kv.force(causal_conv1d_fn="reference"):
            pass
        rows = kv.table(FN)
    assert len(caught) == 1
    assert {r.shape for r in rows} == set(SHAPES) and dispatcher().table.store.read_only
    x = torch.randn(*SHAPES[0][:1], SHAPES[0][2], SHAPES[0][1])
    decision = kv.explain(FN, x, torch.randn(SHAPES[0][1], 4), torch.randn(SHAPES[0][1]),
                          conv_states=torch.zeros(3, 3, SHAPES[0][1]), activation="silu")
    assert decision.source == "table" and decision.chosen.id == winner
    kv.calibrate(FN, [(3, 8, 4)], variants=["reference"], **QUICK)  # writes go to memory, no error
    assert (3, 8, 4) in {r.shape for r in kv.table(FN)}


def test_decisions_read_one_snapshot_row_which_any_write_makes_out_of_date(reference_only, monkeypatch):
    """At scale, a fresh process's first decision reads the snapshot the calibration
    left, not every row; a write renews the table's token, so a stale or planted snapshot is
    rebuilt from the rows, never trusted. (tools/bench_table_scale.py times it at 5000 shapes.)"""
    from kernel_variants._table.index import SNAPSHOT_PREFIX

    kv.calibrate(FN, SHAPES, **QUICK)
    args, kw = conv_call(*SHAPES[1])
    expected = kv.explain(FN, *args, **kw)
    scans = []
    real_scan = CalibrationTable._scan
    monkeypatch.setattr(CalibrationTable, "_scan", lambda self, fp: scans.append(fp) or real_scan(self, fp))
    kv.reload()
    again = kv.explain(FN, *args, **kw)
    assert again.chosen.id == expected.chosen.id and again.source == "table" and scans == []
    snapshot_key = next(k for k, _ in dispatcher().table.store.items() if k.startswith(SNAPSHOT_PREFIX))
    kv.calibrate(FN, [(3, 8, 4)], **QUICK)  # a write: the token changes, calibration leaves a new snapshot
    kv.reload()
    dispatcher().table.store.set(snapshot_key, '{"format": 2, "token": "forged", "groups": {}}')
    decision = kv.explain(FN, *args, **kw)
    assert decision.source == "table" and len(scans) >= 1, "a snapshot of another token was trusted"


def test_a_document_of_an_earlier_release_is_refused_saying_why(capsys, tmp_path):
    kv.calibrate(FN, [(1, 16, 8)], variants=["reference"], **QUICK)
    path = tmp_path / "t.json"
    assert run(capsys, "export", str(path))[0] == 0
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 2
    path.write_text(json.dumps({**doc, "schema_version": 1}))
    rc, _, err = run(capsys, "import", str(path))
    assert rc == 2 and "written by an earlier kernel_variants release" in err


# ---- a pre-fork server

# Runs ``body`` in a forked child, which exits 0 only when it completed; a failure's traceback
# reaches the script's stderr, and a child that hangs dies of SIGALRM instead of hanging the test.
_FORK = textwrap.dedent("""
    import os, signal, traceback

    def in_child(body):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(120)
                body()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        return pid

    def joined(pid):
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        assert code == 0, f"the forked child failed (exit {code})"
""")


def _run(code: str, *args: str, cache, warnings_are_errors: bool = True) -> str:
    env = {**os.environ, "KV_CACHE_DIR": str(cache)}
    if warnings_are_errors:  # a table that had to be rebuilt, moved aside or kept in memory warns
        env["PYTHONWARNINGS"] = "error::UserWarning"
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# The table itself, under one fingerprint id, so that only storage decides what survives. The
# child and the parent also write at the same time, through connections opened before the fork.
_TABLE_WRITERS = _FORK + textwrap.dedent("""
    import sys, time
    from kernel_variants._table.table import CalibrationTable, Group, Measurement

    FP = "f" * 16
    GROUP = Group(op="causal_conv1d_fn", dtype="float32")
    VERSIONS = {("causal_conv1d_fn", "reference"): "1"}

    def write(table, shape):
        m = Measurement(fingerprint={"device": "cpu"}, fingerprint_id=FP, group=GROUP, shape=shape,
                        variant="reference", version="1", status="ok", best_us=float(sum(shape)),
                        measured_at=time.time())
        table.store_results([m], VERSIONS, 0.02)
        table.prepare(VERSIONS, FP)  # the snapshot, as a calibration stores it

    table = CalibrationTable(sys.argv[1])
    write(table, (1, 1, 1))
    child = in_child(lambda: [write(table, (2, 2, i)) for i in range(1, 9)])
    for i in range(1, 9):
        write(table, (3, 3, i))
    joined(child)
    write(table, (4, 4, 4))
""")

_TABLE_READER = textwrap.dedent("""
    import json, sys
    from kernel_variants._table.index import SNAPSHOT_PREFIX, TOKEN_KEY, decode
    from kernel_variants._table.table import CalibrationTable

    FP = "f" * 16
    VERSIONS = {("causal_conv1d_fn", "reference"): "1"}
    table = CalibrationTable(sys.argv[1])
    # The snapshot a decision reads, and whether it was current (else it was rebuilt from rows).
    current = decode(table.store.get(SNAPSHOT_PREFIX + FP), table.store.get(TOKEN_KEY)) is not None
    (group,) = table._fast_index(VERSIONS, FP).groups.values()
    rows, winners = table.measurements(VERSIONS, FP)
    print(json.dumps({"snapshot_current": current, "decided": sorted(group.times),
                      "winners": sorted(group.winners), "rows": sorted(s for _, s in rows),
                      "winner_rows": sorted(s for _, s in winners)}))
""")


@needs_fork
def test_rows_of_a_forked_child_survive_the_parents_writes(tmp_path):
    cache = tmp_path / "table"
    _run(_TABLE_WRITERS, str(cache), cache=cache)
    seen = json.loads(_run(_TABLE_READER, str(cache), cache=cache))
    expected = sorted([[1, 1, 1], [4, 4, 4], *([2, 2, i] for i in range(1, 9)), *([3, 3, i] for i in range(1, 9))])
    assert seen["snapshot_current"], "the parent's last write left no current snapshot"
    assert seen["decided"] == seen["winners"] == expected
    assert seen["rows"] == seen["winner_rows"] == expected


# The public API, as a pre-fork server calls it. One intra-op thread from the start: the at-fork
# handler then leaves the child's thread count (part of a CPU fingerprint) as the parent's, so
# that every row is of one fingerprint, and the reader runs one thread too.
_CALIBRATE = textwrap.dedent(f"""
    import kernel_variants as kv
    from kernel_variants import TimingConfig

    QUICK = {QUICK | dict(variants=["reference"])!r}

    def calibrate(shape):
        kv.calibrate("causal_conv1d_fn", [shape], **QUICK)
""")

_PUBLIC_WRITERS = _FORK + _CALIBRATE + textwrap.dedent("""
    import torch
    torch.set_num_threads(1)
    calibrate((1, 16, 4))
    joined(in_child(lambda: calibrate((1, 16, 8))))
    calibrate((1, 16, 12))
""")

_PUBLIC_READER = textwrap.dedent("""
    import json, sys, torch, warnings
    import kernel_variants as kv
    torch.set_num_threads(int(sys.argv[1]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", kv.CalibrationWarning)
        shapes = sorted(r.shape for r in kv.table("causal_conv1d_fn") if r.winner)
    print(json.dumps({"shapes": shapes, "warnings": [str(w.message) for w in caught]}))
""")


@needs_fork
def test_a_forked_childs_calibration_is_read_by_a_new_process(tmp_path):
    cache = tmp_path / "kv"
    _run(_PUBLIC_WRITERS, cache=cache)
    assert json.loads(_run(_PUBLIC_READER, "1", cache=cache)) == {
        "shapes": [[1, 16, 4], [1, 16, 8], [1, 16, 12]], "warnings": []}


# As a server runs by default: the child may run fewer threads than the parent (with GNU
# OpenMP the at-fork handler sets it to one), and timings taken with one thread count are
# filed under that count's fingerprint. The child's row is then read at the child's count, the
# parent's at the parent's; each survives the other's writes.
_DEFAULT_WRITERS = _FORK + _CALIBRATE + textwrap.dedent("""
    import json, sys, torch, warnings
    # Each process meets the other's rows as another fingerprint's, with a warning naming them.
    warnings.filterwarnings("ignore", "calibration table: ignoring entries", kv.CalibrationWarning)

    def child():
        with open(sys.argv[1], "w") as f:
            json.dump(torch.get_num_threads(), f)
        calibrate((1, 16, 8))

    calibrate((1, 16, 4))
    joined(in_child(child))
    calibrate((1, 16, 12))
    print(torch.get_num_threads())
""")


@needs_fork
def test_a_forked_child_on_fewer_threads_keeps_its_rows_under_its_own_fingerprint(tmp_path):
    cache = tmp_path / "kv"
    child_threads_file = tmp_path / "child-threads.json"
    parent_threads = int(_run(_DEFAULT_WRITERS, str(child_threads_file), cache=cache, warnings_are_errors=False))
    child_threads = json.loads(child_threads_file.read_text())
    at_child = json.loads(_run(_PUBLIC_READER, str(child_threads), cache=cache, warnings_are_errors=False))
    at_parent = json.loads(_run(_PUBLIC_READER, str(parent_threads), cache=cache, warnings_are_errors=False))
    if child_threads == parent_threads:
        assert at_child == at_parent == {"shapes": [[1, 16, 4], [1, 16, 8], [1, 16, 12]], "warnings": []}
        return
    assert at_child["shapes"] == [[1, 16, 8]] and at_parent["shapes"] == [[1, 16, 4], [1, 16, 12]]
    # Each reader is told where the other's rows are: this CPU, another thread count.
    assert at_child["warnings"] == [_THREADS_WARNING.format(n=2, threads=child_threads)]
    assert at_parent["warnings"] == [_THREADS_WARNING.format(n=1, threads=parent_threads)]


_THREADS_WARNING = ("calibration table: ignoring entries: {n} measured on this CPU with another intra-op thread "
                    "count (this process runs {threads}; a forked child runs one)")


@needs_fork
def test_rows_of_this_cpu_at_another_thread_count_are_named_as_such(tmp_path):
    from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
    from kernel_variants._table.rows import Group, Measurement
    from kernel_variants._table.store import CalibrationWarning
    from kernel_variants._table.table import CalibrationTable

    here = fingerprint("cpu")
    elsewhere = {**here, "threads": str(int(here["threads"]) + 1)}
    group = Group(op="causal_conv1d_fn", dtype="float32")
    versions = {("causal_conv1d_fn", "reference"): "1"}
    table = CalibrationTable(tmp_path / "t")
    for fp in (elsewhere, {**here, "name": "another cpu"}):
        table.record(Measurement(fingerprint=fp, fingerprint_id=fingerprint_id(fp), group=group, shape=(1, 16, 8),
                                 variant="reference", version="1", status="ok", best_us=1.0, measured_at=0.0))
    want = ("1 measured on this CPU with another intra-op thread count (this process runs "
            f"{here['threads']}; a forked child runs one); 1 measured on another device or software stack")
    # The full load, the load that stores a snapshot, and one that reads that snapshot back.
    loads = [lambda t: t.measurements(versions, fingerprint_id(here)),
             lambda t: t.prepare(versions, fingerprint_id(here)),
             lambda t: t.prepare(versions, fingerprint_id(here))]
    for load in loads:
        with pytest.warns(CalibrationWarning) as caught:
            load(CalibrationTable(tmp_path / "t"))
        assert [want in str(w.message) for w in caught] == [True]


# KV_RECORD's record: the child adds through the recorder it inherited, at the same time as the
# parent, then the parent adds again.
_RECORD_WRITERS = _FORK + textwrap.dedent("""
    import sys
    from kernel_variants._table.store import Recorder

    rec = Recorder(sys.argv[1])
    assert rec.add("parent-0", {"n": 0}) == "added"
    child = in_child(lambda: [rec.add(f"child-{i}", {"n": i}) for i in range(8)])
    for i in range(1, 9):
        rec.add(f"parent-{i}", {"n": i})
    joined(child)
    assert rec.add("parent-last", {"n": -1}) == "added"
""")

_RECORD_READER = textwrap.dedent("""
    import json, sys
    from kernel_variants._table.store import Recorder
    print(json.dumps(sorted(e["id"] for e in Recorder(sys.argv[1]).entries(pending_only=True))))
""")


@needs_fork
def test_keys_recorded_by_a_forked_child_survive_the_parents_records(tmp_path):
    where = tmp_path / "record"
    _run(_RECORD_WRITERS, str(where), cache=tmp_path / "kv")
    ids = json.loads(_run(_RECORD_READER, str(where), cache=tmp_path / "kv"))
    assert ids == sorted(["parent-last", *(f"parent-{i}" for i in range(9)), *(f"child-{i}" for i in range(8))])


# ---- rows of another kind of CPU, and of before the CPU's kind was kept


def test_rows_of_another_cpu_kind_are_ignored_naming_both_cpus(tmp_path):
    from kernel_variants._table.fingerprint import describe_cpu, fingerprint, fingerprint_id
    from kernel_variants._table.rows import Group, Measurement

    here = fingerprint("cpu")
    zen4 = {**here, "vendor": "AuthenticAMD", "family": "25", "model": "17", "isa": "avx512-bf16"}
    capped = {**here, "isa": "avx2" if here["isa"] != "avx2" else "avx512"}  # this CPU under another cap
    group = Group(op=FN, dtype="float32")
    versions = {(FN, "reference"): "1"}
    table = CalibrationTable(tmp_path / "t")
    for i, fp in enumerate((zen4, zen4, capped)):
        table.record(Measurement(fingerprint=fp, fingerprint_id=fingerprint_id(fp), group=group, shape=(1, 16, 8 + i),
                                 variant="reference", version="1", status="ok", best_us=1.0, measured_at=0.0))
    kinds = sorted([(describe_cpu(capped), 1), ("AuthenticAMD family 25 model 17 stepping 1 avx512-bf16", 2)])
    want = (f"rows measured on another CPU ({', '.join(f'{n} on {kind}' for kind, n in kinds)}) ignored here: "
            f"this CPU is {describe_cpu(here)}")
    # The full load, the load that stores a snapshot, and one that reads that snapshot back.
    for load in (lambda t: t.measurements(versions, fingerprint_id(here)),
                 lambda t: t.prepare(versions, fingerprint_id(here)),
                 lambda t: t.prepare(versions, fingerprint_id(here))):
        with pytest.warns(CalibrationWarning) as caught:
            load(CalibrationTable(tmp_path / "t"))
        assert [want in str(w.message) for w in caught] == [True], [str(w.message) for w in caught]
    with pytest.warns(CalibrationWarning):
        assert CalibrationTable(tmp_path / "t").measurements(versions, fingerprint_id(here)) == ({}, {})


def test_rows_and_verdicts_of_before_the_cpu_kind_are_stale_with_one_warning(reference_only, capsys):
    """A row of the old four-field CPU fingerprint cannot say which ISA level measured it: it is
    not used, `kv calibrate --stale` re-measures it (and drops it); a verdict of then is dropped
    (the variant qualifies again). One warning says both."""
    from kernel_variants._table.fingerprint import CPU_KIND, fingerprint_id
    from kernel_variants._table.rows import Verdict, verdict_fingerprint

    kv.calibrate(FN, [(1, 16, 8)], **QUICK)
    table = dispatcher().table
    (key, raw), = [(k, r) for k, r in table.store.items() if k.startswith("m|")]
    doc = json.loads(raw)
    old_fp = {k: v for k, v in doc["fingerprint"].items() if k not in CPU_KIND}
    assert sorted(old_fp) == ["device", "machine", "name", "threads"]
    old_id = fingerprint_id(old_fp)
    table.store.delete(key)
    table.store.set(key.replace(doc["fingerprint_id"], old_id), json.dumps({**doc, "fingerprint": old_fp,
                                                                           "fingerprint_id": old_id}))
    for k, _ in list(table.store.items()):
        if k.startswith("w|"):
            table.store.delete(k)
    old_vfp = verdict_fingerprint(old_fp)
    verdict = Verdict(fingerprint=old_vfp, fingerprint_id=fingerprint_id(old_vfp), group=group(), variant="cpu_native",
                      version="1", passed=True, cases=3, qualified_at=0.0)
    table.store.set(verdict.storage_key(), verdict.model_dump_json())
    kv.reload()
    with pytest.warns(CalibrationWarning) as caught:
        assert kv.table(FN) == []
    (message,) = [str(w.message) for w in caught]
    assert "1 measured on a CPU of this one's name by an earlier kernel_variants release, which did not record " \
           "its model and ISA level" in message and "1 qualification verdicts of that release, dropped" in message
    assert "`kv calibrate --stale` re-measures them" in message and "another device" not in message
    assert dispatcher().table.store.get(verdict.storage_key()) is None
    args, kw = conv_call(1, 16, 8)
    assert kv.explain(FN, *args, **kw).source == "priority"  # never read as this CPU's
    rc, out, _ = run(capsys, "table", "--stale")
    assert rc == 0 and "did not record the CPU's model and ISA level" in out
    rc, _, err = run(capsys, "calibrate", "--stale", "--warmup", "1", "--windows", "2", "--iters", "2", "-q")
    assert rc == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r.winner for r in kv.table(FN)] == ["reference"]
        assert kv.explain(FN, *args, **kw).source == "table"
    assert not any(old_id in k for k, _ in dispatcher().table.store.items()), "the re-measured row was dropped"
