"""Issue 23, item 7: in a pre-fork server (the parent opened the table, a forked child wrote to
it, then the parent wrote again) every row survives, and a new process reads it.

The fork runs in a script of its own, as a server would run it, not inside pytest: a child of
pytest would inherit its capture, fixtures and threads. The child writes through the table (or
recorder) object it inherited, so the connection opened before the fork is the one at stake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

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


def test_rows_of_a_forked_child_survive_the_parents_writes(tmp_path):
    cache = tmp_path / "table"
    _run(_TABLE_WRITERS, str(cache), cache=cache)
    seen = json.loads(_run(_TABLE_READER, str(cache), cache=cache))
    expected = sorted([[1, 1, 1], [4, 4, 4], *([2, 2, i] for i in range(1, 9)), *([3, 3, i] for i in range(1, 9))])
    assert seen["snapshot_current"], "the parent's last write left no current snapshot"
    assert seen["decided"] == seen["winners"] == expected
    assert seen["rows"] == seen["winner_rows"] == expected


# The public API, as the issue describes it. One intra-op thread from the start: the at-fork
# handler then leaves the child's thread count (part of a CPU fingerprint) as the parent's, so
# that every row is of one fingerprint, and the reader runs one thread too.
_CALIBRATE = textwrap.dedent("""
    import kernel_variants as kv

    QUICK = dict(dtype="float32", timing=kv.TimingConfig(warmup=1, windows=1, iters=2), variants=["reference"])

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


def test_rows_of_this_cpu_at_another_thread_count_are_named_as_such(tmp_path):
    from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
    from kernel_variants._table.store import CalibrationWarning
    from kernel_variants._table.table import CalibrationTable, Group, Measurement

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


def test_keys_recorded_by_a_forked_child_survive_the_parents_records(tmp_path):
    where = tmp_path / "record"
    _run(_RECORD_WRITERS, str(where), cache=tmp_path / "kv")
    ids = json.loads(_run(_RECORD_READER, str(where), cache=tmp_path / "kv"))
    assert ids == sorted(["parent-last", *(f"parent-{i}" for i in range(9)), *(f"child-{i}" for i in range(8))])
