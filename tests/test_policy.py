"""Every rule of the decision, as pure functions: admit, choose, select, winner_of, decide."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kernel_variants._decide import (
    Build,
    Facts,
    Look,
    Qualify,
    Tune,
    admissions,
    decide,
    wants_tuning,
)
from kernel_variants._policy import (
    ADMITTED,
    NOT_YET,
    Figures,
    Found,
    admit,
    choose,
    combined_noise,
    is_reference,
    policy_from,
    qualifies,
    select,
    winner_of,
    with_note,
)
from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants._runtime.bind import call_key
from kernel_variants._table.rows import Group, Verdict
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.plugin import Variant

KEY = call_key("causal_conv1d_fn", torch.randn(2, 5, 8), torch.randn(8, 4), conv_states=torch.zeros(2, 3, 8))


def entry(vid: str, priority: int = 0, **caps) -> RegisteredVariant:
    caps = {"dtypes": {"float32"}, **caps}
    def fn(*args, **kw):  # not the reference's function: that one is never qualified
        return reference.causal_conv1d_fn(*args, **kw)

    v = Variant(id=vid, op="causal_conv1d_fn", version="1", priority=priority, fn=fn,
                capabilities=ConvCapabilities(devices={"cpu"}, **caps))
    return RegisteredVariant(v, "test", "1+0")


REF = RegisteredVariant(KEY.spec.reference, "test", "1+0")
FAST, SLOW = entry("fast", 50), entry("slow", 10)
ENTRIES = (REF, FAST, SLOW)


def verdict(vid: str, passed: bool = True, *, where: str = "process", largest=()) -> Verdict:
    return Verdict(fingerprint={}, fingerprint_id="fp", group=Group.of(KEY), variant=vid, version="1+0",
                   passed=passed, cases=3, failed_case="" if passed else "empty", reason="" if passed else "wrong",
                   where=where, largest=largest, qualified_at=time.time())


def found(timings, winner=None, source="table", at=KEY.shape, rejected=(), pruned=None) -> Found:
    return Found(dict(timings), winner, source, at, set(rejected), dict(pruned or {}))


# admit


@pytest.mark.parametrize("policy", ["require", "strict", "off"])
def test_admit_always_admits_the_reference(policy):
    assert admit(verdict("reference", passed=False), policy=policy, reference=True, may_run=False) == ADMITTED


def test_admit_under_off_admits_anything_but_a_shadowed_failure():
    assert admit(None, policy="off", reference=False, may_run=False) == ADMITTED
    assert admit(verdict("fast", passed=False), policy="off", reference=False, may_run=False) == ADMITTED
    barred = admit(verdict("fast", passed=False, where="shadow"), policy="off", reference=False, may_run=False)
    assert barred.barred.startswith("failed qualification")


def test_admit_without_a_verdict_qualifies_when_it_may_run_else_passes_over():
    assert admit(None, policy="require", reference=False, may_run=True).qualify
    assert admit(None, policy="require", reference=False, may_run=False).barred == NOT_YET


def test_admit_bars_a_failed_verdict_with_its_summary():
    why = admit(verdict("fast", passed=False), policy="require", reference=False, may_run=True).barred
    assert why == "failed qualification: empty: wrong"


def test_admit_strict_checks_first_beyond_the_sizes_checked():
    small = verdict("fast", largest=(1, 1, 1))
    rule = dict(policy="strict", reference=False, shape=KEY.shape, axes=KEY.spec.axes)
    assert admit(small, may_run=True, **rule).check
    assert admit(small, may_run=False, **rule) == ADMITTED, "never checked under capture"
    assert admit(verdict("fast", largest=KEY.shape), may_run=True, **rule) == ADMITTED
    assert admit(small, may_run=True, **{**rule, "policy": "require"}) == ADMITTED


# choose


def test_choose_by_the_figures_here_before_the_nearest():
    figures = Figures(found({"slow": 5.0, "fast": 9.0}), found({"fast": 1.0}, source="nearest", at=(9, 9, 9)))
    d = choose(ENTRIES, KEY, figures, {})
    assert (d.chosen.id, d.source) == ("slow", "table")
    d = choose(ENTRIES, KEY, Figures(None, figures.nearest), {})
    assert (d.chosen.id, d.source, d.measured_key) == ("fast", "nearest", (9, 9, 9))


def test_choose_without_figures_goes_by_priority_and_passes_over_the_barred():
    d = choose(ENTRIES, KEY, None, {"fast": "failed qualification: wrong"})
    assert (d.chosen.id, d.source) == ("slow", "priority")
    assert {r.variant: r.reason for r in d.trace}["fast"] == "failed qualification: wrong"


def test_choose_says_how_much_slower_a_pruned_variant_is():
    d = choose(ENTRIES, KEY, Figures(found({"fast": 1.0, "slow": 9.0}, pruned={"slow": 9.0}), None), {})
    assert {r.variant: r.reason for r in d.trace}["slow"].startswith("pruned: >= 9.0x")


def test_choose_runs_rank_0s_choice_unless_barred_here():
    figures = Figures(found({"fast": 1.0, "slow": 9.0}), None)
    d = choose(ENTRIES, KEY, figures, {}, agreed="slow")
    assert (d.chosen.id, d.source) == ("slow", "rank 0") and "this rank's table: fast" in d.note
    assert choose(ENTRIES, KEY, figures, {"slow": "excluded"}, agreed="slow").chosen.id == "fast"


# select


def test_select_forced_runs_the_pin_unless_it_cannot():
    d = select(ENTRIES, KEY, forced="slow", barred={"fast": "failed qualification: wrong"})
    assert (d.chosen.id, d.source) == ("slow", "forced")
    d = select(ENTRIES, KEY, forced="slow", barred={"slow": "left out by patch()"})
    assert d.chosen is None and "cannot run this call" in d.note
    assert "left out by patch()" in str(d)
    assert select(ENTRIES, KEY, forced="nope").chosen is None


def test_select_an_incomplete_row_does_not_beat_a_higher_priority_unmeasured_variant():
    d = select(ENTRIES, KEY, timings={"slow": 1.0, "reference": 2.0})
    assert (d.chosen.id, d.source) == ("fast", "priority") and "incomplete row" in d.note


def test_select_never_chooses_a_variant_rejected_there():
    d = select((REF, SLOW, entry("bad", 99)), KEY, timings={"slow": 3.0, "reference": 9.0}, rejected={"bad"})
    assert d.chosen.id == "slow"
    assert "rejected by calibration" in {r.variant: r.reason for r in d.trace}["bad"]


# winner_of


def test_winner_of_keeps_the_incumbent_within_margin_or_noise():
    assert winner_of({"a": (10.0, None), "b": (9.8, None)}, "a", 0.05).winner == "a"
    assert winner_of({"a": (10.0, 0.2), "b": (9.0, 0.2)}, "a", 0.05).winner == "a", "within the noise"


def test_winner_of_a_challenger_wins_beyond_both():
    r = winner_of({"a": (10.0, 0.01), "b": (5.0, 0.01)}, "a", 0.05)
    assert (r.winner, r.runner_up, r.confidence) == ("b", "a", "clear")
    assert winner_of({"a": (1.0, None)}, None, 0.05).confidence == "single"


# decide


def facts(**kw) -> Facts:
    base = dict(verdicts={"fast": verdict("fast"), "slow": verdict("slow")})
    return Facts(KEY, ENTRIES, "require", **{**base, **kw})


def settle(f: Facts, answers: dict) -> tuple[object, list]:
    """Run ``decide`` as the dispatcher would, answering requests from ``answers``."""
    asked = []
    while True:
        out = decide(f)
        if not isinstance(out, Look | Qualify | Tune | Build):
            return out, asked
        asked.append(out)
        if isinstance(out, Look):
            f = dataclasses.replace(f, figures={**f.figures, out.among: answers.get("figures")})
        elif isinstance(out, Qualify):
            done = {"checked": f.checked | {out.variant}} if out.at_shape else {"asked": f.asked | {out.variant}}
            f = dataclasses.replace(f, verdicts={**f.verdicts, out.variant: answers[out.variant]}, **done)
        elif isinstance(out, Tune):
            f = dataclasses.replace(f, tuned=True, figures={})
            answers = {**answers, "figures": answers.get("tuned")}
        else:
            f = dataclasses.replace(f, built={**f.built, out.variant: answers.get(("build", out.variant))})


def test_decide_looks_up_the_figures_among_the_admitted_first():
    f = facts(verdicts={"fast": verdict("fast", passed=False), "slow": verdict("slow")})
    assert decide(f) == Look(frozenset({"reference", "slow"}))
    d, _ = settle(f, {})
    assert d.chosen.id == "slow" and "failed qualification" in str(d)


def test_decide_qualifies_the_chosen_variant_then_decides():
    d, asked = settle(facts(verdicts={}), {"fast": verdict("fast")})
    assert Qualify("fast") in asked and d.chosen.id == "fast"
    d, _ = settle(facts(verdicts={}), {"fast": verdict("fast", passed=False), "slow": verdict("slow")})
    assert d.chosen.id == "slow", "a failed qualification passes to the next choice"


def test_decide_under_capture_passes_over_the_unqualified_provisionally():
    d, asked = settle(facts(verdicts={}, may_run=False), {})
    assert not any(isinstance(a, Qualify) for a in asked)
    assert d.chosen.id == "reference" and d.provisional


def test_decide_a_preview_says_the_call_would_qualify():
    d, _ = settle(facts(verdicts={}, may_run=False, preview=True), {})
    assert d.chosen.id == "fast" and NOT_YET in d.note and not d.provisional


def test_decide_strict_qualifies_then_checks_at_the_shape_in_one_call():
    """A variant without a verdict under KV_QUALIFY=strict is qualified, then checked at the
    call's shape when that is beyond its cases, before it runs: each once."""
    f = dataclasses.replace(facts(verdicts={}), policy="strict")
    d, asked = settle(f, {"fast": verdict("fast", largest=(1, 1, 1))})
    assert asked.count(Qualify("fast")) == 1 and asked.count(Qualify("fast", at_shape=True)) == 1
    assert asked.index(Qualify("fast")) < asked.index(Qualify("fast", at_shape=True))
    assert d.chosen.id == "fast"


def test_decide_strict_checks_at_the_shape_first():
    f = dataclasses.replace(facts(verdicts={"fast": verdict("fast", largest=(1, 1, 1))}), policy="strict")
    d, asked = settle(f, {"fast": verdict("fast", largest=KEY.shape)})
    assert Qualify("fast", at_shape=True) in asked and d.chosen.id == "fast"
    d, _ = settle(dataclasses.replace(f, may_run=False), {})
    assert "checked at smaller sizes only" in d.note


def test_decide_tunes_an_unmeasured_key_once_unless_rank_0_agreed():
    tuned = Figures(found({"slow": 1.0, "fast": 2.0}), None)
    d, asked = settle(facts(tune=True), {"tuned": tuned})
    assert Tune() in asked and (d.chosen.id, d.source) == ("slow", "table")
    d, asked = settle(facts(tune=True, agreed="slow"), {})
    assert Tune() not in asked and (d.chosen.id, d.source) == ("slow", "rank 0")
    _, asked = settle(facts(tune=True), {"figures": tuned})
    assert Tune() not in asked, "measured here already"


def test_decide_builds_the_choice_and_falls_back_when_the_build_fails():
    d, asked = settle(facts(build=True), {("build", "fast"): "build failed: no compiler"})
    assert asked[-2:] == [Build("fast"), Look(frozenset({"reference", "slow"}))] or Build("slow") in asked
    assert d.chosen.id == "slow" and "build failed: no compiler" in str(d)
    assert Build("fast") not in settle(facts(), {})[1], "only a call that runs it builds it"


def test_decide_forced_runs_through_admit_for_its_note():
    d, _ = settle(facts(forced="fast", verdicts={}), {})
    assert (d.chosen.id, d.source) == ("fast", "forced") and "forced, unqualified" in d.note
    d, _ = settle(facts(forced="fast", verdicts={"fast": verdict("fast", passed=False)}), {})
    assert d.note == "forced, although it failed qualification: empty: wrong"
    assert settle(facts(forced="reference", verdicts={}), {})[0].note == ""
    d, _ = settle(facts(forced="fast", excluded={"fast": "left out by patch()"}), {})
    assert d.chosen is None and "left out by patch()" in str(d)


def test_decide_passes_over_excluded_variants_with_the_reason():
    d, _ = settle(facts(excluded={"fast": "not built; patch() leaves it out"}), {})
    assert d.chosen.id == "slow" and "patch() leaves it out" in str(d)


def test_decide_nothing_runnable_says_why():
    d = decide(Facts(KEY._replace(dtype="float64"), (entry("f16", dtypes={"float16"}),), "require", {}))
    assert d.chosen is None and "float64" in str(d)


def test_admissions_qualifies_each_then_lists_those_barred():
    f = facts(verdicts={"slow": verdict("slow", passed=False)}, excluded={"x": "rank 0 only"})
    assert admissions(f) == Qualify("fast")
    f = dataclasses.replace(f, verdicts={**f.verdicts, "fast": verdict("fast")}, asked=frozenset({"fast"}))
    assert admissions(f) == {"x": "rank 0 only", "slow": "failed qualification: empty: wrong"}


# policy_from, qualifies


@pytest.mark.parametrize("raw, policy", [("require", "require"), ("strict", "strict"), ("off", "off"),
                                         ("STRICT", "strict"), (" Off\n", "off"), ("", "require"),
                                         ("   ", "require")])
def test_policy_from_reads_kv_qualify_in_any_case_empty_meaning_require(raw, policy):
    assert policy_from(raw) == policy


def test_policy_from_names_the_choices_and_the_bad_value():
    with pytest.raises(ValueError) as info:
        policy_from("lenient")
    assert str(info.value) == "KV_QUALIFY: expected one of require, strict, off, got 'lenient'"


def test_qualifies_under_every_policy_but_off():
    assert [qualifies(p) for p in ("require", "strict", "off")] == [True, True, False]


# is_reference


def test_is_reference_goes_by_the_function_not_the_id():
    assert is_reference(REF, KEY.spec)
    assert not is_reference(FAST, KEY.spec)
    alias = RegisteredVariant(Variant(id="alias", op="causal_conv1d_fn", version="1", fn=KEY.spec.reference.fn,
                                      capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"})), "test", "1+0")
    assert is_reference(alias, KEY.spec), "another name for the reference's function is the reference"


# with_note


def test_with_note_sets_a_first_note_and_appends_later_ones():
    d = select(ENTRIES, KEY)
    assert d.note == "no measurements for this key"
    noted = with_note(d, "forced, unqualified")
    assert noted.note == "no measurements for this key; forced, unqualified"
    assert (noted.chosen, noted.source, noted.trace) == (d.chosen, d.source, d.trace)
    assert d.note == "no measurements for this key", "the decision it was given is left as it was"
    bare = dataclasses.replace(d, note="")
    assert with_note(bare, "rank 0's choice").note == "rank 0's choice"


# wants_tuning


def test_wants_tuning_only_when_asked_and_only_once():
    assert wants_tuning(facts(tune=True), None)
    assert not wants_tuning(facts(), None), "KV_TUNE off (or under capture)"
    assert not wants_tuning(facts(tune=True, tuned=True), None), "measured once for this call already"


def test_wants_tuning_never_for_a_key_the_ranks_agreed_on():
    assert not wants_tuning(facts(tune=True, agreed="slow"), None)
    assert not wants_tuning(facts(tune=True, agreed="slow"), Figures(None, found({"slow": 1.0}, source="nearest")))


def test_wants_tuning_only_without_figures_at_the_calls_own_shape():
    f = facts(tune=True)
    nearest = found({"fast": 1.0}, source="nearest", at=(9, 9, 9))
    assert wants_tuning(f, Figures(None, None))
    assert wants_tuning(f, Figures(None, nearest)), "a neighbour's figures are not this shape's"
    assert not wants_tuning(f, Figures(found({"fast": 1.0}), nearest))


# combined_noise


def test_combined_noise_adds_independent_noises_in_quadrature():
    assert combined_noise(0.03, 0.04) == pytest.approx(0.05)
    assert combined_noise(0.02) == pytest.approx(0.02)
    assert combined_noise(0.01, 0.01, 0.01, 0.01) == pytest.approx(0.02)


def test_combined_noise_counts_an_unknown_noise_as_none():
    assert combined_noise(None, 0.05) == pytest.approx(0.05)
    assert combined_noise(None, None) == 0.0
    assert combined_noise() == 0.0
