"""Accelerator fidelity: each upstream defect the NPU adapters work around, shown on the CPU
doubles of :mod:`helpers.ascend_conv` (which behave like the real kernels, defects included), with
the adapter's answer next to it: the contract's result, or an honest refusal.

The upstream sources these were read from: sgl-kernel-npu HEAD f425bdf1, the Ascend C kernel of
PR #592 (8f13e502), the PTO kernel of PR #572 (d5630dff), the earlier Ascend C kernel of PR #420
(b07071fb, in the released wheels up to 2026.7.0), ``npu::causal_conv1d_update`` (PRs #407/#428).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import ascend_conv
from helpers.ascend_conv import (
    ASC_DOUBLE,
    ASC_SCHEMA,
    PTO_DOUBLE,
    PTO_SCHEMA,
    UPDATE_DOUBLE,
    AscendDouble,
    library,
    registered,
    require,
    update_v2,
)

import kernel_variants
from kernel_variants._cli import main
from kernel_variants._tuning.verify import verify
from kernel_variants.kernels import _adapters, asc, pto
from kernel_variants.kernels._adapters import FirstDevice, OpRef
from kernel_variants.kernels._slots import COMPACT_PAD
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case

FN, UPDATE = "causal_conv1d_fn", "causal_conv1d_update"


class OlderAscendC(AscendDouble):
    """The Ascend C kernel of PR #420 under the PTO schema (released wheels up to 2026.7.0): its
    host validates everything, then refuses any width but 4 and any D not a multiple of 16."""

    def __init__(self) -> None:
        super().__init__(pto_checks=True)

    def pto_op(self, x, weight, conv_states, query_start_loc, cache_indices, has_initial_state, bias=None,
               activation_mode=False, pad_slot_id=-1):
        require(x.dtype in (torch.bfloat16, torch.float16), f"Only BF16 and FP16 are supported, got {x.dtype}")
        require(weight.shape[1] == x.shape[-1], "weight.shape[1] must equal dim")
        require(weight.shape[0] == 4, f"Only width == 4 is supported, got {weight.shape[0]}")
        return super().pto_op(x, weight, conv_states, query_start_loc, cache_indices, has_initial_state, bias,
                              activation_mode, pad_slot_id)


def _accepts_any_width(x, weight, conv_states, query_start_loc, cache_indices, has_initial_state, bias=None,
                       activation_mode=False, pad_slot_id=-1):
    return torch.zeros_like(x)


def _refuses_otherwise(x, weight, conv_states, query_start_loc, cache_indices, has_initial_state, bias=None,
                       activation_mode=False, pad_slot_id=-1):
    raise RuntimeError("width not in the supported set")


TILING_DEMO = AscendDouble(pto_checks=False)  # fresh tiling caches: one for the raw demo, one for the adapter
TILING_ADAPTER = AscendDouble(pto_checks=False)
_LIBS = [
    library("kv_test_older", PTO_SCHEMA, OlderAscendC().pto_op),
    library("kv_test_anywidth", PTO_SCHEMA, _accepts_any_width),
    library("kv_test_otherwidth", PTO_SCHEMA, _refuses_otherwise),
    library("kv_test_tiling_demo", ASC_SCHEMA, TILING_DEMO.asc),
    library("kv_test_tiling", ASC_SCHEMA, TILING_ADAPTER.asc),
]


@pytest.fixture
def adapters(monkeypatch):
    monkeypatch.setitem(sys.modules, ascend_conv.DAO_MODULE, ascend_conv.make_dao_module())
    return ascend_conv.adapters()


# --- 1. a pad id inside [0, B) on the paths that renumber sequences 0..B-1 ---------------------

COMPACTING = [("asc", FN, dict(noncontig=True)), ("asc", UPDATE, dict(noncontig=True)),
              ("pto", FN, dict(noncontig=True)), ("pto", FN, dict(dim=40)),
              ("npu_triton_update", UPDATE, dict(spec=True, extra_rows=1)),
              ("npu_conv_update", UPDATE, {}), ("npu_conv_update", UPDATE, dict(spec=True)),
              ("dao", FN, {}), ("dao", UPDATE, {})]


@pytest.mark.parametrize(("name", "op", "opts"), COMPACTING, ids=[f"{n}:{o}:{'+'.join(k) or 'plain'}"
                                                                  for n, o, k in COMPACTING])
def test_pad_slot_id_zero_with_live_sequences_renumbered_from_zero(adapters, name, op, opts):
    """Slot 0 is the pad; the buffer paths number live sequences 0..B-1; every kernel skips any
    index equal to the pad id it is given. Passed through as-is: NaN (asc, pto) or out of tolerance."""
    options = dict(batch=4, dim=32, seqlen=3, width=4, dtype=torch.bfloat16, pad=True, pad_slot_id=0, poison=True)
    case = make_case(op, **{**options, **opts})
    assert verify(adapters[name][op].variant.fn, case) is None


def test_the_doubles_skip_any_index_equal_to_the_pad_id():
    """Why the marker matters: handed compact ids 0..B-1 with pad id 0, the kernel skips sequence 0."""
    case = make_case(FN, 3, 32, 4, width=4, dtype=torch.bfloat16, states=False).fresh()
    x, weight, bias = case.args
    out = torch.ops.kv_test_asc.causal_conv1d(x, weight.t().contiguous(), x.new_zeros(3, 3, 32), bias, None,
                                              torch.arange(3, dtype=torch.int32), None, None, 1, 0, 0)
    assert out[0].isnan().all() and not out[1:].isnan().any()


def test_compact_ids_travel_with_a_negative_pad_id(adapters):
    for name, op, opts in COMPACTING[:3]:
        case = make_case(op, 4, 32, 3, width=4, dtype=torch.bfloat16, pad=True, pad_slot_id=0, **opts)
        double = {"asc": ASC_DOUBLE, "pto": PTO_DOUBLE}[name]
        double.calls.clear()
        adapters[name][op].variant.fn(*case.fresh().args, **case.kwargs)
        call = double.calls[-1]
        assert call["pad_slot_id"] < 0
        assert not (call["cache_indices"] == call["pad_slot_id"])[torch.tensor([0, 1, 3])].any()
    update_v2.calls.clear()
    case = make_case(UPDATE, 4, 32, 3, width=4, dtype=torch.bfloat16, pad=True, pad_slot_id=0, spec=True,
                     extra_rows=1)
    adapters["npu_triton_update"][UPDATE].variant.fn(*case.fresh().args, **case.kwargs)
    assert update_v2.calls[-1]["pad_slot_id"] == COMPACT_PAD


# --- 2. asc: the tiling cache keyed without the dtype (upstream PR #643) ----------------------


def _same_shape(dtype):
    return make_case(FN, 3, 32, 5, width=4, dtype=dtype, seed=7)


def test_the_double_reuses_a_bf16_tiling_for_fp16_as_the_kernel_does():
    outs = []
    for dtype in (torch.bfloat16, torch.float16):
        case = _same_shape(dtype).fresh()
        x, weight, bias = case.args
        kw = case.kwargs
        out = torch.ops.kv_test_tiling_demo.causal_conv1d(
            x, weight.t().contiguous(), kw["conv_states"], bias, None, kw["cache_indices"], kw["has_initial_state"],
            None, 1, -1, 0)
        expected = reference.causal_conv1d_fn(*_same_shape(dtype).fresh().args, **_same_shape(dtype).fresh().kwargs)
        outs.append(torch.allclose(out.float(), expected.float(), atol=0.05, rtol=0.05))
    assert outs == [True, False], "bf16 right, then fp16 read through the cached bf16 tiling"


def test_asc_gives_each_dtype_its_own_tiling():
    variants = registered(asc.variants(asc.AscAdapter(OpRef("kv_test_tiling::causal_conv1d")), devices={"cpu"}))
    for op in (FN, UPDATE):
        for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
            case = make_case(op, 3, 32, 2, width=4, dtype=dtype, seed=3, pad=True)
            assert verify(variants[op].variant.fn, case) is None, (op, dtype)
    markers = {call["pad_slot_id"] for call in TILING_ADAPTER.calls}
    assert markers == {asc.pad_marker(torch.bfloat16), asc.pad_marker(torch.float16)} and len(markers) == 2


# --- 3. asc: D not a multiple of 16 is undefined on A2/A3 ---------------------------------------


def test_the_ascend_c_double_leaves_the_tail_of_an_unaligned_d_unwritten():
    case = make_case(FN, 2, 40, 3, width=4, dtype=torch.bfloat16, states=False).fresh()
    x, weight, bias = case.args
    out = torch.ops.kv_test_asc.causal_conv1d(x, weight.t().contiguous(), x.new_zeros(2, 3, 40), bias, None,
                                              None, None, None, 1, -1, 0)
    assert out[..., 32:].isnan().all() and not out[..., :32].isnan().any()


@pytest.mark.parametrize("op", [FN, UPDATE])
def test_asc_pads_d_to_a_multiple_of_16(adapters, op):
    ASC_DOUBLE.calls.clear()
    for spec in (False, True) if op == UPDATE else (False,):
        case = make_case(op, 3, 40, 4 if spec else 3, width=4, dtype=torch.bfloat16, spec=spec, poison=True)
        assert verify(adapters["asc"][op].variant.fn, case) is None
        assert ASC_DOUBLE.calls[-1]["weight"].shape == (4, 48)


# --- 4. pto: the same schema names the PR #420 kernel in released wheels ------------------------


def test_pto_identifies_the_kernel_behind_the_schema():
    assert pto.PtoAdapter(OpRef("kv_test_pto::causal_conv1d")).probe() is None
    older = pto.PtoAdapter(OpRef("kv_test_older::causal_conv1d")).probe()
    assert "earlier Ascend C kernel of sgl-kernel-npu PR #420" in older and "W = 4 only" in older
    assert "accepted W=65" in pto.PtoAdapter(OpRef("kv_test_anywidth::causal_conv1d")).probe()
    assert "cannot be identified" in pto.PtoAdapter(OpRef("kv_test_otherwidth::causal_conv1d")).probe()


def test_kv_list_names_the_older_kernel_honestly(monkeypatch, capsys):
    monkeypatch.setattr(pto, "default_ref", lambda env=None: OpRef("kv_test_older::causal_conv1d"))
    kernel_variants.reload()
    try:
        assert main(["list", "--op", "fn", "--json"]) == 0
        rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["pto"]["available"] is False
        assert "PR #420" in rows["pto"]["reason"] and "not the PTO-ISA kernel" in rows["pto"]["reason"]
    finally:
        monkeypatch.undo()
        kernel_variants.reload()


# --- 5. npu::causal_conv1d_update, the kernel sglang's GDN backend calls -------------------------


def test_the_update_kernel_is_wrong_on_the_plain_decode_layout():
    """S = W-1, L = 1, no num_accepted_tokens: the host's pre-shift moves the history before the
    kernel reads it (W = 4 reads [h1, h2, h2, x])."""
    case = make_case(UPDATE, 3, 32, 1, width=4, dtype=torch.bfloat16)
    x, pool, weight, bias = case.fresh().args
    out = torch.ops.kv_test_upd.causal_conv1d_update(x.unsqueeze(1).contiguous(), weight.t().contiguous(), pool,
                                                     case.kwargs["conv_state_indices"], bias, None, None, True, -1)
    expected = reference.causal_conv1d_update(*case.fresh().args, **case.kwargs)
    assert not torch.allclose(out.squeeze(1).float(), expected.float(), atol=0.05, rtol=0.05)


def test_the_update_kernel_is_right_on_sglangs_verify_layout():
    """S = W-1+L-1 and every n = L (what sglang passes), with L >= W-1."""
    case = make_case(UPDATE, 3, 32, 4, width=4, dtype=torch.bfloat16, spec=True)
    case.kwargs["num_accepted_tokens"] = torch.full((3,), 4, dtype=torch.int32)
    fresh = case.fresh()
    x, pool, weight, bias = fresh.args
    out = torch.ops.kv_test_upd.causal_conv1d_update(x.contiguous(), weight.t().contiguous(), pool,
                                                     case.kwargs["conv_state_indices"], bias,
                                                     case.kwargs["num_accepted_tokens"], None, True, -1)
    expected, bases = case.run(reference.causal_conv1d_update)
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.05)
    assert torch.equal(fresh.pool_base, bases["conv_state"])


def test_npu_conv_update_never_hands_the_kernel_the_callers_pool(adapters):
    UPDATE_DOUBLE.calls.clear()
    case = make_case(UPDATE, 4, 32, 1, width=4, dtype=torch.bfloat16, pad=True).fresh()
    adapters["npu_conv_update"][UPDATE].variant.fn(*case.args, **case.kwargs)
    call = UPDATE_DOUBLE.calls[-1]
    assert call["conv_state"].data_ptr() != case.args[1].data_ptr()
    assert call["conv_state"].shape == (4, 3 + 1, 32)  # W-1+L rows: the pre-shift lands the history in rows 0..W-2
    assert torch.equal(call["indices"], torch.arange(4, dtype=torch.int32)) and call["num_accepted_tokens"] is None


def test_npu_conv_update_is_registered_and_says_why_it_cannot_run_here():
    kernel_variants.reload()
    rv = kernel_variants._runtime.dispatcher.dispatcher().registry.get(UPDATE, "npu_conv_update")
    assert rv.variant.capabilities.graph_safe and rv.variant.capabilities.num_accepted_tokens
    if _adapters.import_reason(["torch_npu"]) is not None:
        assert rv.unavailable_reason() == "torch_npu not installed (pip install torch_npu)"


# --- 6. packed prefill goes to the kernel as is; one NPU per process; Ascend950 -----------------


@pytest.mark.parametrize("name", ["asc", "pto"])
def test_packed_prefill_passes_query_start_loc_and_the_slots_through(adapters, name):
    double = ASC_DOUBLE if name == "asc" else PTO_DOUBLE
    for pad_slot_id in (-1, 0):
        case = make_case(FN, 5, 32, 4, width=4, dtype=torch.bfloat16, varlen=True, pad=True, pad_slot_id=pad_slot_id,
                         poison=True).fresh()
        double.calls.clear()
        fn = adapters[name][FN].variant.fn
        assert verify(fn, case) is None  # empty sequences without initial state included
        fn(*case.args, **case.kwargs)
        call = double.calls[-1]
        pool = case.kwargs["conv_states"]
        assert call["conv_states"].data_ptr() == pool.data_ptr(), "the caller's pool, no gathered copy"
        assert torch.equal(call["query_start_loc"], case.kwargs["query_start_loc"])
        live = case.kwargs["cache_indices"] != pad_slot_id
        assert torch.equal(call["cache_indices"][live], case.kwargs["cache_indices"][live])


def test_one_npu_per_process_for_the_static_tiling_buffer():
    first = FirstDevice("npu::causal_conv1d")
    first.check(torch.device("cuda", 0))
    first.check(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="static buffer on the device of its first call"):
        first.check(torch.device("cuda", 1))


def test_ascend950_builds_are_named_in_the_reason(monkeypatch):
    monkeypatch.setattr(asc, "soc_name", lambda: "Ascend950PR_9599")
    why = asc.AscAdapter(OpRef("kv_test_none::causal_conv1d")).probe()
    assert "Ascend950PR_9599 leave the Ascend C causal_conv1d out" in why
    monkeypatch.setattr(asc, "soc_name", lambda: "Ascend910B2")
    assert asc.AscAdapter(OpRef("kv_test_none::causal_conv1d")).probe() == "op kv_test_none::causal_conv1d is not registered"


# --- 12. dao: the decode path's bias -----------------------------------------------------------


def test_dao_decode_hands_causal_conv1d_a_bias_with_unit_stride(adapters):
    """causal_conv1d.cpp checks bias.stride(-1) == 1; the double raises like it."""
    case = make_case(UPDATE, 3, 48, 1, width=4, strided=True)
    assert case.args[3].stride(-1) != 1
    assert verify(adapters["dao"][UPDATE].variant.fn, case) is None
