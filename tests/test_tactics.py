"""Tactics: named alternatives of one variant's fn (a kernel's block configurations), each
verified, qualified, timed and chosen as the candidate ``variant:tactic``; force and KV_FORCE
take it; rows under an id a tactic replaced move to the tactic, with one warning."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import kernel_variants as kv
from kernel_variants._registry.models import Variant
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.pins import check_tactics, parse_force
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import Group, Measurement, Winner
from kernel_variants._table.store import CalibrationWarning
from kernel_variants._table.table import CalibrationTable
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d import _reference as reference

FN = "causal_conv1d_fn"
QUICK = dict(dtype="float32", timing=kv.TimingConfig(warmup=1, windows=2, iters=3), prune=None)
SHAPE = (2, 32, 16)
ran: list[str] = []


def _tracked(name, seconds=0.0, wrong=False):
    def fn(*args, **kwargs):
        ran.append(name)
        if seconds:
            time.sleep(seconds)
        out = reference.causal_conv1d_fn(*args, **kwargs)
        return out + 1 if wrong else out
    return fn


def _tactical(priority=100, **tactics):
    """``tac``: a slow default (2 ms a call) and the given tactics."""
    return Variant(id="tac", op=FN, version="1", priority=priority, fn=_tracked("tac", 0.002), isolate=False,
                   tactics=tactics or {"quick": _tracked("quick"), "sleepy": _tracked("sleepy", 0.004)},
                   replaces={"tac_quick": "quick"},
                   capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, varlen=True))


def _call(b=2, d=32, seq=16):
    return (torch.randn(b, seq, d), torch.randn(d, 4), torch.randn(d)), dict(
        conv_states=torch.randn(b, 3, d), activation="silu")


@pytest.fixture(autouse=True)
def _forget_runs():
    ran.clear()


def test_a_variant_registers_its_tactics_as_candidates_and_lists_them(reference_only, with_variants):
    with_variants(_tactical())
    rvs = {rv.id: rv for rv in kv.variants(FN)}
    assert {"tac", "tac:quick", "tac:sleepy"} <= set(rvs)
    assert rvs["tac"].tactics == ("quick", "sleepy") and rvs["tac"].tactic is None
    quick = rvs["tac:quick"]
    assert quick.tactic == "quick" and quick.parent is rvs["tac"] and quick.tactics == ()
    assert quick.variant.id == "tac" and quick.variant.fn is not rvs["tac"].variant.fn
    assert quick.deps == rvs["tac"].deps and quick.unavailable_reason() is None
    assert dispatcher().registry.renames()[(FN, "tac_quick")] == "tac:quick"


def test_an_excluded_variant_or_tactic_is_unavailable_until_included(reference_only, with_variants):
    """Registry.exclude takes a variant with its tactics, or one tactic, out with its reason:
    unavailable (so never chosen, built, qualified or timed) until include lifts that exclusion."""
    with_variants(_tactical())
    registry = dispatcher().registry
    rvs = {rv.id: rv for rv in kv.variants(FN)}
    assert registry.exclude(FN, "tac:quick", "left out by a test")
    assert not registry.exclude(FN, "tac:quick", "again"), "out already"
    assert rvs["tac:quick"].unavailable_reason() == "left out by a test"
    assert rvs["tac"].unavailable_reason() is None and rvs["tac:sleepy"].unavailable_reason() is None
    assert not registry.include(FN, "tac:quick", "another reason"), "only the exclusion made with it"
    assert registry.include(FN, "tac:quick", "left out by a test")
    assert rvs["tac:quick"].unavailable_reason() is None
    assert registry.exclude(FN, "tac", "the whole variant")
    assert {rvs[v].unavailable_reason() for v in ("tac", "tac:quick", "tac:sleepy")} == {"the whole variant"}
    args, kw = _call()
    decision = kv.explain(FN, *args, **kw)
    assert "the whole variant" in str(decision) and decision.chosen.id == "reference"
    assert registry.include(FN, "tac") and rvs["tac:sleepy"].unavailable_reason() is None


@pytest.mark.parametrize(("tactics", "replaces", "match"), [
    ({"Bad Name": reference.causal_conv1d_fn}, {}, "tactic name"),
    ({"ok": 3}, {}, "callable"),
    ({"ok": reference.causal_conv1d_fn}, {"old": "missing"}, "not one of ok"),
])
def test_a_bad_tactic_declaration_is_refused(tactics, replaces, match):
    with pytest.raises(ValueError, match=match):
        Variant(id="tac", op=FN, version="1", fn=reference.causal_conv1d_fn, tactics=tactics, replaces=replaces,
                capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}))


def test_calibration_times_each_tactic_and_the_dispatcher_runs_the_winning_one(reference_only, with_variants):
    with_variants(_tactical())
    result = kv.calibrate(FN, [SHAPE], variants=["tac", "tac:quick", "tac:sleepy"], **QUICK)
    by = {m.variant: m for m in result.measurements}
    assert {"tac", "tac:quick", "tac:sleepy"} <= set(by) and all(m.status == "ok" for m in by.values())
    assert by["tac:sleepy"].best_us > by["tac"].best_us > by["tac:quick"].best_us
    assert result.winners[SHAPE].variant == "tac:quick"
    row = kv.table(FN)[0]
    assert row.winner == "tac:quick" and set(row.times_us) == {"tac", "tac:quick", "tac:sleepy"}
    args, kw = _call()
    decision = kv.explain(FN, *args, **kw)
    assert (decision.chosen.id, decision.source) == ("tac:quick", "table"), str(decision)
    assert "tac:sleepy" in str(decision)
    expected = reference.causal_conv1d_fn(*args, **{**kw, "conv_states": kw["conv_states"].clone()})
    ran.clear()
    torch.testing.assert_close(kv.causal_conv1d_fn(*args, **kw), expected)
    assert ran == ["quick"]


def test_a_wrong_tactic_is_rejected_before_it_is_timed_and_never_chosen(reference_only, with_variants):
    with_variants(_tactical(quick=_tracked("quick"), off=_tracked("off", wrong=True)))
    result = kv.calibrate(FN, [SHAPE], variants=["tac:quick", "tac:off"], **QUICK)
    rejected = {m.variant: m.reason for m in result.rejected()}
    assert set(rejected) == {"tac:off"} and "output" in rejected["tac:off"]
    assert result.winners[SHAPE].variant == "tac:quick"
    assert [v for v in kv.verdicts("cpu") if v.variant == "tac:off" and not v.passed], "its class failed"
    args, kw = _call()
    assert kv.explain(FN, *args, **kw).chosen.id == "tac:quick"
    timed = [m for m in result.measurements if m.variant == "tac:off"]
    assert [m.status for m in timed] == ["rejected"] and timed[0].best_us is None  # never timed
    # Forced, it still runs (forcing is the caller's word), and says it failed its qualification.
    with kv.force(**{FN: "tac:off"}):
        decision = kv.explain(FN, *args, **kw)
    assert decision.chosen.id == "tac:off" and decision.source == "forced" and "forced, although" in decision.note


def test_force_with_variant_colon_tactic_runs_that_tactic(with_variants):
    with_variants(_tactical())
    args, kw = _call()
    expected = reference.causal_conv1d_fn(*args, **{**kw, "conv_states": kw["conv_states"].clone()})
    with kv.force(**{FN: "tac:sleepy"}):
        out = kv.causal_conv1d_fn(*args, **kw)
    assert ran == ["sleepy"]
    torch.testing.assert_close(out, expected)
    ran.clear()
    with kv.force(**{FN: "tac"}):
        kv.causal_conv1d_fn(*args, **kw)
    assert ran == ["tac"]


def test_an_unknown_tactic_is_a_value_error_naming_the_known_ones(with_variants):
    with_variants(_tactical())
    with pytest.raises(ValueError, match=r"no tactic 'nope' \(its tactics: quick, sleepy\)"), kv.force(**{FN: "tac:nope"}):
        pass
    with pytest.raises(KeyError, match="no variant 'nope:x' registered"), kv.force(**{FN: "nope:x"}):
        pass


def test_kv_force_takes_variant_colon_tactic(monkeypatch, with_variants):
    ops = ["causal_conv1d_fn", "causal_conv1d_update"]
    assert parse_force("causal_conv1d_fn=tac:quick", ops) == {FN: "tac:quick"}
    assert parse_force("triton:d64", ops) == dict.fromkeys(ops, "triton:d64")
    monkeypatch.setenv("KV_FORCE", f"{FN}=tac:sleepy")
    d = with_variants(_tactical())
    assert d.pinned(FN) == "tac:sleepy"
    args, kw = _call()
    kv.causal_conv1d_fn(*args, **kw)
    assert ran == ["sleepy"]
    with pytest.raises(ValueError, match=r"KV_FORCE: variant 'tac' has no tactic 'slow' \(its tactics: quick, sleepy\)"):
        check_tactics({FN: "tac:slow"}, d.registry)
    assert check_tactics({FN: "tac:quick", "causal_conv1d_update": "tac:quick"}, d.registry)  # an op without it


def _row(variant: str, best_us: float, version: str) -> Measurement:
    fp = fingerprint("cpu")
    features = kv._runtime.dispatcher.dispatcher().registry.spec(FN).features()
    return Measurement(fingerprint=fp, fingerprint_id=fingerprint_id(fp), group=Group(op=FN, dtype="float32",
                       features=features), shape=SHAPE, variant=variant, version=version, status="ok",
                       best_us=best_us, median_us=best_us, measured_at=time.time())


def test_rows_of_a_replaced_variant_id_move_to_its_tactic_with_one_warning(reference_only, with_variants, tmp_path):
    d = with_variants(_tactical())
    versions = d.versions()
    quick = _row("tac_quick", 5.0, versions[(FN, "tac:quick")])  # the old id: same code, so still current
    ref = _row("reference", 50.0, versions[(FN, "reference")])
    table = d.table
    for m in (quick, ref):
        table.record(m)
    w = Winner(fingerprint_id=quick.fingerprint_id, group=quick.group, shape=SHAPE, variant="tac_quick",
               best_us=5.0, runner_up="reference", lead=9.0, confidence="clear", decided_at=time.time())
    table.store.set(w.storage_key(), w.model_dump_json())
    args, kw = _call()
    with pytest.warns(CalibrationWarning, match=r"retired variant ids moved .*: tac_quick -> tac:quick") as caught:
        decision = kv.explain(FN, *args, **kw)
    assert sum("retired" in str(c.message) for c in caught) == 1
    assert (decision.chosen.id, decision.source) == ("tac:quick", "table"), str(decision)
    keys = [k for k, _ in table.store.items() if k.startswith(("m|", "w|"))]
    assert not any(k.endswith("|tac_quick") for k in keys) and any(k.endswith("|tac:quick") for k in keys)
    # Moved on disk: another process reads the new name, and nothing warns again.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other = CalibrationTable(table.directory)
        other.renames = d.registry.renames()
        found = other.figures(decision.key, quick.fingerprint_id, ["tac:quick", "reference"], versions).here
    assert found.winner == "tac:quick" and found.timings == {"tac:quick": 5.0, "reference": 50.0}


def test_a_snapshot_naming_a_replaced_id_is_rebuilt_so_the_rows_move(reference_only, with_variants):
    d = with_variants(_tactical())
    versions = d.versions()
    table = d.table
    table.record(_row("tac_quick", 5.0, versions[(FN, "tac:quick")]))
    table.renames = {}  # a release before the tactic: it snapshots the old name
    fpid = fingerprint_id(fingerprint("cpu"))
    table.prepare(versions, fpid)
    table.renames = d.registry.renames()
    table.forget()
    args, kw = _call()
    with pytest.warns(CalibrationWarning, match="tac_quick -> tac:quick"):
        assert kv.explain(FN, *args, **kw).chosen.id == "tac:quick"


def test_the_triton_block_configurations_are_tactics_of_one_variant():
    from kernel_variants.kernels import triton_conv

    for op, configs in (("causal_conv1d_fn", triton_conv.FN_CONFIGS), ("causal_conv1d_update", triton_conv.UPDATE_CONFIGS)):
        ids = [rv.id for rv in kv.variants(op) if rv.id.startswith("triton")]
        assert ids == ["triton"] + [f"triton:{c.name}" for c in configs] == ["triton"] + [c.id for c in configs]
        renames = dispatcher().registry.renames()
        assert all(renames[(op, f"triton_{c.name}")] == c.id for c in configs)
    assert "triton:d32_t64" in {rv.id for rv in kv.variants("causal_conv1d_fn")}
    assert dispatcher().registry.renames()[("causal_conv1d_fn", "triton_d32_t64")] == "triton:d32_t64"



def test_an_unmeasured_tactic_of_a_measured_variant_does_not_outrank_the_measured_winner(reference_only, with_variants):
    """An incomplete row lets a higher-priority variant without a figure run instead of the
    measured winner; a variant counts as measured when any of its tactics (or its default) has a
    figure there, so its other tactics do not override a faster rival."""
    rival = Variant(id="rival", op=FN, version="1", priority=50, fn=reference.causal_conv1d_fn, isolate=False,
                    capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, width=(2, 4)))
    with_variants(_tactical(quick=_tracked("quick")), rival)
    kv.calibrate(FN, [SHAPE], variants=["tac", "rival"], **QUICK)  # the default sleeps: rival wins
    args, kw = _call()
    decision = kv.explain(FN, *args, **kw)
    assert (decision.chosen.id, decision.source) == ("rival", "table"), str(decision)


def test_a_retired_id_in_kv_force_names_the_tactic_that_replaced_it(monkeypatch):
    monkeypatch.setenv("KV_FORCE", "causal_conv1d_update=triton_d32")
    kv.reload()
    with pytest.raises(ValueError, match="'triton_d32' of causal_conv1d_update is now the tactic 'triton:d32'"):
        dispatcher().pinned("causal_conv1d_update")
