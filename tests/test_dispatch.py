"""Selection, pinning (KV_FORCE and force()), explain(), and failures during real calls."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.variants import variant

import kernel_variants
from kernel_variants._policy import NoVariantError, select
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.errors import VariantFailed
from kernel_variants._runtime.pins import parse_force
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.plugin import Variant


def _args():
    return (torch.randn(2, 5, 8), torch.randn(8, 4)), {"conv_states": torch.zeros(2, 3, 8)}


def _top_priority(op="causal_conv1d_fn") -> str:
    ok = [rv for rv in kernel_variants.variants(op) if rv.unavailable_reason() is None]
    return max(ok, key=lambda rv: rv.variant.priority).id


def test_priority_decides_without_measurements():
    args, kw = _args()
    decision = kernel_variants.explain("causal_conv1d_fn", *args, **kw)
    assert decision.source == "priority"
    assert decision.chosen.id == _top_priority() != "reference"
    assert {r.variant for r in decision.trace} == {rv.id for rv in kernel_variants.variants("causal_conv1d_fn")}


def test_capabilities_route_calls_a_variant_cannot_run():
    """torch_shift declares no varlen, so varlen calls go to a variant that does, with that reason."""
    x, w = torch.randn(7, 8), torch.randn(8, 4)
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    decision = kernel_variants.explain("causal_conv1d_fn", x, w, query_start_loc=qsl)
    assert decision.chosen.variant.capabilities.varlen
    rejected = {r.variant: r.reason for r in decision.trace if not r.accepted}
    assert "varlen" in rejected["torch_shift"]


def test_select_is_pure_and_reports_every_reason():
    """No registry, no device: candidates, a call key and timings in, a decision out."""
    from kernel_variants._registry.registry import RegisteredVariant
    from kernel_variants._runtime.bind import call_key

    def entry(vid, **caps):
        v = Variant(id=vid, op="causal_conv1d_fn", version="1", fn=reference.causal_conv1d_fn,
                    capabilities=ConvCapabilities(devices={"cpu"}, **caps))
        return RegisteredVariant(v, "test", "1+0")

    entries = [
        entry("fp32_only", dtypes={"float32"}),
        entry("narrow", dtypes={"float16"}, width=(2, 3)),
        entry("wide", dtypes={"float16"}, width=(2, 8)),
        entry("other", dtypes={"float16"}, width=(2, 8)),
    ]
    args, kw = _args()
    key = call_key("causal_conv1d_fn", *args, **kw)._replace(dtype="float16")
    d = select(entries, key, timings={"wide": 10.0, "other": 8.0})
    why = {r.variant: r.reason for r in d.trace}
    assert d.chosen.id == "other" and d.source == "table"
    assert why["fp32_only"] == "dtype float16 not in ['float32']"
    assert why["narrow"] == "width W=4 outside 2..3"
    assert why["wide"] == "1.25x the winner"
    kept = select(entries, key, timings={"wide": 10.0, "other": 8.0}, winner="wide")
    assert kept.chosen.id == "wide", "the recorded winner keeps its place"
    assert "other" in str(kept)


def test_kv_force_env_pins_the_variant(monkeypatch):
    monkeypatch.setenv("KV_FORCE", "causal_conv1d_fn=reference,causal_conv1d_update=reference")
    kernel_variants.reload()
    args, kw = _args()
    assert kernel_variants.explain("causal_conv1d_fn", *args, **kw).chosen.id == "reference"


def test_parse_force_rejects_unknown_ops_and_accepts_a_bare_id():
    ops = ("causal_conv1d_fn", "causal_conv1d_update")
    assert parse_force("reference", ops) == {"causal_conv1d_fn": "reference", "causal_conv1d_update": "reference"}
    with pytest.raises(ValueError, match="conv2d"):
        parse_force("conv2d=reference", ops)


def test_force_context_pins_and_unpins(with_variants):
    ran = []

    def tracked(vid):
        def fn(*a, **k):
            ran.append(vid)
            return reference.causal_conv1d_fn(*a, **k)
        return fn

    with_variants(variant("preferred", fn=tracked("preferred"), priority=99), variant("pinned", fn=tracked("pinned"), priority=1))
    args, kw = _args()
    kernel_variants.causal_conv1d_fn(*args, **kw)
    with kernel_variants.force(causal_conv1d_fn="pinned"):
        assert kernel_variants.explain("causal_conv1d_fn", *args, **kw).chosen.id == "pinned"
        out = kernel_variants.causal_conv1d_fn(*args, **kw)
    kernel_variants.causal_conv1d_fn(*args, **kw)
    assert ran == ["preferred", "pinned", "preferred"], "the pin must apply inside the block only, memo or not"
    assert out.shape == args[0].shape


def test_force_of_an_unknown_variant_or_op_fails_at_once():
    with pytest.raises(KeyError, match="nope.*registered: .*reference"), kernel_variants.force(causal_conv1d_fn="nope"):
        pass
    with pytest.raises(TypeError, match="conv2d"), kernel_variants.force(conv2d="reference"):
        pass


def test_forced_variant_that_cannot_run_raises_with_reasons_instead_of_falling_back():
    x, w = torch.randn(7, 8), torch.randn(8, 4)
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    with kernel_variants.force(causal_conv1d_fn="torch_shift"), pytest.raises(NoVariantError, match="varlen"):
        kernel_variants.causal_conv1d_fn(x, w, query_start_loc=qsl)


def test_unavailable_variant_is_never_chosen(with_variants):
    with_variants(variant("fast_but_absent", priority=99, probe=lambda: "needs a device this machine lacks"))
    args, kw = _args()
    decision = kernel_variants.explain("causal_conv1d_fn", *args, **kw)
    assert decision.chosen.id != "fast_but_absent"
    assert any(r.reason == "needs a device this machine lacks" for r in decision.trace)


def test_a_variant_raising_in_a_real_call_is_named_and_writes_nothing(with_variants):
    def broken(x, *a, **k):
        if x.shape[-1] == 8:  # a fault at one size only: it qualified on the edge cases' sizes
            raise RuntimeError("kernel fault")
        return reference.causal_conv1d_fn(x, *a, **k)

    with_variants(variant("broken", fn=broken, priority=99))
    args, kw = _args()
    before = kw["conv_states"].clone()
    with pytest.raises(VariantFailed, match="variant 'broken' of causal_conv1d_fn failed: RuntimeError: kernel fault"):
        kernel_variants.causal_conv1d_fn(*args, **kw)
    assert torch.equal(before, kw["conv_states"])


def test_decisions_are_memoised_per_signature():
    args, kw = _args()
    kernel_variants.causal_conv1d_fn(*args, **kw)
    n = len(dispatcher().memo)
    kernel_variants.causal_conv1d_fn(torch.randn(2, 5, 8), args[1], **kw)
    assert len(dispatcher().memo) == n
    kernel_variants.causal_conv1d_fn(torch.randn(3, 5, 8), args[1], conv_states=torch.zeros(3, 3, 8))
    assert len(dispatcher().memo) == n + 1


def test_a_memoised_signature_still_checks_index_values():
    args, kw = _args()
    kw["cache_indices"] = torch.tensor([0, 1], dtype=torch.int32)
    kernel_variants.causal_conv1d_fn(*args, **kw)
    kw["cache_indices"] = torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_indices: expected distinct slots"):
        kernel_variants.causal_conv1d_fn(*args, **kw)


def _memoised_cases():
    """(op, a valid call, the same signature with bad index values, the error): a memoised (or
    bound) call checks the values it reads every time, from what its signature fixed once."""
    x, w, pool = torch.randn(2, 5, 8), torch.randn(8, 4), torch.randn(4, 3, 8)
    idx = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    fn = dict(x=x, weight=w, conv_states=pool)
    upd = dict(x=torch.randn(2, 2, 8), conv_state=torch.randn(4, 4, 8), weight=w)
    xv = torch.randn(7, 8)
    return [
        ("causal_conv1d_fn", {**fn, "cache_indices": idx(0, 3)}, {"cache_indices": idx(0, 4)},
         r"cache_indices: expected slot indices in \[0, 4\) or pad_slot_id=-1, got 4 at position 1"),
        ("causal_conv1d_fn", {**fn, "cache_indices": idx(0, 3)}, {"cache_indices": idx(3, 3)},
         "cache_indices: expected distinct slots, got slot 3 twice"),
        ("causal_conv1d_fn", {"x": xv, "weight": w, "conv_states": pool, "query_start_loc": idx(0, 3, 7)},
         {"query_start_loc": idx(0, 5, 4)}, "query_start_loc: expected non-decreasing values"),
        ("causal_conv1d_fn", {"x": xv, "weight": w, "conv_states": pool, "query_start_loc": idx(0, 3, 7)},
         {"query_start_loc": idx(0, 3, 6)}, r"query_start_loc: expected to end at T=7"),
        ("causal_conv1d_update", {**upd, "conv_state_indices": idx(1, 2)}, {"conv_state_indices": idx(-2, 2)},
         r"conv_state_indices: expected slot indices in \[0, 4\)"),
        ("causal_conv1d_update", {**upd, "num_accepted_tokens": idx(1, 2)}, {"num_accepted_tokens": idx(1, 3)},
         r"num_accepted_tokens: expected values in 1\.\.L=2, got 3 at position 1"),
        # B=1, a decode step of one sequence, reads its one slot without a list: same errors.
        ("causal_conv1d_fn", {**fn, "x": x[:1], "cache_indices": idx(3)}, {"cache_indices": idx(4)},
         r"cache_indices: expected slot indices in \[0, 4\) or pad_slot_id=-1, got 4 at position 0"),
        ("causal_conv1d_update", {**upd, "x": upd["x"][:1], "conv_state_indices": idx(-1)},
         {"conv_state_indices": idx(-2)}, r"conv_state_indices: expected slot indices in \[0, 4\) or "
         r"pad_slot_id=-1, got -2 at position 0"),
    ]


@pytest.mark.parametrize("how", ["dispatched", "bound"])
@pytest.mark.parametrize("case", range(8))
def test_every_index_value_check_runs_on_a_memoised_or_bound_call(case, how):
    op, good, bad, error = _memoised_cases()[case]
    call = getattr(kernel_variants, op) if how == "dispatched" else kernel_variants.bind(op, **good)
    call(**good)
    call(**good)  # a memo hit
    pool = "conv_states" if op == "causal_conv1d_fn" else "conv_state"
    before = good[pool].clone()
    with pytest.raises(ValueError, match=error):
        call(**{**good, **bad})
    assert torch.equal(good[pool], before), "nothing is written before the values are checked"


def test_update_op_dispatches_and_matches_reference():
    x, w = torch.randn(3, 16), torch.randn(16, 4)
    state = torch.randn(3, 3, 16)
    ref_state = state.clone()
    out = kernel_variants.causal_conv1d_update(x, state, w, activation="silu")
    ref = reference.causal_conv1d_update(x, ref_state, w, activation="silu")
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(state, ref_state)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_childs_first_dispatched_call_completes():
    """With GNU OpenMP, a child forked after the parent ran a parallel region hangs in its first
    one unless it runs one intra-op thread; a hung child dies of SIGALRM, failing here."""
    code = textwrap.dedent("""
        import os, signal, sys, torch
        import kernel_variants as kv
        x, w = torch.randn(8, 256, 512), torch.randn(512, 4)
        kv.causal_conv1d_fn(x, w)  # a parallel region in the parent
        threads = torch.get_num_threads()
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # default action: a hung child dies instead of hanging the test
            kv.causal_conv1d_fn(x, w)
            kv.gemma_rms_norm(torch.randn(64, 256), torch.zeros(256))
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert torch.get_num_threads() == threads, "the parent's threads changed"
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child exit {proc.returncode} (-14: hung until SIGALRM)\n{proc.stderr[-2000:]}"
