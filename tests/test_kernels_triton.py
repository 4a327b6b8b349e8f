"""The Triton kernels on the CPU, under the Triton interpreter, through the conformance suite.

Triton decides whether to interpret when ``triton.jit`` decorates a kernel (it reads
``TRITON_INTERPRET`` then, not at launch), and ``kernel_variants`` builds its kernels on first
use, per mode. So a test only needs the variable set before it first calls a kernel, and a
``reload()`` so that the variants re-declare their devices (the CPU only while interpreting).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import sm90
from helpers.calibration import QUICK
from helpers.conformance import assert_conforms

import kernel_variants
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants.kernels import triton_conv
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case

pytest.importorskip("triton", reason="triton not installed (the 'triton' extra)")
OPS = ("causal_conv1d_fn", "causal_conv1d_update")


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel_variants.reload()


def _verify_all(rv, keep=lambda label: True) -> int:
    return assert_conforms(rv, "cpu", keep)


@pytest.mark.parametrize("op", OPS)
def test_triton_matches_the_reference_on_every_claimed_case(interpreter, op):
    rv = dispatcher().registry.get(op, "triton")
    assert rv.unavailable_reason() is None
    assert rv.variant.capabilities.devices == {"cuda", "cpu"}
    assert _verify_all(rv) > 100


CONFIG_IDS = [(op, c.id) for op, c in
              [("causal_conv1d_fn", c) for c in triton_conv.FN_CONFIGS]
              + [("causal_conv1d_update", c) for c in triton_conv.UPDATE_CONFIGS]]


@pytest.mark.parametrize(("op", "vid"), CONFIG_IDS, ids=[v for _, v in CONFIG_IDS])
def test_each_block_configuration_on_the_width_4_cases(interpreter, op, vid):
    """Every block configuration is a tactic of ``triton`` (the candidate ``triton:<config>``);
    a sample of the suite each."""
    rv = dispatcher().registry.get(op, vid)
    assert rv.unavailable_reason() is None and rv.parent is dispatcher().registry.get(op, "triton")
    _verify_all(rv, keep=lambda label: "W=4 float32" in label or "W=2 bfloat16" in label)


@pytest.mark.parametrize("op", OPS)
def test_a_dispatched_call_writes_into_the_callers_view(interpreter, op):
    case = make_case(op, batch=2, dim=24, seqlen=3, noncontig=True, width=4).fresh()
    before = case.pool_base.clone()
    expected_out, pools = case.run(getattr(reference, op))  # on a fresh copy
    expected_pool = next(iter(pools.values()))
    with kernel_variants.force(**{op: "triton"}):
        out = getattr(kernel_variants, op)(*case.args, **case.kwargs)
    assert not torch.equal(before, case.pool_base)
    assert torch.equal(case.pool_base, expected_pool)
    torch.testing.assert_close(out, expected_out)


def test_the_interpreter_never_outranks_a_native_cpu_variant(interpreter):
    x, w = torch.randn(2, 5, 8), torch.randn(8, 4)
    decision = kernel_variants.explain("causal_conv1d_fn", x, w, conv_states=torch.zeros(2, 3, 8))
    assert decision.chosen.id != "triton" and decision.source == "priority"
    assert any(r.variant == "triton" for r in decision.trace)


def test_the_calibrator_picks_among_block_configurations(monkeypatch, interpreter):
    from kernel_variants._builtins import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS

    # Only the Triton configurations beside the references: no unmeasured native variant ranked above them.
    others = [n for n, _ in BUILTIN_PLUGINS if n not in ESSENTIAL_PLUGINS and n != "triton"]
    monkeypatch.setenv("KV_DISABLE_PLUGINS", ",".join(others))
    kernel_variants.reload()
    ids = ["triton"] + [c.id for c in triton_conv.UPDATE_CONFIGS]
    result = kernel_variants.calibrate("causal_conv1d_update", [(2, 64, 1)], device="cpu",
                                       variants=ids, **QUICK)
    assert not result.rejected()
    winner = result.winners[(2, 64, 1)]
    assert winner is not None and winner.variant in ids
    x, pool, w = torch.randn(2, 64), torch.randn(4, 3, 64), torch.randn(64, 4)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    decision = kernel_variants.explain("causal_conv1d_update", x, pool, w, torch.randn(64), activation="silu",
                                       conv_state_indices=idx)
    assert decision.source == "table" and decision.chosen.id == winner.variant


def test_force_runs_the_named_block_configuration(interpreter, monkeypatch):
    """``triton:d32`` launches the decode kernel with BLOCK_D=32 (two channel blocks at D=64),
    ``triton`` with its heuristic's 64 (one)."""
    real, grids = triton_conv.kernels, []

    class Update:
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            grids.append(grid)
            return self.k.update[grid]

    monkeypatch.setattr(triton_conv, "kernels", lambda mode: SimpleNamespace(update=Update(real(mode))))
    x, w = torch.randn(2, 64), torch.randn(64, 4)
    for pin, grid in (("triton:d32", (2, 2)), ("triton", (2, 1))):
        pool = torch.randn(4, 3, 64)
        expected = reference.causal_conv1d_update(x, pool.clone(), w)
        monkeypatch.setenv("KV_FORCE", f"causal_conv1d_update={pin}")
        kernel_variants.reload()
        torch.testing.assert_close(kernel_variants.causal_conv1d_update(x, pool, w), expected)
        assert grids[-1] == grid, pin


def test_without_the_interpreter_or_a_gpu_the_probe_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel_variants.reload()
    rv = dispatcher().registry.get("causal_conv1d_fn", "triton")
    assert rv.variant.capabilities.devices == {"cuda"}
    if not torch.cuda.is_available():
        assert rv.unavailable_reason() == "no CUDA device (set TRITON_INTERPRET=1 to run on CPU under the interpreter)"


@pytest.mark.parametrize("op", ["gemma_rms_norm", "add_gemma_rms_norm", "rms_norm", "fused_add_rms_norm"])
def test_triton_rms_norm_matches_the_reference_on_every_claimed_case(interpreter, op):
    rv = dispatcher().registry.get(op, "triton")
    assert rv.unavailable_reason() is None
    assert rv.variant.capabilities.devices == {"cuda", "cpu"}
    assert _verify_all(rv) >= 20


# --- slots outside the pool, num_accepted_tokens outside 1..L: pads, never stray memory ----------


def _guarded_pool(n_slots, rows, dim):
    """A pool that is the middle of a bigger allocation: one guard slot on each side (NaN), where
    a kernel addressing slot -1 or slot N would read or write."""
    big = torch.randn(n_slots + 2, rows, dim)
    big[0] = big[-1] = float("nan")
    return big, big[1:-1]


def _guards_intact(big, before):
    return torch.equal(big[0].isnan(), before[0].isnan()) and torch.equal(big[-1].isnan(), before[-1].isnan()) \
        and big[0].isnan().all() and big[-1].isnan().all()


@pytest.mark.parametrize("varlen", [False, True])
def test_prefill_treats_a_slot_outside_the_pool_as_a_pad(interpreter, varlen):
    """What only a call with KV_CHECK_VALUES=0 can bring: slots N and -1 with pad id 99."""
    n_slots, dim, width = 4, 16, 4
    big, pool = _guarded_pool(n_slots, width - 1, dim)
    before = big.clone()
    slots = torch.tensor([n_slots, 1, -1, 2], dtype=torch.int32)
    x = torch.randn(10, dim) if varlen else torch.randn(4, 3, dim)
    qsl = torch.tensor([0, 3, 5, 9, 10], dtype=torch.int32) if varlen else None
    w, b = torch.randn(dim, width), torch.randn(dim)
    init = torch.ones(4, dtype=torch.bool)
    kw = dict(conv_states=pool, cache_indices=slots, has_initial_state=init, query_start_loc=qsl, activation="silu",
              pad_slot_id=99)
    out = triton_conv.causal_conv1d_fn(x, w, b, **kw)
    assert _guards_intact(big, before), "a slot outside the pool was written"
    ref_pool = before[1:-1].clone()
    ref = reference.causal_conv1d_fn(x, w, b, **{**kw, "conv_states": ref_pool,
                                                "cache_indices": torch.tensor([99, 1, 99, 2], dtype=torch.int32)})
    torch.testing.assert_close(out, ref)
    assert torch.equal(pool, ref_pool)


def test_decode_treats_a_slot_outside_the_pool_or_a_bad_count_as_a_pad(interpreter):
    n_slots, dim, width, length = 5, 16, 4, 3
    rows = width - 1 + length - 1
    big, pool = _guarded_pool(n_slots, rows, dim)
    before = big.clone()
    slots = torch.tensor([n_slots, 0, -1, 2, 3], dtype=torch.int32)
    accepted = torch.tensor([1, 0, 2, length + 1, 2], dtype=torch.int32)  # 0 and L+1: outside 1..L
    x, w, b = torch.randn(5, length, dim), torch.randn(dim, width), torch.randn(dim)
    kw = dict(activation="silu", conv_state_indices=slots, num_accepted_tokens=accepted, pad_slot_id=99)
    out = triton_conv.causal_conv1d_update(x, pool, w, b, **kw)
    assert _guards_intact(big, before), "a slot outside the pool was read or written"
    assert (out[[0, 1, 2, 3]] == 0).all(), "those sequences are pads: zero output"
    assert torch.equal(pool[[0, 2]], before[1:-1][[0, 2]]), "and their slots are left alone"
    ref_pool = before[1:-1].clone()
    live = torch.tensor([99, 99, 99, 99, 3], dtype=torch.int32)
    ref = reference.causal_conv1d_update(x, ref_pool, w, b, **{**kw, "conv_state_indices": live,
                                                              "num_accepted_tokens": torch.clamp(accepted, 1, length)})
    torch.testing.assert_close(out, ref)
    assert torch.equal(pool, ref_pool)


# --- launches under x's device ------------------------------------------------------------------


def test_launches_run_under_the_device_of_x(interpreter, monkeypatch):
    import contextlib
    import types

    assert isinstance(triton_conv.device_guard(torch.zeros(1)), contextlib.nullcontext)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = triton_conv.device_guard(types.SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    # On the current device already: no switch (and no switch back) around the launch.
    assert isinstance(triton_conv.device_guard(types.SimpleNamespace(device=torch.device("cuda", 0))),
                      contextlib.nullcontext)
    seen = []
    real = triton_conv.device_guard
    monkeypatch.setattr(triton_conv, "device_guard", lambda t: seen.append(t.device) or real(t))
    for op in OPS:
        case = make_case(op, batch=2, dim=16, seqlen=2, width=3)
        getattr(triton_conv, op)(*case.fresh().args, **case.kwargs)
    assert seen == [torch.device("cpu")] * 2


# --- the prefill kernel's registers (finding: the tiled kernel spilled at 128x32) ---------------


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [triton_conv.fn_heuristic(8192, 4096), triton_conv.fn_heuristic(64, 4096)],
                         ids=lambda b: b.id)
def test_the_default_prefill_configs_do_not_spill(monkeypatch, tmp_path, blocks):
    """Compiled for sm_90 without a GPU (Triton's compiler and the ptxas it ships), W = 4, bf16,
    packed input with history: ptxas reports no spill and a modest register count."""
    compile_ = sm90.compiler(monkeypatch)
    fn = triton_conv.kernels(False).fn_conv
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "st_ptr": "*bf16", "ci_ptr": "*i32",
                "init_ptr": "*u8", "qsl_ptr": "*i32", "seq_ptr": "*i64", "out_ptr": "*bf16"}
    consts = dict(W=4, HAS_BIAS=True, SILU=True, HAS_HIST=True, HAS_CI=True, VARLEN=True, BLOCK_T=blocks.t,
                  BLOCK_D=blocks.d)
    signature = {n: pointers.get(n, "constexpr" if n in consts else "i64" if n.startswith("s") and n != "S" else "i32")
                 for n in fn.arg_names}
    registers, text = sm90.assemble(compile_(fn, signature, consts, 4), tmp_path, "fn_conv")
    assert registers <= 64, text


@pytest.mark.slow
@pytest.mark.parametrize("spec", [False, True], ids=["decode", "verify"])
def test_the_decode_kernel_that_counts_bad_values_compiles_for_sm_90_without_spilling(monkeypatch, tmp_path, spec):
    """The decode kernel with its own counts of bad values (``COUNT``: the atomics and the
    compares with earlier slots), compiled for sm_90 without a GPU, W = 4, bf16, D = 4096's
    heuristic block: it compiles, and ptxas reports no spill."""
    compile_ = sm90.compiler(monkeypatch)
    fn = triton_conv.kernels(False).update
    blocks = triton_conv.update_heuristic(64, 4096)
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "st_ptr": "*bf16", "ci_ptr": "*i32",
                "nat_ptr": "*i32", "out_ptr": "*bf16", "cnt_ptr": "*i64"}
    consts = dict(W=4, HAS_BIAS=True, SILU=True, HAS_CI=True, SPEC=spec, COUNT=True, BLOCK_L=2 if spec else 1,
                  BLOCK_S=4, BLOCK_D=blocks.d, BLOCK_B=64)
    signature = {n: pointers.get(n, "constexpr" if n in consts else "i64" if n.startswith("s") and n != "S" else "i32")
                 for n in fn.arg_names}
    registers, text = sm90.assemble(compile_(fn, signature, consts, 4), tmp_path, "update")
    assert registers <= 96, text
