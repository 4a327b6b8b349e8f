"""Calibration: correctness before speed, per-variant storage, stable winners, table lookup, and
the faults a shared on-disk table meets (corruption, no write access, concurrency, kills)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.store import CalibrationWarning
from kernel_variants._table.table import SCHEMA, CalibrationTable, Group, Measurement
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.plugin import Variant

FN = "causal_conv1d_fn"
QUICK = dict(dtype="float32", timing=kv.TimingConfig(warmup=1, windows=2, iters=3))
SHAPES = [(1, 16, 8), (2, 32, 16)]


def _slow(seconds):
    def fn(*args, **kwargs):
        time.sleep(seconds)
        return reference.causal_conv1d_fn(*args, **kwargs)
    return fn


def _variant(vid, fn, version="1", priority=0):
    return Variant(id=vid, op=FN, version=version, priority=priority, fn=fn,
                   capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, varlen=True))


def _call(b=2, d=32, seq=16):
    return (torch.randn(b, seq, d), torch.randn(d, 4), torch.randn(d)), dict(
        conv_states=torch.randn(b, 3, d), activation="silu")


def test_calibration_records_figures_and_dispatch_follows_the_table(reference_only, with_variants):
    with_variants(_variant("sleepy", _slow(0.002), priority=100))
    result = kv.calibrate(FN, SHAPES, variants=["reference", "sleepy"], prune=None, **QUICK)
    by = {(m.shape, m.variant): m for m in result.measurements}
    m = by[((2, 32, 16), "reference")]
    assert m.status == "ok" and m.best_us > 0 and m.median_us >= m.best_us
    assert m.windows == 2 and m.iters == 3 and m.measured_at <= time.time()
    assert by[((2, 32, 16), "sleepy")].best_us > 2000
    assert all(w.variant == "reference" for w in result.winners.values())
    args, kw = _call()
    decision = kv.explain(FN, *args, **kw)
    assert (decision.chosen.id, decision.source) == ("reference", "table"), str(decision)
    assert "sleepy" in str(decision) and "x the winner" in str(decision)
    rows = kv.table(FN)
    assert [r.shape for r in rows] == SHAPES and rows[0].winner == "reference" and rows[0].margin > 1


def test_unseen_shape_uses_the_nearest_calibrated_shape_in_log_space(reference_only, with_variants):
    with_variants(_variant("sleepy", _slow(0.002), priority=100))
    kv.calibrate(FN, [(1, 16, 8), (8, 128, 64)], variants=["reference", "sleepy"], dtype="float32", timing=kv.TimingConfig(warmup=1, windows=2, iters=1))
    args, kw = _call(b=2, d=32, seq=16)
    decision = kv.explain(FN, *args, **kw)
    assert decision.source == "nearest" and decision.measured_key == (1, 16, 8)


def test_without_any_measurement_priority_decides():
    args, kw = _call()
    assert kv.explain(FN, *args, **kw).source == "priority"


@pytest.mark.parametrize(
    ("name", "fn", "reason"),
    [
        ("off_by_one", lambda *a, **k: reference.causal_conv1d_fn(*a, **k) + 1, "output:"),
        ("nan", lambda *a, **k: reference.causal_conv1d_fn(*a, **k) * float("nan"), "NaN or Inf"),
        ("raises", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad kernel")), "raised RuntimeError: bad kernel"),
        ("into_copy", lambda x, w, b=None, *, conv_states=None, **k: reference.causal_conv1d_fn(
            x, w, b, conv_states=None if conv_states is None else conv_states.clone(), **k), "conv_states:"),
    ],
)
def test_a_wrong_variant_is_rejected_with_its_reason_and_never_chosen(reference_only, with_variants, name, fn, reason):
    with_variants(_variant(name, fn, priority=100))
    result = kv.calibrate(FN, SHAPES[:1], **QUICK)
    rejected = {m.variant: m.reason for m in result.rejected()}
    assert reason in rejected[name]
    assert result.winners[SHAPES[0]].variant != name
    args, kw = _call(*SHAPES[0])
    assert kv.explain(FN, *args, **kw).chosen.id != name
    assert name in kv.table(FN)[0].rejected


def test_a_new_variant_needs_only_itself_measured(with_variants):
    kv.calibrate(FN, SHAPES, variants=["reference"], **QUICK)
    first = {m.variant: m.measured_at for m in dispatcher().table.measurements(dispatcher().versions(), _fpid())[0][(_group(), SHAPES[0])].values()}
    with_variants(_variant("newcomer", reference.causal_conv1d_fn))
    kv.calibrate(FN, SHAPES, variants=["newcomer"], **QUICK)
    row = kv.table(FN)[0]
    assert set(row.times_us) == {"reference", "newcomer"}
    after = dispatcher().table.measurements(dispatcher().versions(), _fpid())[0][(_group(), SHAPES[0])]
    assert after["reference"].measured_at == first["reference"], "the reference was not re-measured"


def _fpid():
    from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
    return fingerprint_id(fingerprint("cpu"))


def _group(**kw):
    base = dict(op=FN, dtype="float32", width=4, bias=True, activation="silu", states=True, varlen=False, spec=False)
    return Group(**(base | kw))


def _m(variant, us, version, shape=(1, 16, 8), fp=None):
    from kernel_variants._table.fingerprint import fingerprint
    return Measurement(fingerprint=fingerprint("cpu"), fingerprint_id=fp or _fpid(), group=_group(), shape=shape,
                       variant=variant, version=version, status="ok", best_us=us, median_us=us, spread=0.0,
                       windows=5, iters=100, method="test", measured_at=time.time())


def test_a_challenger_must_beat_the_winner_by_the_margin(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    versions = {(FN, "a"): "1", (FN, "b"): "1"}
    t.record(_m("a", 100.0, "1"))
    assert t.decide_winner(_fpid(), _group(), (1, 16, 8), versions, 0.02).variant == "a"
    t.record(_m("b", 99.0, "1"))  # 1% faster: noise on a shared machine
    assert t.decide_winner(_fpid(), _group(), (1, 16, 8), versions, 0.02).variant == "a"
    t.record(_m("b", 90.0, "1"))  # 10% faster: a real win
    assert t.decide_winner(_fpid(), _group(), (1, 16, 8), versions, 0.02).variant == "b"
    t.record(_m("a", 89.0, "1"))  # and back only by more than the margin
    assert t.decide_winner(_fpid(), _group(), (1, 16, 8), versions, 0.02).variant == "b"


def test_stale_versions_and_other_devices_are_ignored_with_one_warning(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    t.record(_m("a", 100.0, "1+old"))
    t.record(_m("b", 50.0, "1", fp="another-device"))
    t.record(_m("c", 70.0, "1"))
    versions = {(FN, "a"): "1+new", (FN, "b"): "1", (FN, "c"): "1"}
    with pytest.warns(CalibrationWarning) as caught:
        rows, _ = t.measurements(versions, _fpid())
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "variant 'a' changed since it was measured (version 1+old -> 1+new)" in msg
    assert "1 measured on another device or software stack" in msg
    assert set(rows[(_group(), (1, 16, 8))]) == {"c"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.measurements(versions, _fpid())  # the same load again: no second warning


def test_editing_a_kernel_makes_its_timings_stale(with_variants):
    with_variants(_variant("mine", reference.causal_conv1d_fn, version="1"))
    kv.calibrate(FN, SHAPES[:1], variants=["mine"], **QUICK)
    with_variants(_variant("mine", reference.causal_conv1d_fn, version="2"))
    with pytest.warns(CalibrationWarning, match="variant 'mine' changed"):
        assert kv.table(FN) == []


def test_a_corrupt_table_is_moved_aside_and_the_op_keeps_working(tmp_path, monkeypatch):
    cache = tmp_path / "corrupt"
    cache.mkdir()
    (cache / "cache.db").write_bytes(b"this is not a database" * 100)
    monkeypatch.setenv("KV_CACHE_DIR", str(cache))
    kv.reload()
    args, kw = _call()
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


def test_a_pickled_row_is_never_unpickled(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    t.record(_m("a", 100.0, "1"))
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
        rows, _ = t.measurements({(FN, "a"): "1"}, _fpid())
    assert not marker.exists()
    assert set(rows[(_group(), (1, 16, 8))]) == {"a"}


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
        rows, winners = t.measurements(dispatcher().versions(), _fpid())
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
        rows, _ = t.measurements(dispatcher().versions(), _fpid())
    measured = sum(len(v) for v in rows.values())
    runnable = sum(1 for rv in kv.variants(FN) if rv.unavailable_reason() is None)
    assert 4 <= measured < 6 * runnable


def test_kv_tune_calibrates_an_unseen_shape_on_first_sight(monkeypatch):
    monkeypatch.setenv("KV_TUNE", "1")
    kv.reload()
    args, kw = _call(b=1, d=16, seq=4)
    kv.causal_conv1d_fn(*args, **kw)
    assert [r.shape for r in kv.table(FN)] == [(1, 16, 4)]
    assert kv.explain(FN, *args, **kw).source == "table"


def test_kv_tune_never_measures_while_compiling(monkeypatch):
    monkeypatch.setenv("KV_TUNE", "1")
    kv.reload()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    args, kw = _call(b=1, d=16, seq=4)
    assert kv.explain(FN, *args, **kw).source == "priority"
    assert kv.table(FN) == []


def test_clear_table_per_variant_and_op():
    kv.calibrate(FN, SHAPES, prune=None, **QUICK)
    assert kv.clear_table(FN, "torch_shift") == 2
    assert all("torch_shift" not in r.times_us and "reference" in r.times_us for r in kv.table(FN))
    kv.clear_table(FN)
    assert kv.table(FN) == []


def test_calibrate_refuses_bad_arguments():
    with pytest.raises(ValueError, match="shapes: expected"):
        kv.calibrate(FN, [(1, 2)], **QUICK)
    with pytest.raises(ValueError, match="variants: nope not registered"):
        kv.calibrate(FN, SHAPES, variants=["nope"], **QUICK)
    with pytest.raises(ValueError, match="dtype: expected"):
        kv.calibrate(FN, SHAPES, **(QUICK | {"dtype": "int8"}))
    with pytest.raises(ValueError, match="op must be one of"):
        kv.calibrate("conv2d", SHAPES, **QUICK)


def test_values_on_disk_are_json(tmp_path, monkeypatch):
    kv.calibrate(FN, SHAPES[:1], variants=["reference"], **QUICK)
    con = sqlite3.connect(os.path.join(os.environ["KV_CACHE_DIR"], "cache.db"))
    modes = {row[0] for row in con.execute("SELECT mode FROM Cache")}
    values = [row[0] for row in con.execute("SELECT value FROM Cache")]
    con.close()
    assert modes == {1}  # diskcache's raw mode: inline text, no pickle
    assert all(isinstance(json.loads(v), dict) for v in values)


def _counting(vid, fn, priority):
    calls = []

    def counted(*args, **kwargs):
        calls.append(vid)
        return fn(*args, **kwargs)

    return _variant(vid, counted, priority=priority), calls


def test_real_calls_follow_the_table_after_calibrate_and_clear(reference_only, with_variants):
    """Through the memo, not explain(): calibrating and clearing must change what a call runs."""
    slow, slow_calls = _counting("slow_but_preferred", _slow(0.003), priority=1000)
    fast, fast_calls = _counting("fast", reference.causal_conv1d_fn, priority=0)
    with_variants(slow, fast)
    args, kw = _call(*SHAPES[0])
    kv.causal_conv1d_fn(*args, **kw)
    assert slow_calls and not fast_calls, "without measurements the priority decides"
    kv.calibrate(FN, SHAPES[:1], variants=["slow_but_preferred", "fast"], **QUICK)
    slow_calls.clear()
    fast_calls.clear()
    kv.causal_conv1d_fn(*args, **kw)
    assert fast_calls == ["fast"] and not slow_calls, "the memoised decision survived calibration"
    kv.clear_table(FN)
    kv.causal_conv1d_fn(*args, **kw)
    assert slow_calls == ["slow_but_preferred"], "the memoised decision survived clear_table"


def test_import_re_decides_winners_from_the_merged_timings(with_variants):
    """A newer imported timing that dethrones the local winner wins, whatever the winner rows say."""
    from kernel_variants._table.exchange import build_document, import_document

    with_variants(_variant("a", reference.causal_conv1d_fn), _variant("b", reference.causal_conv1d_fn))
    versions = dispatcher().versions()
    va, vb = versions[(FN, "a")], versions[(FN, "b")]
    t = dispatcher().table
    t.record(_m("a", 100.0, va))
    t.record(_m("b", 50.0, vb))
    assert t.decide_winner(_fpid(), _group(), (1, 16, 8), versions, 0.02).variant == "b"
    doc = build_document(t, "cpu").model_copy(update={"measurements": [_m("b", 500.0, vb)]})
    import_document(doc, t, versions)
    _, winners = t.measurements(versions, _fpid())
    assert winners[(_group(), (1, 16, 8))].variant == "a"


def test_a_row_naming_a_file_never_makes_the_table_delete_it(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    t.record(_m("a", 100.0, "1"))
    victim = tmp_path / "victim" / "important"
    victim.parent.mkdir()
    victim.write_text("keep me")
    con = sqlite3.connect(tmp_path / "t" / "cache.db")
    con.execute(
        "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, filename, value)"
        " VALUES ('m|x|causal_conv1d_fn|y', 1, 0, NULL, 0, 0, NULL, 0, 2, ?, NULL)", (str(victim),))
    con.commit()
    con.close()
    t.clear(FN)  # deletes the planted row, and with it (before the fix) the file it names
    assert victim.read_text() == "keep me"


def test_a_busy_table_is_not_called_corrupt(tmp_path):
    from kernel_variants._table.table import is_corrupt

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
    t.record(_m("a", 100.0, "1"))
    t.record(_m("a", 7.0, "1", shape=(2, 16, 8), fp="other-device"))
    versions = {(FN, "a"): "1"}
    with pytest.warns(CalibrationWarning):
        mine, _ = t.measurements(versions, _fpid())
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
    """Finding 5 of the reliability issue: a table shipped read-only (an image, a shared mount)
    used to be ignored entirely. (Tests run as root, whom file modes do not stop, so the
    refused write is simulated where diskcache would meet it.)"""
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
    """Finding 8 (scale): a fresh process's first decision reads the snapshot the calibration
    left, not every row; a write renews the table's token, so a stale or planted snapshot is
    rebuilt from the rows, never trusted. (tools/bench_table_scale.py times it at 5000 shapes.)"""
    from kernel_variants._table.index import SNAPSHOT_PREFIX

    kv.calibrate(FN, SHAPES, **QUICK)
    args, kw = _call(*SHAPES[1])
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
