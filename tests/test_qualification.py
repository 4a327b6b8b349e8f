"""No wrong answer can win: variants as fast as the fastest built-in, wrong the way real kernels are
wrong, registered by a plugin with the highest priority, are never chosen by any route where they
were checked, and the dispatched call still equals the reference with its inputs untouched."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers.calibration import quick
from helpers.variants import variant

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tuning.verify import verify
from kernel_variants.kernels import cpu_native, cpu_rms_norm
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d._cases import make_case
from kernel_variants.ops.rms_norm import NormCapabilities
from kernel_variants.plugin import Capabilities

FN, UPDATE, RMS, ADD = "causal_conv1d_fn", "causal_conv1d_update", "gemma_rms_norm", "add_gemma_rms_norm"
PLAIN, PLAIN_ADD = "rms_norm", "fused_add_rms_norm"  # vLLM IR's semantics
FAST = {FN: cpu_native.causal_conv1d_fn, UPDATE: cpu_native.causal_conv1d_update,
        RMS: cpu_native.gemma_rms_norm, ADD: cpu_native.add_gemma_rms_norm,
        PLAIN: cpu_rms_norm.rms_norm, PLAIN_ADD: cpu_rms_norm.fused_add_rms_norm}
CONV_CAPS = dict(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, width=(2, 4), noncontiguous_states=True)
# Windows of at most 50 ms: some variants here are slow on purpose, and speed is not the point.
TIMING = quick(window_budget_s=0.05)


def _slots(op, args, kwargs):
    return kwargs.get("cache_indices") if op == FN else kwargs.get("conv_state_indices")


def _pad_rows(op, args, kwargs, y):
    """The output rows of padded sequences, as a boolean mask over y's leading dims."""
    slots, pad = _slots(op, args, kwargs), kwargs.get("pad_slot_id", -1)
    if slots is None:
        return None
    padded = slots == pad
    qsl = kwargs.get("query_start_loc")
    if qsl is None:
        return padded
    rows = torch.zeros(y.shape[0], dtype=torch.bool)
    for b in torch.nonzero(padded).flatten().tolist():
        rows[qsl[b]:qsl[b + 1]] = True
    return rows


def nan_on_pads(op):
    def fn(*args, **kwargs):
        y = FAST[op](*args, **kwargs)
        rows = _pad_rows(op, args, kwargs, y)
        if rows is not None and rows.any():
            y[rows] = float("nan")
        return y
    return fn


def writes_input(op):
    def fn(*args, **kwargs):
        y = FAST[op](*args, **kwargs)
        args[0].mul_(1.5)
        return y
    return fn


def state_outside_view(op):
    def fn(*args, **kwargs):
        y = FAST[op](*args, **kwargs)
        pool = kwargs["conv_states"] if op == FN else args[1]
        if pool is not None and pool.storage_offset() > 0:  # a kernel that assumes a dense pool
            torch.empty(0, dtype=pool.dtype).set_(pool.untyped_storage())[0] = 7.0
        return y
    return fn


def wrong_above(op, axis_size):
    def fn(*args, **kwargs):
        y = FAST[op](*args, **kwargs)
        first = y[0] if isinstance(y, tuple) else y
        big = first.shape[-1] > axis_size if op in (FN, UPDATE) else first.numel() // first.shape[-1] > axis_size
        if big:
            first.mul_(1.05)
        return y
    return fn


def ignores_initial_state(op):
    def fn(*args, **kwargs):
        if op == FN:
            flags = kwargs.get("has_initial_state")
            kwargs = {**kwargs, "has_initial_state": None if flags is None else torch.zeros_like(flags)}
            return FAST[op](*args, **kwargs)
        x, pool, *rest = args
        y = FAST[op](x, torch.zeros_like(pool), *rest, **kwargs)  # outputs from a zero history...
        FAST[op](x.clone(), pool, *rest, **kwargs)  # ...while the state moves on as it should
        return y
    return fn


def zeros(op):
    def fn(*args, **kwargs):
        y = FAST[op](*args, **kwargs)
        return tuple(torch.zeros_like(t) for t in y) if isinstance(y, tuple) else torch.zeros_like(y)
    return fn


def slightly_off(op):
    def fn(*args, **kwargs):
        y = FAST[op](*args, **kwargs)
        (y[0] if isinstance(y, tuple) else y).mul_(1.01)
        return y
    return fn


def wrong_dtype(op):
    def fn(*args, **kwargs):
        return FAST[op](*args, **kwargs).double()
    return fn


def wrong_residual_sum(op):
    def fn(*args, **kwargs):
        out, s = FAST[op](*args, **kwargs)
        return out, s + 0.125
    return fn


def crashes(op):
    def fn(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSEGV)  # what a kernel reading past its pool does
    return fn


def reads_indices_as_int32(op):
    """A kernel written for int32 slot ids, handed the caller's int64 ones as they come."""
    name = "cache_indices" if op == FN else "conv_state_indices"

    def fn(*args, **kwargs):
        idx = kwargs.get(name)
        if idx is not None and idx.dtype == torch.int64:
            kwargs = {**kwargs, name: idx.view(torch.int32)[: idx.shape[0]]}
        return FAST[op](*args, **kwargs)
    return fn


def ignores_x_offset(op):
    """A kernel that takes x's data pointer as the start of its allocation (a slice of a larger
    projection is read from the wrong place)."""
    def fn(*args, **kwargs):
        x = args[0]
        at_base = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, x.shape, x.stride())
        return FAST[op](at_base, *args[1:], **kwargs)
    return fn


def pads_only_negative(op):
    """A kernel that takes only negative ids for pads and clamps the rest into the pool: a pad id
    past the pool's end becomes its last slot."""
    name = "cache_indices" if op == FN else "conv_state_indices"

    def fn(*args, **kwargs):
        idx, pad = kwargs.get(name), kwargs.get("pad_slot_id", -1)
        if idx is not None and pad >= 0:
            pool = kwargs["conv_states"] if op == FN else args[1]
            kwargs = {**kwargs, name: idx.clamp(max=pool.shape[0] - 1), "pad_slot_id": -1}
        return FAST[op](*args, **kwargs)
    return fn


CONV_BAD = [nan_on_pads, writes_input, state_outside_view, ignores_initial_state, zeros, slightly_off, wrong_dtype,
            reads_indices_as_int32, ignores_x_offset, pads_only_negative]
RMS_BAD = [zeros, writes_input, ignores_x_offset]


def _variant(op, make, *, isolate=False, priority=100):
    rms = dict(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"})
    caps = (ConvCapabilities(varlen=op == FN, num_accepted_tokens=op == UPDATE, **CONV_CAPS) if op in (FN, UPDATE)
            else NormCapabilities(**rms, variance_size=True) if op in (PLAIN, PLAIN_ADD) else Capabilities(**rms))
    return variant("evil", op, make(op), capabilities=caps, priority=priority, isolate=isolate)


def _calls(op):
    """Calls a serving engine makes: padded (both pad forms), packed, with initial state."""
    if op == FN:
        return [make_case(FN, 4, 64, 5, pad=True, poison=True), make_case(FN, 4, 64, 5, pad=True, pad_slot_id=0,
                                                                            noncontig=True, poison=True),
                make_case(FN, 4, 64, 3, varlen=True, pad=True, poison=True),
                make_case(FN, 4, 64, 5, pad=True, index_dtype=torch.int64, offset=True, poison=True)]
    if op == UPDATE:
        return [make_case(UPDATE, 4, 64, 1, pad=True, poison=True),
                make_case(UPDATE, 4, 64, 1, pad=True, pad_slot_id=0, noncontig=True, poison=True),
                make_case(UPDATE, 4, 64, 3, spec=True, pad=True, extra_rows=1, poison=True),
                make_case(UPDATE, 4, 64, 1, pad=True, index_dtype=torch.int64, offset=True, poison=True)]
    spec = dispatcher().registry.spec(op)
    return [spec.make_case((6, 96), dtype=torch.float32), spec.make_case((1, 64), dtype=torch.float32)]


def _assert_never_chosen(op, calls=None):
    public = getattr(kv, op)
    calls = calls if calls is not None else _calls(op)
    assert calls, f"no call of {op} to check"
    for case in calls:
        # The dispatched call itself, judged like a variant: outputs, state and inputs.
        assert verify(public, case) is None
        decision = kv.explain(op, *case.args, **case.kwargs)
        assert decision.chosen is not None and decision.chosen.id != "evil", str(decision)
        evil = next(r for r in decision.trace if r.variant == "evil")
        assert not evil.accepted and "failed qualification" in evil.reason, str(decision)
        assert kv.bind(op, *case.args, **case.kwargs).variant != "evil"
    return evil.reason


@pytest.mark.parametrize("op", [FN, UPDATE])
@pytest.mark.parametrize("make", CONV_BAD, ids=lambda f: f.__name__)
def test_a_wrong_conv_variant_is_never_chosen(with_variants, op, make):
    with_variants(_variant(op, make))
    _assert_never_chosen(op)


@pytest.mark.parametrize("op", [RMS, ADD, PLAIN, PLAIN_ADD])
@pytest.mark.parametrize("make", RMS_BAD, ids=lambda f: f.__name__)
def test_a_wrong_rmsnorm_variant_is_never_chosen(with_variants, op, make):
    with_variants(_variant(op, make))
    _assert_never_chosen(op)


@pytest.mark.parametrize(("op", "output"), [(ADD, "residual_sum"), (PLAIN_ADD, "residual")])
def test_a_wrong_residual_sum_is_never_chosen(with_variants, op, output):
    with_variants(_variant(op, wrong_residual_sum))
    assert output in _assert_never_chosen(op)


@pytest.mark.parametrize("op", [FN, UPDATE])
def test_nan_on_pad_rows_is_caught_by_the_pad_cases(with_variants, op):
    with_variants(_variant(op, nan_on_pads))
    reason = _assert_never_chosen(op)
    assert "pad" in reason and "NaN" in reason, reason


@pytest.mark.parametrize("op", [FN, UPDATE, RMS, ADD, PLAIN, PLAIN_ADD])
def test_a_crashing_variant_fails_in_its_child_and_the_caller_lives(with_variants, op):
    with_variants(_variant(op, crashes, isolate=True))
    reason = _assert_never_chosen(op)
    assert "SIGSEGV" in reason
    v = next(v for v in kv.verdicts() if v.variant == "evil")
    assert v.where == "child" and not v.passed


@pytest.mark.parametrize(("op", "shapes"), [(FN, [(2, 256, 16), (2, 1024, 16)]), (UPDATE, [(8, 256, 1), (8, 1024, 1)]),
                                             (RMS, [(16, 256), (128, 256)]), (ADD, [(16, 256), (128, 256)])])
def test_wrong_only_at_large_sizes_is_caught_where_calibrated_and_fails_the_class(with_variants, op, shapes):
    """Right on every small edge case, wrong above D=512 (T=64 for RMSNorm): the check at the
    calibrated shape catches it, and the class is failed, so no route chooses it anywhere."""
    with_variants(_variant(op, lambda o: wrong_above(o, 512 if o in (FN, UPDATE) else 64)))
    result = kv.calibrate(op, shapes, variants=["evil", "cpu_native"], **TIMING)
    rejected = {m.shape: m.reason for m in result.rejected() if m.variant == "evil"}
    assert shapes[1] in rejected and "check at" in rejected[shapes[1]]
    assert all(w is None or w.variant != "evil" for w in result.winners.values())
    # The table, the nearest shape and priority alike, on calls of the class it was calibrated in
    # (a packed prefill or a verify step is a class of its own, qualified on its own).
    reason = _assert_never_chosen(op, [c for c in _calls(op) if c.get("query_start_loc") is None
                                       and c.get("num_accepted_tokens") is None])
    assert "check at" in reason


@pytest.mark.parametrize("op", [FN, RMS])
def test_strict_checks_a_shape_beyond_every_checked_one_before_running_it(with_variants, monkeypatch, op):
    monkeypatch.setenv("KV_QUALIFY", "strict")
    with_variants(_variant(op, lambda o: wrong_above(o, 512 if o == FN else 64)))
    spec = dispatcher().registry.spec(op)
    big = (2, 1024, 8) if op == FN else (256, 128)
    case = spec.make_case(big, dtype=torch.float32)
    kv.qualify(op, variants=["evil"], dtype="float32")
    decision = kv.explain(op, *case.args, **case.kwargs)
    assert decision.chosen.id == "evil" and "smaller sizes only" in decision.note  # passed the small cases
    assert verify(getattr(kv, op), case) is None  # the call checks it at this shape first, and bars it
    assert kv.explain(op, *case.args, **case.kwargs).chosen.id != "evil"


def test_require_says_when_a_call_is_beyond_every_checked_shape(with_variants):
    with_variants(_variant(FN, lambda op: FAST[op]))  # a right one
    case = make_case(FN, 2, 2048, 8)
    kv.causal_conv1d_fn(*case.args, **case.kwargs)
    decision = kv.explain(FN, *case.args, **case.kwargs)
    assert decision.chosen.id == "evil" and "D=2048 > " in decision.note


def test_tuning_online_never_times_a_wrong_variant(with_variants, monkeypatch):
    monkeypatch.setenv("KV_TUNE", "1")
    with_variants(_variant(FN, writes_input))
    case = make_case(FN, 2, 64, 8)
    assert verify(kv.causal_conv1d_fn, case) is None
    row = next(r for r in kv.table(FN) if r.shape == (2, 64, 8))
    assert "evil" not in row.times_us and "evil" in row.rejected


def test_a_forced_variant_runs_but_explain_says_it_failed(with_variants):
    with_variants(_variant(FN, zeros))
    case = make_case(FN, 2, 32, 4)
    kv.causal_conv1d_fn(*case.args, **case.kwargs)  # qualifies (and bars) it
    with kv.force(causal_conv1d_fn="evil"):
        decision = kv.explain(FN, *case.args, **case.kwargs)
        assert decision.chosen.id == "evil" and "failed qualification" in decision.note
        assert not kv.causal_conv1d_fn(*case.args, **case.kwargs).any()  # as the user insisted


def test_no_qualification_runs_while_a_graph_is_captured(with_variants, monkeypatch):
    """Under capture only variants already qualified are eligible: an unqualified one is passed
    over (nothing runs its cases then), and qualifies on the next eager call."""
    from kernel_variants._runtime import dispatcher as _dispatcher

    with_variants(_variant(FN, lambda op: FAST[op], isolate=True))
    case = make_case(FN, 2, 32, 4)
    key = dispatcher().registry.spec(FN).key_of_case(case)
    monkeypatch.setattr(_dispatcher, "capturing", lambda device: True)
    decision = dispatcher().decide(key)
    assert decision.chosen.id != "evil"
    assert "not qualified on this device yet" in next(r.reason for r in decision.trace if r.variant == "evil")
    assert kv.verdicts() == []
    monkeypatch.setattr(_dispatcher, "capturing", lambda device: False)
    assert dispatcher().decide(key).chosen.id == "evil"


def test_policy_off_chooses_without_checking_and_says_so_once(with_variants, monkeypatch, capfd):
    monkeypatch.setenv("KV_QUALIFY", "off")
    with_variants(_variant(FN, zeros))
    case = make_case(FN, 2, 32, 4)
    assert kv.explain(FN, *case.args, **case.kwargs).chosen.id == "evil"
    kv.explain(FN, *case.args, **case.kwargs)
    assert capfd.readouterr().err.count("KV_QUALIFY=off") == 1


def test_a_bad_policy_names_the_variable(monkeypatch):
    monkeypatch.setenv("KV_QUALIFY", "sometimes")
    with pytest.raises(ValueError, match="KV_QUALIFY: expected one of require, strict, off, got 'sometimes'"):
        kv.reload()
    monkeypatch.delenv("KV_QUALIFY")


def test_every_builtin_qualifies_on_this_cpu():
    """No false alarm: every available built-in passes every class it claims here (fp32, bf16,
    fp16 at the default features), with the number of cases each ran."""
    verdicts = kv.qualify()
    failed = [f"{v.group.op} {v.group.dtype} {v.variant}: {v.failed_case}: {v.reason}" for v in verdicts if not v.passed]
    assert not failed, "\n".join(failed)
    ran = {(v.group.op, v.variant) for v in verdicts}
    assert {(op, "cpu_native") for op in FAST} <= ran and (FN, "aten") in ran and (UPDATE, "torch_shift") in ran
    assert all(v.cases >= 9 for v in verdicts)


def test_verdicts_persist_follow_the_version_and_clear(with_variants):
    with_variants(_variant(FN, lambda op: FAST[op]))
    assert [v.passed for v in kv.qualify(FN, variants=["evil"], dtype="float32")] == [True]
    first = kv.verdicts()[0]
    kv.reload()  # a new process would read it back: nothing is qualified again
    with_variants(_variant(FN, lambda op: FAST[op]))
    assert kv.qualify(FN, variants=["evil"], dtype="float32")[0].qualified_at == first.qualified_at
    # Another version of the variant is another kernel: its verdict is redone.
    with_variants(_variant(FN, lambda op: FAST[op]).model_copy(update={"version": "2"}))
    assert kv.qualify(FN, variants=["evil"], dtype="float32")[0].qualified_at > first.qualified_at
    assert kv.clear_verdicts(FN, "evil") == 1 and kv.verdicts() == []


def test_export_and_import_carry_verdicts_with_the_fingerprint(with_variants, tmp_path):
    with_variants(_variant(FN, zeros))
    kv.qualify(FN, variants=["evil"], dtype="float32")
    doc = tmp_path / "table.json"
    kv.export_table(doc)
    assert kv.clear_verdicts() == 1
    report = kv.import_table(doc)
    assert report.verdicts == 1
    assert [v.summary().startswith("failed qualification") for v in kv.verdicts()] == [True]


def test_the_compiled_graph_runs_only_qualified_variants(with_variants):
    """Under torch.compile the op is one custom op that dispatches when the graph runs: the
    same rule applies there (its first run qualifies, as an eager call would)."""
    with_variants(_variant(FN, zeros))
    case = make_case(FN, 2, 32, 4, pad=True, poison=True)
    compiled = torch.compile(lambda *a, **k: kv.causal_conv1d_fn(*a, **k) * 1.0, fullgraph=True)
    assert verify(compiled, case, layout=False) is None


def test_policy_off_still_rejects_a_wrong_variant_at_a_calibrated_shape(with_variants, monkeypatch):
    monkeypatch.setenv("KV_QUALIFY", "off")
    with_variants(_variant(FN, zeros))
    result = kv.calibrate(FN, [(2, 64, 16)], variants=["evil", "cpu_native"], **TIMING)
    assert [m.variant for m in result.rejected()] == ["evil"]
    assert kv.verdicts() == [], "off keeps no verdicts"


def test_a_verdict_turning_to_failure_drops_memoised_decisions(with_variants, monkeypatch):
    """strict: a call at a small D runs the variant (memoised); a call at a large D checks it
    there and fails the class; the small call then no longer runs it, memo or not."""
    monkeypatch.setenv("KV_QUALIFY", "strict")
    with_variants(_variant(FN, lambda o: wrong_above(o, 512)))
    small, large = make_case(FN, 2, 64, 8), make_case(FN, 2, 1024, 8)
    kv.causal_conv1d_fn(*small.args, **small.kwargs)
    assert [h.vid for h in dispatcher().memo.values()] == ["evil"]
    assert verify(kv.causal_conv1d_fn, large) is None
    kv.causal_conv1d_fn(*small.args, **small.kwargs)
    assert "evil" not in [h.vid for h in dispatcher().memo.values()]


def test_a_child_killed_by_the_system_is_no_verdict_on_the_variant(with_variants):
    """SIGKILL is the OOM killer's or an operator's: the variant is passed over in this process
    and qualified again later, never stored as failed."""
    def killed(op):
        def fn(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        return fn

    with_variants(_variant(FN, killed, isolate=True))
    case = make_case(FN, 2, 32, 4)
    assert verify(kv.causal_conv1d_fn, case) is None
    trace = kv.explain(FN, *case.args, **case.kwargs).trace
    assert "SIGKILL (not a kernel fault" in next(r.reason for r in trace if r.variant == "evil")
    assert [v.variant for v in kv.verdicts()] == ["cpu_native"]  # evil's outcome is not stored


def test_a_fork_that_fails_leaves_the_call_running(with_variants, monkeypatch):
    from kernel_variants._tuning import isolate as _isolate

    with_variants(_variant(FN, lambda op: FAST[op], isolate=True))
    monkeypatch.setattr(_isolate.os, "fork", lambda: (_ for _ in ()).throw(BlockingIOError(11, "no processes")))
    case = make_case(FN, 2, 32, 4)
    assert verify(kv.causal_conv1d_fn, case) is None
    assert "qualification itself failed: BlockingIOError" in next(
        r.reason for r in kv.explain(FN, *case.args, **case.kwargs).trace if r.variant == "evil")


def test_verdicts_hold_for_every_thread_count(with_variants):
    threads = torch.get_num_threads()
    with_variants(_variant(FN, lambda op: FAST[op]))
    first = kv.qualify(FN, variants=["evil"], dtype="float32")[0]
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        with_variants(_variant(FN, lambda op: FAST[op]))
        assert kv.qualify(FN, variants=["evil"], dtype="float32")[0].qualified_at == first.qualified_at
    finally:
        torch.set_num_threads(threads)


def test_a_decision_made_under_capture_is_not_memoised(with_variants, monkeypatch):
    from kernel_variants._runtime import dispatcher as _dispatcher

    with_variants(_variant(FN, lambda op: FAST[op]))
    case = make_case(FN, 2, 32, 4)
    monkeypatch.setattr(_dispatcher, "capturing", lambda device: True)
    kv.causal_conv1d_fn(*case.args, **case.kwargs)  # evil is passed over: it has no verdict yet
    assert dispatcher().memo == {}
    monkeypatch.setattr(_dispatcher, "capturing", lambda device: False)
    kv.causal_conv1d_fn(*case.args, **case.kwargs)
    assert [h.vid for h in dispatcher().memo.values()] == ["evil"]


def test_a_variant_that_hands_out_a_reused_buffer_fails(with_variants):
    def reused(op):
        buf = torch.empty(0)

        def fn(*args, **kwargs):
            y = FAST[op](*args, **kwargs)
            return buf.resize_(y.shape).copy_(y)
        return fn

    with_variants(_variant(RMS, reused))
    assert "buffer it reuses" in _assert_never_chosen(RMS)


def test_the_spawned_child_qualifies_from_the_installed_plugins():
    """The accelerator path (a fresh interpreter, since CUDA does not survive fork), run on the
    CPU: it loads the installed plugins, qualifies the variant there and reports back."""
    from kernel_variants._tuning import isolate as _isolate

    registry = dispatcher().registry
    spec = registry.spec(UPDATE)
    outcome = _isolate._spawned(spec, registry.get(UPDATE, "torch_shift"), spec.features(), torch.float32, "cpu", 300)
    assert outcome["reason"] == "" and outcome["cases"] >= 15


@pytest.mark.parametrize(("op", "features"), [
    (FN, dict(varlen=True)), (FN, dict(states=False)), (FN, dict(width=2)),
    (FN, dict(width=3, bias=False, activation="none")), (UPDATE, dict(spec=True)),
    (UPDATE, dict(spec=True, width=3)), (UPDATE, dict(width=2, activation="none")),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_every_builtin_qualifies_in_every_conv_class_it_claims(op, features):
    verdicts = kv.qualify(op, dtype="bfloat16", **features)
    assert verdicts, "no built-in claims this class"
    assert [f"{v.variant}: {v.failed_case}: {v.reason}" for v in verdicts if not v.passed] == []


def _stored_verdict(op="evil"):
    return next(v for v in kv.verdicts() if v.variant == op)


def test_a_verdict_of_another_suite_is_qualified_again(with_variants):
    """A verdict says which suite it ran: once the op's cases, check options, reference or the
    judging code change, an old pass is no pass, and the variant runs the new suite once."""
    import dataclasses

    from kernel_variants._tuning.cases import suite_of

    with_variants(_variant(FN, lambda op: FAST[op]))
    first = kv.qualify(FN, variants=["evil"], dtype="float32")[0]
    spec = dispatcher().registry.spec(FN)
    assert first.passed and first.suite == suite_of(spec)
    table = dispatcher().table
    table.store.set(first.storage_key(), first.model_copy(update={"suite": "an-older-one"}).model_dump_json())
    kv.reload()
    with_variants(_variant(FN, lambda op: FAST[op]))
    assert kv.verdicts() == []  # the old suite's pass is not listed as a qualification
    again = kv.qualify(FN, variants=["evil"], dtype="float32")[0]
    assert again.qualified_at > first.qualified_at and again.suite == suite_of(spec)
    # A new trap is a new suite; the same cases are the same suite.
    more = dict(spec.edge_cases, **{"another": dict(shape=(2, 16, 3), pad=True)})
    assert suite_of(dataclasses.replace(spec, edge_cases=more)) != suite_of(spec)
    assert suite_of(dataclasses.replace(spec, edge_cases=dict(spec.edge_cases))) == suite_of(spec)


def test_a_failure_written_while_a_pass_ran_stands(with_variants, monkeypatch):
    """Two processes qualify one class: the one whose check failed at a calibrated shape wrote
    its failure while the other still ran the edge cases. The later pass does not clear it."""
    from kernel_variants._tuning import qualify as q

    with_variants(_variant(FN, lambda op: FAST[op]))
    real = q.run_qualification

    def meanwhile(spec, rv, features, **kw):
        outcome = real(spec, rv, features, **kw)
        table = dispatcher().table
        theirs = q.verdict_from({"cases": 1, "failed_case": "check at B=2, D=1024, L=16", "reason": "output: wrong"},
                                key=key, rv=rv, fingerprint={}, fingerprint_id=fpid, where="process", seconds=1.0)
        table.store.set(theirs.storage_key(), theirs.model_dump_json())
        return outcome

    monkeypatch.setattr(q, "run_qualification", meanwhile)
    case = make_case(FN, 2, 32, 4)
    key = kv.explain(FN, *case.args, **case.kwargs).key
    rv = dispatcher().registry.get(FN, "evil")
    _, fpid = dispatcher().qualifier._where(key)
    v = dispatcher().qualifier.qualify(rv, key)
    assert not v.passed and v.failed_case.startswith("check at")
    kv.reload()
    with_variants(_variant(FN, lambda op: FAST[op]))
    assert not _stored_verdict().passed


def test_redo_keeps_a_failure_at_a_calibrated_shape_until_that_check_passes(with_variants):
    """``qualify(redo=True)`` runs the edge cases again, and the check that failed: a variant
    wrong only at a calibrated size stays failed; one whose failing check now passes (a forged
    or transient failure) is cleared, with what it covered before."""
    with_variants(_variant(FN, lambda o: wrong_above(o, 512)))
    kv.calibrate(FN, [(2, 1024, 16)], variants=["evil", "cpu_native"], **TIMING)
    failed = _stored_verdict()
    assert not failed.passed and failed.failed_shape == (2, 1024, 16)
    redone = kv.qualify(FN, variants=["evil"], dtype="float32", redo=True)[0]
    assert not redone.passed and redone.failed_shape == (2, 1024, 16) and "check at" in redone.summary()
    # The same failure on a right kernel: the redo runs that check, it passes, the pass stands.
    with_variants(_variant(FN, lambda op: FAST[op]))
    right = kv.qualify(FN, variants=["evil"], dtype="float32")[0]
    forged = right.model_copy(update={"passed": False, "failed_case": "check at B=2, D=1024, L=16",
                                      "failed_shape": (2, 1024, 16), "reason": "output: wrong"})
    dispatcher().table.store.set(forged.storage_key(), forged.model_dump_json())
    dispatcher().qualifier.forget()
    assert not _stored_verdict().passed
    cleared = kv.qualify(FN, variants=["evil"], dtype="float32", redo=True)[0]
    assert cleared.passed and cleared.largest[1] >= 1024 and cleared.cases == right.cases + 1


def test_an_imported_pass_that_ran_no_case_is_refused(with_variants, tmp_path):
    import json

    with_variants(_variant(FN, lambda op: FAST[op]))
    kv.qualify(FN, variants=["evil"], dtype="float32")
    doc = tmp_path / "table.json"
    kv.export_table(doc)
    data = json.loads(doc.read_text())
    for v in data["verdicts"]:
        v["cases"] = 0
    doc.write_text(json.dumps(data))
    assert kv.clear_verdicts() == 1
    report = kv.import_table(doc)
    assert report.verdicts == 0 and report.verdicts_empty == 1 and kv.verdicts() == []


@pytest.mark.parametrize("op", [FN, UPDATE])
def test_a_one_sequence_variant_meets_the_pad_too(with_variants, op):
    """A variant limited to B=1 runs the edge cases moved to B=1, the pad case included (the
    only sequence is the pad): one that takes the pad id for a slot fails there."""
    def takes_pad_for_a_slot(*args, **kwargs):
        name = "cache_indices" if op == FN else "conv_state_indices"
        idx = kwargs.get(name)
        if idx is not None:
            pool = kwargs["conv_states"] if op == FN else args[1]
            kwargs = {**kwargs, name: torch.where(idx == kwargs.get("pad_slot_id", -1), pool.shape[0] - 1, idx),
                      "pad_slot_id": -7}
        return FAST[op](*args, **kwargs)

    caps = ConvCapabilities(limits={"B": (1, 1)}, varlen=op == FN, num_accepted_tokens=op == UPDATE, **CONV_CAPS)
    with_variants(variant("evil", op, takes_pad_for_a_slot, capabilities=caps, priority=100))
    v = kv.qualify(op, variants=["evil"], dtype="float32")[0]
    assert not v.passed and "pad" in v.failed_case, v.summary()
    case = make_case(op, 1, 64, 5 if op == FN else 1, pad=True, poison=True)
    assert verify(getattr(kv, op), case) is None
    assert kv.explain(op, *case.args, **case.kwargs).chosen.id != "evil"


@pytest.mark.parametrize("op", [FN, RMS])
def test_an_out_written_from_its_allocation_s_start_fails(with_variants, op):
    """A caller's out= may start inside its allocation: a kernel writing from the allocation's
    start instead writes outside the tensor it was given."""
    def at_base(*args, out=None, **kwargs):
        y = FAST[op](*args, **kwargs)
        if out is None:
            return y
        torch.empty(0, dtype=out.dtype).set_(out.untyped_storage(), 0, out.shape, out.stride()).copy_(y)
        return out

    caps = (ConvCapabilities(takes_out=True, **CONV_CAPS) if op == FN
            else Capabilities(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True))
    with_variants(variant("evil", op, at_base, capabilities=caps, priority=100))
    v = kv.qualify(op, variants=["evil"], dtype="float32")[0]
    assert not v.passed and "out= dense" in v.failed_case, v.summary()


def test_a_variant_declaring_autograd_with_a_wrong_backward_fails(with_variants):
    """``autograd=True`` is a claim like any other: its gradients are checked on the edge cases
    before it is handed a call whose inputs require grad."""
    class HalfGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 0.5

    def wrong_backward(x, weight, eps=1e-6, *, out=None):
        return HalfGrad.apply(dispatcher().registry.get(RMS, "aten").variant.fn(x, weight, eps))

    caps = Capabilities(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, autograd=True)
    with_variants(variant("evil", RMS, wrong_backward, capabilities=caps, priority=100))
    v = kv.qualify(RMS, variants=["evil"], dtype="float32")[0]
    assert not v.passed and "gradients" in v.failed_case and "d/dx" in v.reason, v.summary()
    h = torch.randn(4, 64, requires_grad=True)
    assert kv.explain(RMS, h, torch.zeros(64)).chosen.id != "evil"
