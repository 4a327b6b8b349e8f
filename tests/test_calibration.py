"""Calibration: correctness before speed, per-variant storage, stable winners, the nearest
calibrated shape; interleaved, noise-aware timing; pruning and a time budget; recording
uncalibrated keys in production; staleness per variant; graph timing mode. (The on-disk table
itself, its faults and its exchange format: test_table.py.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
import types
import warnings

import pytest
import torch
from helpers.calibration import conv_call, fpid, group, measurement, quick, quick_argv, run
from helpers.variants import counting, slow, variant

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.store import CalibrationWarning
from kernel_variants._table.table import CalibrationTable
from kernel_variants._tuning import calibrate as _calibrate
from kernel_variants._tuning import timing as _timing
from kernel_variants._tuning.timing import TimingConfig, measure, measure_interleaved
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.plugin import Variant

FN = "causal_conv1d_fn"
SHAPES = [(1, 16, 8), (2, 32, 16)]
# Two windows of three calls: a best and a median that can differ.
TIMED = quick(windows=2, iters=3)
# Three windows: pruning acts after the first round, and noise needs several windows to show.
ROUNDS = quick(windows=3, iters=3)


# ---- what calibration records, and what dispatch does with it


def test_calibration_records_figures_and_dispatch_follows_the_table(reference_only, with_variants):
    with_variants(variant("sleepy", fn=slow(0.002), priority=100, varlen=True))
    result = kv.calibrate(FN, SHAPES, variants=["reference", "sleepy"], prune=None, **TIMED)
    by = {(m.shape, m.variant): m for m in result.measurements}
    m = by[((2, 32, 16), "reference")]
    assert m.status == "ok" and m.best_us > 0 and m.median_us >= m.best_us
    assert m.windows == 2 and m.iters == 3 and m.measured_at <= time.time()
    assert by[((2, 32, 16), "sleepy")].best_us > m.best_us  # recorded per variant: the slower one's own figure
    assert all(w.variant == "reference" for w in result.winners.values())
    args, kw = conv_call()
    decision = kv.explain(FN, *args, **kw)
    assert (decision.chosen.id, decision.source) == ("reference", "table"), str(decision)
    assert "sleepy" in str(decision) and "x the winner" in str(decision)
    rows = kv.table(FN)
    assert [r.shape for r in rows] == SHAPES and rows[0].winner == "reference" and rows[0].margin > 1


def test_unseen_shape_uses_the_nearest_calibrated_shape_in_log_space(reference_only, with_variants):
    with_variants(variant("sleepy", fn=slow(0.002), priority=100, varlen=True))
    kv.calibrate(FN, [(1, 16, 8), (8, 128, 64)], variants=["reference", "sleepy"], **quick(windows=2, iters=1))
    args, kw = conv_call(b=2, d=32, seq=16)
    decision = kv.explain(FN, *args, **kw)
    assert decision.source == "nearest" and decision.measured_key == (1, 16, 8)


def test_without_any_measurement_priority_decides():
    args, kw = conv_call()
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
    with_variants(variant(name, fn=fn, priority=100, varlen=True))
    result = kv.calibrate(FN, SHAPES[:1], **TIMED)
    rejected = {m.variant: m.reason for m in result.rejected()}
    assert reason in rejected[name]
    assert result.winners[SHAPES[0]].variant != name
    args, kw = conv_call(*SHAPES[0])
    assert kv.explain(FN, *args, **kw).chosen.id != name
    assert name in kv.table(FN)[0].rejected


def test_a_new_variant_needs_only_itself_measured(with_variants):
    kv.calibrate(FN, SHAPES, variants=["reference"], **TIMED)
    first = {m.variant: m.measured_at for m in dispatcher().table.measurements(dispatcher().versions(), fpid())[0][(group(), SHAPES[0])].values()}
    with_variants(variant("newcomer", varlen=True))
    kv.calibrate(FN, SHAPES, variants=["newcomer"], **TIMED)
    row = kv.table(FN)[0]
    assert set(row.times_us) == {"reference", "newcomer"}
    after = dispatcher().table.measurements(dispatcher().versions(), fpid())[0][(group(), SHAPES[0])]
    assert after["reference"].measured_at == first["reference"], "the reference was not re-measured"


def test_a_challenger_must_beat_the_winner_by_the_margin(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    versions = {(FN, "a"): "1", (FN, "b"): "1"}
    t.record(measurement("a", 100.0, "1"))
    assert t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02).variant == "a"
    t.record(measurement("b", 99.0, "1"))  # 1% faster: noise on a shared machine
    assert t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02).variant == "a"
    t.record(measurement("b", 90.0, "1"))  # 10% faster: a real win
    assert t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02).variant == "b"
    t.record(measurement("a", 89.0, "1"))  # and back only by more than the margin
    assert t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02).variant == "b"


def test_stale_versions_and_other_devices_are_ignored_with_one_warning(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    t.record(measurement("a", 100.0, "1+old"))
    t.record(measurement("b", 50.0, "1", fp="another-device"))
    t.record(measurement("c", 70.0, "1"))
    versions = {(FN, "a"): "1+new", (FN, "b"): "1", (FN, "c"): "1"}
    with pytest.warns(CalibrationWarning) as caught:
        rows, _ = t.measurements(versions, fpid())
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "variant 'a' changed since it was measured (version 1+old -> 1+new)" in msg
    assert "1 measured on another device or software stack" in msg
    assert set(rows[(group(), (1, 16, 8))]) == {"c"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.measurements(versions, fpid())  # the same load again: no second warning


def test_editing_a_kernel_makes_its_timings_stale(with_variants):
    with_variants(variant("mine", version="1", varlen=True))
    kv.calibrate(FN, SHAPES[:1], variants=["mine"], **TIMED)
    with_variants(variant("mine", version="2", varlen=True))
    with pytest.warns(CalibrationWarning, match="variant 'mine' changed"):
        assert kv.table(FN) == []


def test_kv_tune_calibrates_an_unseen_shape_on_first_sight(monkeypatch):
    monkeypatch.setenv("KV_TUNE", "1")
    kv.reload()
    args, kw = conv_call(b=1, d=16, seq=4)
    kv.causal_conv1d_fn(*args, **kw)
    assert [r.shape for r in kv.table(FN)] == [(1, 16, 4)]
    assert kv.explain(FN, *args, **kw).source == "table"


def test_kv_tune_never_measures_while_compiling(monkeypatch):
    monkeypatch.setenv("KV_TUNE", "1")
    kv.reload()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    args, kw = conv_call(b=1, d=16, seq=4)
    assert kv.explain(FN, *args, **kw).source == "priority"
    assert kv.table(FN) == []


def test_clear_table_per_variant_and_op():
    kv.calibrate(FN, SHAPES, prune=None, **TIMED)
    assert kv.clear_table(FN, "torch_shift") == 2
    assert all("torch_shift" not in r.times_us and "reference" in r.times_us for r in kv.table(FN))
    kv.clear_table(FN)
    assert kv.table(FN) == []


def test_calibrate_refuses_bad_arguments():
    with pytest.raises(ValueError, match="shapes: expected"):
        kv.calibrate(FN, [(1, 2)], **TIMED)
    with pytest.raises(ValueError, match="variants: nope not registered"):
        kv.calibrate(FN, SHAPES, variants=["nope"], **TIMED)
    with pytest.raises(ValueError, match="dtype: expected"):
        kv.calibrate(FN, SHAPES, **(TIMED | {"dtype": "int8"}))
    with pytest.raises(ValueError, match="op must be one of"):
        kv.calibrate("conv2d", SHAPES, **TIMED)


def test_real_calls_follow_the_table_after_calibrate_and_clear(reference_only, with_variants):
    """Through the memo, not explain(): calibrating and clearing must change what a call runs."""
    slow_v, slow_calls = counting("slow_but_preferred", slow(0.003), varlen=True, priority=1000)
    fast_v, fast_calls = counting("fast", reference.causal_conv1d_fn, varlen=True, priority=0)
    with_variants(slow_v, fast_v)
    args, kw = conv_call(*SHAPES[0])
    kv.causal_conv1d_fn(*args, **kw)
    assert slow_calls and not fast_calls, "without measurements the priority decides"
    kv.calibrate(FN, SHAPES[:1], variants=["slow_but_preferred", "fast"], **TIMED)
    slow_calls.clear()
    fast_calls.clear()
    kv.causal_conv1d_fn(*args, **kw)
    assert fast_calls == ["fast"] and not slow_calls, "the memoised decision survived calibration"
    kv.clear_table(FN)
    kv.causal_conv1d_fn(*args, **kw)
    assert slow_calls == ["slow_but_preferred"], "the memoised decision survived clear_table"


# ---- interleaved, noise-aware timing


class _LoadedMachine:
    """A clock the timer reads, and variants whose calls take ``base`` seconds of it times the
    machine's load: 3x until ``busy_until``, then 1x (a neighbour's job that ends mid-calibration)."""

    def __init__(self, busy_until: float) -> None:
        self.t = 0.0
        self.busy_until = busy_until

    def now(self) -> float:
        return self.t

    def variant(self, base: float):
        def call(*args, **kwargs):
            self.t += base * (3.0 if self.t < self.busy_until else 1.0)
            return reference.causal_conv1d_fn(*args, **kwargs) if args else None
        return call


def test_interleaved_timing_picks_the_truly_faster_variant_where_block_timing_does_not(monkeypatch):
    config = TimingConfig(warmup=1, windows=5, iters=5, window_budget_s=None)
    machine = _LoadedMachine(busy_until=0.1)
    monkeypatch.setattr(_timing, "_now", machine.now)
    fast, slow = machine.variant(1e-3), machine.variant(1.3e-3)  # fast is truly 1.3x faster
    block = {"fast": measure([fast], "cpu", config).best_us, "slow": measure([slow], "cpu", config).best_us}
    assert min(block, key=block.get) == "slow", block  # fast was timed while the machine was busy

    machine = _LoadedMachine(busy_until=0.1)
    monkeypatch.setattr(_timing, "_now", machine.now)
    fast, slow = machine.variant(1e-3), machine.variant(1.3e-3)
    got = measure_interleaved({"fast": [fast], "slow": [slow]}, "cpu", config)
    assert got["fast"].best_us == pytest.approx(1000) and got["slow"].best_us == pytest.approx(1300)
    assert len(got["fast"].samples_us) == 5 and got["fast"].noise > 0  # busy windows are in its samples
    assert "interleaved" in got["fast"].method


def test_calibration_stores_the_interleaved_winner_with_its_windows(reference_only, with_variants, monkeypatch):
    machine = _LoadedMachine(busy_until=0.15)
    monkeypatch.setattr(_timing, "_now", machine.now)
    with_variants(variant("fast", fn=machine.variant(1e-3), varlen=True), variant("slow", fn=machine.variant(1.3e-3), varlen=True))
    result = kv.calibrate(FN, [(1, 16, 8)], variants=["fast", "slow"], prune=None,
                          **quick(windows=5, iters=5, window_budget_s=None))
    assert result.winners[(1, 16, 8)].variant == "fast"
    m = {m.variant: m for m in result.measurements}["fast"]
    assert len(m.samples_us) == 5 and m.best_us == min(m.samples_us) and m.noise is not None


def test_a_lead_inside_the_measured_noise_does_not_flip_the_incumbent(tmp_path):
    t = CalibrationTable(tmp_path / "t")
    versions = {(FN, "a"): "1", (FN, "b"): "1"}
    t.record(measurement("a", 100.0, samples=[100, 104, 108, 109, 112]))
    w = t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02)
    assert (w.variant, w.confidence) == ("a", "single")
    # 4% faster: above the 2% margin, but the windows wander by 8%: noise, not a lead
    t.record(measurement("b", 96.0, samples=[96, 100, 104, 105, 107]))
    w = t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02)
    assert (w.variant, w.runner_up, w.confidence) == ("a", "b", "within noise") and w.lead < 0 and w.noise > 0.04
    # 30% faster is a lead whatever the noise
    t.record(measurement("b", 70.0, samples=[70, 73, 75, 76, 77]))
    w = t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02)
    assert (w.variant, w.runner_up, w.confidence) == ("b", "a", "clear") and w.lead > 0.4
    # quiet figures: the 2% margin stays the floor
    t.record(measurement("a", 69.0, samples=[69, 69, 69]))
    assert t.decide_winner(fpid(), group(), (1, 16, 8), versions, 0.02).variant == "b"
    row = {r.shape: r for r in kv.table(FN)}  # (the process table is another directory: empty)
    assert row == {}


# ---- pruning and a budget


def test_a_far_slower_variant_is_pruned_recorded_with_its_bound_and_treated_as_measured(
        reference_only, with_variants, capsys):
    with_variants(variant("snail", fn=slow(0.02), priority=1000, varlen=True), variant("quick", varlen=True))  # >3x even on a loaded machine
    result = kv.calibrate(FN, [(2, 32, 16)], variants=["snail", "quick"], **ROUNDS)
    by = {m.variant: m for m in result.measurements}
    snail = by["snail"]
    assert snail.status == "pruned" and snail.windows == 1 and snail.pruned_at >= 3
    assert snail.reason == f"pruned after the first round at >= {snail.pruned_at:.1f}x quick's time per call"
    assert by["quick"].status == "ok" and by["quick"].windows == 3
    row = kv.table(FN)[0]
    assert row.pruned == {"snail": snail.pruned_at} and row.missing == ("reference",) and row.winner == "quick"
    # measured-slower, never unmeasured: its priority (1000) does not make the row "incomplete"
    args, kw = conv_call(2, 32, 16)
    decision = kv.explain(FN, *args, **kw)
    assert (decision.chosen.id, decision.source) == ("quick", "table"), str(decision)
    assert f"pruned: >= {snail.pruned_at:.1f}x the best there" in str(decision)
    rc, out, _ = run(capsys, "table")
    assert rc == 0 and f"pruned >={snail.pruned_at:.1f}x" in out
    rc, out, _ = run(capsys, "list", "--shape", "2,32,16", "--dtype", "fp32")
    assert rc == 0 and "pruned: >= " in out
    # --missing sees a pruned variant as measured
    rc, out, err = run(capsys, "calibrate", "--shapes", "2,32,16", "--dtype", "fp32", "--warmup", "1", "--windows",
                       "2", "--iters", "2", "--variants", "snail,quick", "--missing", "--json", "-q")
    assert rc == 0, err and json.loads(out)["measurements"] == []


def test_without_pruning_every_variant_is_timed_fully(reference_only, with_variants):
    with_variants(variant("snail", fn=slow(0.004), varlen=True), variant("quick", varlen=True))
    result = kv.calibrate(FN, [(2, 32, 16)], variants=["snail", "quick"], prune=None, **ROUNDS)
    assert {m.status for m in result.measurements} == {"ok"}
    with pytest.raises(ValueError, match="prune: expected a factor above 1"):
        kv.calibrate(FN, [(2, 32, 16)], prune=0.5, **ROUNDS)


class _Sized:
    """A clock the timer reads, and variants whose calls take a time of it that depends on the
    call's size only (``seconds(elements of x)``): figures that are the same in every run, so two
    calibrations differ only in what they chose to measure. Each call is logged with its size."""

    def __init__(self) -> None:
        self.t = 0.0
        self.calls: list[tuple[str, int]] = []

    def now(self) -> float:
        return self.t

    def variant(self, name: str, seconds):
        def call(x, *args, **kwargs):
            self.t += seconds(x.numel())
            self.calls.append((name, x.numel()))
            return reference.causal_conv1d_fn(x, *args, **kwargs)
        return variant(name, fn=call, varlen=True)


# B=1, D in {64, 96}, L from 16 to 8192: 20 shapes, no two of the same size, interleaved so that
# each shape after the first two has two measured neighbours within 2x on every axis.
CROSSING = [(1, d, 16 << k) for k in range(10) for d in (64, 96)]


def _crossing(machine: _Sized):
    """``flat`` costs 2 ms a call whatever the size (a launch-bound kernel), ``linear`` 2 ms per
    28,378 elements: ``flat`` loses by 27x at the smallest shape and wins by 27x at the largest,
    and no shape is within 15% of the crossing."""
    return (machine.variant("flat", lambda n: 2e-3), machine.variant("linear", lambda n: 2e-3 * n / 28_378))


def test_pruning_by_neighbours_leaves_out_what_cannot_win_and_keeps_every_winner(
        reference_only, with_variants, monkeypatch, capsys):
    machine = _Sized()
    monkeypatch.setattr(_timing, "_now", machine.now)
    with_variants(*_crossing(machine))
    kv.qualify(FN, dtype="float32", variants=["flat", "linear"])
    machine.calls.clear()  # from here on, the log holds calibration's calls only
    pruned = kv.calibrate(FN, CROSSING, variants=["flat", "linear"], **TIMED)
    calls = set(machine.calls)
    rc, table_text, _ = run(capsys, "table")
    kv.clear_table(FN)
    full = kv.calibrate(FN, CROSSING, variants=["flat", "linear"], prune=None, **TIMED)

    winners = {s: w.variant for s, w in full.winners.items()}
    assert {s: w.variant for s, w in pruned.winners.items()} == winners
    assert set(winners.values()) == {"flat", "linear"}  # the sweep crosses over: both win somewhere
    assert {m.status for m in full.measurements} == {"ok"}  # --no-prune: every variant checked and timed
    near = pruned.pruned_by_neighbours()
    assert {m.variant for m in near} == {"flat", "linear"}, [(m.shape, m.variant, m.status) for m in pruned.measurements]
    for m in near:
        assert m.windows == 0 and m.samples_us == () and m.pruned_at > 3
        assert m.reason.startswith(f"pruned by its neighbours: >= {m.pruned_at:.1f}x ")
        assert (m.variant, math.prod(m.shape)) not in calls  # neither checked nor timed there
        assert m.variant != winners[m.shape]
        assert m.best_us > (m.pruned_at * {x.variant: x for x in pruned.measurements if x.shape == m.shape
                                            and x.status == "ok"}[winners[m.shape]].best_us) * 0.99
    assert rc == 0 and "pruned by neighbours >=" in table_text
    rows = {r.shape: r for r in kv.table(FN)}
    assert all(not r.by_neighbours for r in rows.values())  # the full run replaced them


def test_the_reference_runs_once_per_shape_for_every_check_there(reference_only, with_variants, monkeypatch):
    """One reference output per shape, whatever the number of variants checked against it (the
    check at a shape used to run again, with its own reference call, for every variant that passed)."""
    from kernel_variants._tuning import verify as _verify

    sizes: list[tuple[int, ...]] = []

    def counted(real):
        def reference_result(case, *args, **kwargs):
            sizes.append(case.spec.key_of_case(case).shape)
            return real(case, *args, **kwargs)
        return reference_result

    monkeypatch.setattr(_calibrate, "reference_result", counted(_calibrate.reference_result))
    monkeypatch.setattr(_verify, "reference_result", counted(_verify.reference_result))
    with_variants(*(variant(name, fn=slow(0.0), varlen=True) for name in ("one", "two", "three")))
    result = kv.calibrate(FN, SHAPES, variants=["one", "two", "three"], prune=None, **TIMED)
    assert {m.status for m in result.measurements} == {"ok"} and len(result.measurements) == 3 * len(SHAPES)
    assert sorted(s for s in sizes if s in SHAPES) == sorted(SHAPES)


def test_calibrate_says_where_its_time_went(reference_only, with_variants, monkeypatch, capsys):
    machine = _Sized()
    monkeypatch.setattr(_timing, "_now", machine.now)
    with_variants(*_crossing(machine))
    argv = ["calibrate", "--shapes", *(",".join(map(str, s)) for s in CROSSING[:6]), *quick_argv(TIMED),
            "--variants", "flat,linear", "-q"]
    doc = json.loads(run(capsys, *argv, "--json")[1])
    costs = doc["breakdown"]
    assert set(costs["seconds"]) == {"build", "qualification", "inputs", "reference", "checks", "timing",
                                     "timing_pruned", "table"}
    assert set(costs["by_variant"]) == {"flat", "linear"}
    assert {"qualification", "checks", "timing"} <= set(costs["by_variant"]["linear"])  # it wins these shapes
    assert "timing_pruned" in costs["by_variant"]["flat"]  # it loses them by far
    assert sum(costs["seconds"].values()) + costs["other_s"] == pytest.approx(doc["elapsed_s"], abs=0.01)
    assert doc["pruned_by_neighbours"] == sum(1 for m in doc["measurements"] if m["status"] == "pruned"
                                              and m["windows"] == 0) > 0
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert "\ntook " in out and "checks" in out and "by their neighbours" in out and "--breakdown" in out
    rc, out, err = run(capsys, *argv, "--breakdown")
    assert rc == 0, err
    assert "checking each variant at each shape" in out and "timing before pruning s" in out


def test_a_budget_bounds_the_sweep_and_says_what_it_skipped(reference_only, with_variants, monkeypatch, capsys):
    """On a fake clock that only the variant's calls advance (10 ms each), so what fits in the
    budget is a count of calls, whatever the machine's load."""
    machine = _LoadedMachine(busy_until=0.0)
    clock = types.SimpleNamespace(time=time.time, perf_counter=machine.now, monotonic=machine.now)
    monkeypatch.setattr(_timing, "_now", machine.now)
    monkeypatch.setattr(_timing, "time", clock)
    monkeypatch.setattr(_calibrate, "time", clock)
    with_variants(variant("sleepy", fn=machine.variant(0.01), varlen=True))
    shapes = [(1, 16, 8), (2, 16, 8), (3, 16, 8), (4, 16, 8), (5, 16, 8)]
    result = kv.calibrate(FN, shapes, variants=["sleepy"], budget_s=0.3, **quick(windows=3, iters=3, window_budget_s=0.05))
    assert result.skipped and len(result.winners) + len(result.skipped) == len(shapes)
    assert result.skipped == shapes[len(shapes) - len(result.skipped):]
    rc, out, err = run(capsys, "calibrate", "--shapes", *(",".join(map(str, s)) for s in shapes[:3]),
                       *quick_argv(ROUNDS), "--variants", "sleepy", "--budget", "0.05s", "-q")
    assert rc == 0, err
    assert "skipped 2 shapes that no longer fit: 2,16,8; 3,16,8" in out and "--missing" in out
    rc, _, err = run(capsys, "calibrate", "--budget", "soon", "--shapes", "1,8,4")
    assert rc == 2 and "--budget: expected a duration" in err


# ---- record in production, calibrate offline


def test_kv_record_notes_each_unmeasured_key_once_and_calibrate_recorded_measures_it(monkeypatch, capsys):
    monkeypatch.setenv("KV_RECORD", "1")
    monkeypatch.setenv("KV_DISABLE_PLUGINS", "cpu_native")
    kv.reload()
    kv.calibrate(FN, [(2, 32, 16)], **ROUNDS)  # measured: never recorded
    for b, d, seq in [(2, 32, 16), (1, 16, 4), (1, 16, 4), (3, 16, 4)]:
        args, kw = conv_call(b, d, seq)
        kv.causal_conv1d_fn(*args, **kw)
    args, kw = conv_call(1, 16, 4)
    kv.causal_conv1d_fn(args[0].contiguous(), args[1], None, **kw)  # another group: no bias
    from kernel_variants._api.calibration import recorded

    got = recorded()
    assert sorted((tuple(e["shape"]), e["features"]["bias"]) for e in got) == [
        ((1, 16, 4), False), ((1, 16, 4), True), ((3, 16, 4), True)]
    assert all(e["seen"] == 1 and e["done_at"] is None and e["fingerprint_id"] == fpid() for e in got)
    assert (dispatcher().table.directory / "recorded.db").is_file()
    rc, out, _ = run(capsys, "table")
    assert "not calibrated yet (3; kv calibrate --recorded measures them)" in out

    kv.reload()  # another process meets the same key: counted, not duplicated
    args, kw = conv_call(3, 16, 4)
    kv.causal_conv1d_fn(*args, **kw)
    assert {tuple(e["shape"]): e["seen"] for e in recorded() if e["features"]["bias"]}[(3, 16, 4)] == 2

    rc, out, err = run(capsys, "calibrate", "--recorded", "--warmup", "1", "--windows", "2", "--iters", "2", "-q",
                       "--json")
    assert rc == 0, err
    doc = json.loads(out)
    measured = {(tuple(s["shape"]), g["features"]["bias"]) for g in doc["groups"] for s in g["shapes"]}
    assert measured == {((1, 16, 4), False), ((1, 16, 4), True), ((3, 16, 4), True)}
    assert all(g["dtype"] == "float32" for g in doc["groups"])
    assert recorded(pending_only=True) == [] and len(recorded()) == 3
    rc, out, _ = run(capsys, "table", "--recorded")
    assert out.count("calibrated 20") == 3
    kv.reload()
    args, kw = conv_call(3, 16, 4)
    assert kv.explain(FN, *args, **kw).source == "table"


_RECORDER = textwrap.dedent("""
    import sys, torch, kernel_variants as kv
    start = int(sys.argv[1])
    for i in range(start, start + 6):  # processes overlap: each key is met by several of them
        x = torch.randn(1, 4, 8 + i)
        kv.causal_conv1d_fn(x, torch.randn(8 + i, 4), None)
""")


def test_many_processes_record_into_one_bounded_record(tmp_path):
    cache = tmp_path / "shared"
    env = {**os.environ, "KV_CACHE_DIR": str(cache), "KV_RECORD": "1", "PYTHONWARNINGS": "error",
           "KV_DISABLE_PLUGINS": "cpu_native"}
    procs = [subprocess.Popen([sys.executable, "-c", _RECORDER, str(start)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for start in (0, 2, 4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    from kernel_variants._table.store import Recorder

    entries = Recorder(cache).entries()
    # key D=8+i is met by the processes starting at 0 (i < 6), 2 (2 <= i < 8) and 4 (i >= 4)
    assert {e["shape"][1]: e["seen"] for e in entries} == {8: 1, 9: 1, 10: 2, 11: 2, 12: 3, 13: 3, 14: 2, 15: 2,
                                                           16: 1, 17: 1}
    small = Recorder(tmp_path / "small", limit=2)
    assert [small.add(str(i), {"shape": [i]}) for i in range(3)] == ["added", "added", "full"]
    assert small.add("0", {"shape": [0]}) == "seen"
    small.mark_done(["0"])
    assert small.add("2", {"shape": [2]}) == "added"


def test_an_unwritable_record_warns_once_and_the_call_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KV_RECORD", str(blocker / "record"))
    kv.reload()
    args, kw = conv_call(1, 16, 4)
    with pytest.warns(CalibrationWarning, match="KV_RECORD: cannot write the record") as caught:
        kv.causal_conv1d_fn(*args, **kw)
        args, kw = conv_call(2, 16, 4)
        kv.causal_conv1d_fn(*args, **kw)
    assert len(caught) == 1


# ---- staleness per variant


def test_the_fingerprint_holds_the_device_only_and_each_variant_its_dependencies():
    fp = fingerprint("cpu")
    assert "torch" not in fp and "kernel_variants" not in fp and fp["device"] == "cpu"
    ref = next(rv for rv in kv.variants(FN) if rv.id == "reference")
    assert ref.deps == {"torch": torch.__version__} or set(ref.deps) == {"torch"}
    assert ref.version.count("+") == 1 and ref.version != ref.source_version  # the dependencies are folded in


def test_the_builtin_kernels_declare_what_their_speed_depends_on():
    """A new Triton must stale the Triton kernels' rows and a new compiler cpu_native's, and
    neither the rest: each kernel declares its own dependencies."""
    declared = {(rv.op, rv.id): set(rv.deps) for rv in kv.variants()}
    expect = {"cpu_native": {"torch", "compiler", "isa"}, "triton": {"triton", "torch"},
              "triton:d64": {"triton", "torch"}, "dao": {"causal-conv1d", "torch"},
              "asc": {"sgl-kernel-npu", "torch_npu", "cann", "torch"},
              "pto": {"sgl-kernel-npu", "torch_npu", "cann", "torch"},
              "npu_conv_update": {"sgl-kernel-npu", "torch_npu", "cann", "torch"},
              "npu_rms_norm": {"torch_npu", "cann", "torch"}, "aten": {"torch"}, "reference": {"torch"}}
    seen = set()
    for (op, vid), deps in declared.items():
        if vid in expect:
            assert deps == expect[vid], (op, vid, deps)
            seen.add(vid)
    assert seen == set(expect)


def test_a_dependency_upgrade_makes_only_its_variants_stale(reference_only, with_variants, monkeypatch, capsys):
    from kernel_variants._registry import versions as _versions

    fake = {"kv-test-kernels": "1.0"}
    monkeypatch.setattr(_versions, "dependency_version", lambda name: fake.get(name, "9.9"))
    plugin = (variant("pinned", depends=("kv-test-kernels",), varlen=True), variant("pure", depends=(), varlen=True))
    with_variants(*plugin)
    kv.calibrate(FN, [(1, 16, 8)], variants=["pinned", "pure", "reference"], prune=None, **ROUNDS)
    assert set(kv.table(FN)[0].times_us) == {"pinned", "pure", "reference"}
    monkeypatch.setattr("kernel_variants._version.__version__", "99.0")  # a new kernel_variants: nothing stale
    with_variants(*plugin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(kv.table(FN)[0].times_us) == {"pinned", "pure", "reference"}
    fake["kv-test-kernels"] = "2.0"  # the kernels' package upgraded: only "pinned" is stale
    with_variants(*plugin)
    with pytest.warns(CalibrationWarning, match="variant 'pinned' changed") as caught:
        assert set(kv.table(FN)[0].times_us) == {"pure", "reference"}
    assert len(caught) == 1 and "kv calibrate --stale" in str(caught[0].message)
    rc, out, _ = run(capsys, "table", "--stale")
    assert rc == 0 and "pinned" in out and "kv-test-kernels 1.0 -> 2.0" in out and "pure" not in out
    rc, out, err = run(capsys, "calibrate", "--stale", "--warmup", "1", "--windows", "2", "--iters", "2", "-q",
                       "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert [m["variant"] for g in doc["groups"] for m in g["measurements"]] == ["pinned"]
    assert doc["groups"][0]["measurements"][0]["deps"] == {"kv-test-kernels": "2.0"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(kv.table(FN)[0].times_us) == {"pinned", "pure", "reference"}
    assert run(capsys, "table", "--stale", "--json")[1].strip() == "[]"


def test_rows_of_an_earlier_release_are_ignored_with_one_warning_and_re_measured(reference_only, capsys):
    kv.calibrate(FN, [(1, 16, 8)], **ROUNDS)
    table = dispatcher().table
    (key, raw), = [(k, r) for k, r in table.store.items() if k.startswith("m|")]
    doc = json.loads(raw)
    old_fp = {**doc["fingerprint"], "torch": torch.__version__, "kernel_variants": "0.1.0"}
    old_id = fingerprint_id(old_fp)
    ref = next(rv for rv in kv.variants(FN) if rv.id == "reference")
    legacy = {**doc, "schema_version": 2, "fingerprint": old_fp, "fingerprint_id": old_id,
              "version": ref.source_version}
    for k in ("samples_us", "noise", "pruned_at", "deps"):
        legacy.pop(k)
    table.store.delete(key)
    table.store.set(key.replace(doc["fingerprint_id"], old_id), json.dumps(legacy))
    for k, _ in list(table.store.items()):
        if k.startswith("w|"):
            table.store.delete(k)
    kv.reload()
    with pytest.warns(CalibrationWarning, match="1 measured on this device by an earlier kernel_variants release") as w:
        assert kv.table(FN) == []
    assert len(w) == 1 and "another device" not in str(w[0].message)
    args, kw = conv_call(1, 16, 8)
    assert kv.explain(FN, *args, **kw).source == "priority"  # never mixed in
    rc, out, _ = run(capsys, "table", "--stale")
    assert "measured by an earlier release (kernel_variants 0.1.0" in out
    rc, out, err = run(capsys, "calibrate", "--stale", "--warmup", "1", "--windows", "2", "--iters", "2", "-q")
    assert rc == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r.winner for r in kv.table(FN)] == ["reference"]
        assert kv.explain(FN, *args, **kw).source == "table"
    assert not any(old_id in k for k, _ in dispatcher().table.store.items()), "the superseded row was dropped"


# ---- graph timing mode (CUDA); what runs here is the argument handling and the bookkeeping


def test_graph_mode_and_cold_l2_need_cuda(capsys):
    with pytest.raises(ValueError, match="timing mode graph: replays a captured CUDA graph"):
        kv.calibrate(FN, [(1, 16, 8)], **quick(windows=3, iters=3, mode="graph"))
    with pytest.raises(ValueError, match="cold L2"):
        kv.calibrate(FN, [(1, 16, 8)], **quick(windows=3, iters=3, cold_l2=True))
    with pytest.raises(ValueError, match="mode: expected one of eager, graph"):
        TimingConfig(mode="lazy")
    rc, _, err = run(capsys, "calibrate", "--shapes", "1,16,8", "--timing-mode", "graph")
    assert rc == 2 and "timing mode graph" in err
    rc, _, err = run(capsys, "compare", "--incumbent", "reference", "--candidate", "aten", "--shapes", "1,16,8",
                       "--cold-l2")
    assert rc == 2 and "cold L2" in err


def test_graph_mode_records_the_method_of_each_row(reference_only, with_variants, monkeypatch):
    """The CUDA graph itself is faked: each 'replay' runs the captured calls eagerly."""
    captured = []

    def fake_capture(device, calls, iters):
        captured.append(iters)

        def replay():
            for i in range(iters):
                calls[i % len(calls)]()
        return replay

    monkeypatch.setattr(_timing, "GRAPH_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(_timing, "_capture_graph", fake_capture)
    monkeypatch.setattr(_timing, "l2_bytes", lambda device: 1 << 20)  # a 1 MiB L2
    with_variants(Variant(id="safe", op=FN, version="1", fn=reference.causal_conv1d_fn,
                          capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, varlen=True,
                                                        graph_safe=True)))
    result = kv.calibrate(FN, [(2, 256, 64)], variants=["safe", "reference"],
                          prune=None, **quick(windows=3, iters=3, mode="graph", cold_l2=True))
    methods = {m.variant: m.method for m in result.measurements}
    # inputs of (2, 256, 64) fp32: x 128 KiB + pool, weight, bias: 2 x 1 MiB / ~134 KiB -> 16 input sets
    assert methods["safe"].startswith("perf_counter, graph replay, interleaved, cold L2 (")
    assert methods["reference"].startswith("perf_counter, eager (not graph_safe)")
    assert "input sets)" in methods["safe"] and captured == [3]
    from kernel_variants._tuning.inputs import case_bytes

    spec = dispatcher().registry.spec(FN)
    case = spec.sweep_case((2, 256, 64), spec.features(), dtype=torch.float32, device="cpu")
    n = -(-2 * (1 << 20) // case_bytes(case))
    assert f"cold L2 ({n} input sets)" in methods["safe"]


def test_a_key_recorded_with_another_thread_count_is_measured_with_it(capsys):
    """Serving processes often run with another intra-op thread count than `kv calibrate`: the
    key is measured with the recorded count (the only fingerprint difference allowed)."""
    from kernel_variants._api.calibration import recorded, recorder

    before = torch.get_num_threads()
    theirs = {**fingerprint("cpu"), "threads": str(before + 1)}
    other = {**fingerprint("cpu"), "name": "another cpu"}
    r = recorder()
    base = {"op": FN, "device": "cpu", "dtype": "float32", "shape": [1, 16, 4], "extra": [],
            "features": dict(group().features)}
    r.add("threads", {**base, "fingerprint": theirs, "fingerprint_id": fingerprint_id(theirs)})
    r.add("elsewhere", {**base, "shape": [2, 16, 4], "fingerprint": other, "fingerprint_id": fingerprint_id(other)})
    # A key recorded here before fingerprints named the CPU's kind: still this machine's to measure.
    old = {k: theirs[k] for k in ("device", "name", "threads", "machine")}
    r.add("before", {**base, "shape": [3, 16, 4], "fingerprint": old, "fingerprint_id": fingerprint_id(old)})
    r.close()
    rc, out, err = run(capsys, "calibrate", "--recorded", "--variants", "reference", "--warmup", "1", "--windows", "1",
                       "--iters", "1", "-q", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    by_shape = {tuple(m["shape"]): m for g in doc["groups"] for m in g["measurements"]}
    assert sorted(by_shape) == [(1, 16, 4), (3, 16, 4)], [e["why"] for e in doc["not_measured"]]
    assert all(m["fingerprint"]["threads"] == str(before + 1) for m in by_shape.values())
    assert torch.get_num_threads() == before
    assert [(e["shape"], "another cpu" in e["why"]) for e in doc["not_measured"]] == [([2, 16, 4], True)]
    assert [e["id"] for e in recorded(pending_only=True)] == ["elsewhere"]
