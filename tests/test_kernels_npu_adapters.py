"""The adapters of kernels this machine cannot run, against the CPU doubles of those kernels
(:mod:`helpers.ascend_conv`, which mimic the real kernels' schemas and quirks). The numbers come
from the reference, so what the tests check is the adapters: marshalling, layout translation,
and that the state lands in the caller's pool, views included.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import ascend_conv
from helpers.ascend_conv import ASC_DOUBLE, ENTRIES, PTO_DOUBLE, update_v2
from helpers.conformance import assert_conforms

import kernel_variants
from kernel_variants._runtime.bind import call_key
from kernel_variants._tuning.verify import verify
from kernel_variants.kernels import _adapters, asc, npu_triton, pto
from kernel_variants.kernels._adapters import FunctionRef, OpRef
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case


@pytest.fixture
def adapters(monkeypatch):
    monkeypatch.setitem(sys.modules, ascend_conv.DAO_MODULE, ascend_conv.make_dao_module())
    return ascend_conv.adapters()



@pytest.mark.parametrize(("name", "op"), ENTRIES, ids=[f"{n}:{o}" for n, o in ENTRIES])
def test_adapter_on_its_double_matches_the_reference_on_every_claimed_case(adapters, name, op):
    """The conformance suite's cases, drawn from what the adapter declares, on the CPU double."""
    rv = adapters[name][op]
    assert rv.unavailable_reason() is None
    ran = assert_conforms(rv, "cpu")
    assert ran >= 20, f"{name} claims only {ran} cases"


def _case(op, **kw):
    base = dict(batch=3, dim=32, seqlen=3, width=4, dtype=torch.bfloat16)
    return make_case(op, **{**base, **kw})


def test_int64_indices_reach_the_kernels_as_int32(adapters):
    """The doubles raise on int64, as the real kernels' checks do; the adapters convert."""
    for name, op in ENTRIES:
        update = op == "causal_conv1d_update"
        case = _case(op, pad=True, poison=True, varlen=not update and name != "dao", spec=update and name != "dao")
        for key in ("cache_indices", "conv_state_indices", "query_start_loc", "num_accepted_tokens"):
            if case.kwargs.get(key) is not None:
                case.kwargs[key] = case.kwargs[key].long()
        assert verify(adapters[name][op].variant.fn, case) is None, (name, op)


def test_a_pad_slot_id_other_than_minus_one(adapters):
    """causal-conv1d skips negative slots only; the others take pad_slot_id as given."""
    for name, op in ENTRIES:
        case = _case(op, batch=4, pad=True, poison=True)
        key = "conv_state_indices" if op == "causal_conv1d_update" else "cache_indices"
        n_slots = case.state().shape[0]
        idx = case.kwargs[key]
        case.kwargs[key] = torch.where(idx == -1, n_slots + 5, idx).to(torch.int32)
        case.kwargs["pad_slot_id"] = n_slots + 5
        assert verify(adapters[name][op].variant.fn, case) is None, (name, op)


def test_asc_marshalling_weight_activation_and_run_mode(adapters):
    ASC_DOUBLE.calls.clear()
    for op, act, run_mode in (("causal_conv1d_fn", "silu", 0), ("causal_conv1d_fn", None, 0),
                              ("causal_conv1d_update", "silu", 1), ("causal_conv1d_update", None, 1)):
        case = _case(op, activation=act)
        assert verify(adapters["asc"][op].variant.fn, case) is None
        call = ASC_DOUBLE.calls[-1]
        assert call["run_mode"] == run_mode
        assert call["activation_mode"] == (1 if act else 0) and type(call["activation_mode"]) is int
        weight = case.args[1] if op == "causal_conv1d_fn" else case.args[2]
        assert torch.equal(call["weight"], weight.t()) and call["weight"].is_contiguous()


def test_pto_marshalling_bool_activation_required_tensors_and_dim_padding(adapters):
    PTO_DOUBLE.calls.clear()
    for act in ("silu", None):
        case = _case("causal_conv1d_fn", dim=40, activation=act, states=False)  # 40 is no multiple of 16
        assert verify(adapters["pto"]["causal_conv1d_fn"].variant.fn, case) is None
        call = PTO_DOUBLE.calls[-1]
        assert call["activation_mode"] is (act is not None)
        assert call["weight"].shape == (4, 48)


def test_npu_triton_gets_the_callers_pool_as_a_view_and_the_weight_without_a_copy(adapters):
    update_v2.calls.clear()
    case = _case("causal_conv1d_update", noncontig=True).fresh()
    out = adapters["npu_triton_update"]["causal_conv1d_update"].variant.fn(*case.args, **case.kwargs)
    call = update_v2.calls[-1]
    pool, weight = case.args[1], case.args[2]
    assert call["conv_state"].data_ptr() == pool.data_ptr() and call["conv_state"].stride() == pool.stride()
    assert call["weight"].data_ptr() == weight.data_ptr() and call["weight"].shape == (4, 32)
    assert call["indices"].dtype == torch.int32
    assert out.data_ptr() != case.args[0].data_ptr(), "the kernel writes over its x: never the caller's"


def test_pad_rows_come_back_zero_though_the_kernels_leave_them_uninitialised(adapters):
    case = _case("causal_conv1d_fn", batch=4, pad=True).fresh()
    x, weight, bias = case.args
    kw = case.kwargs
    raw = torch.ops.kv_test_asc.causal_conv1d(x, weight.t().contiguous(), kw["conv_states"].clone(), bias, None,
                                              kw["cache_indices"], kw["has_initial_state"], None, 1, -1, 0)
    pad = kw["cache_indices"] == -1
    assert raw[pad].isnan().all(), "the double mimics the kernel: pad rows uninitialised"
    for name in ("asc", "pto"):
        again = case.fresh()
        out = adapters[name]["causal_conv1d_fn"].variant.fn(*again.args, **again.kwargs)
        assert (out[pad] == 0).all() and not out.isnan().any()


def test_asc_declares_num_accepted_tokens_for_width_4_only(adapters):
    rv = adapters["asc"]["causal_conv1d_update"]
    caps = rv.variant.capabilities
    assert caps.num_accepted_tokens and caps.num_accepted_tokens_width == (4, 4)
    w3 = _case("causal_conv1d_update", width=3, spec=True, batch=4)
    assert "only for width 4..4" in caps.uncovered(call_key(w3.op, *w3.args, **w3.kwargs))
    assert verify(rv.variant.fn, _case("causal_conv1d_update", width=4, spec=True, noncontig=True)) is None
    # Why the limit is declared: below W=4 the kernel ignores num_accepted_tokens.
    case = w3.fresh()
    x, pool, weight, bias = case.args
    kw = case.kwargs
    raw = torch.ops.kv_test_asc.causal_conv1d(x, weight.t().contiguous(), pool.contiguous(), bias, None,
                                              kw["conv_state_indices"], None, kw["num_accepted_tokens"], 1, -1, 1)
    expected = reference.causal_conv1d_update(*w3.fresh().args, **kw)
    assert not torch.allclose(raw.float(), expected.float(), atol=0.1)
    with pytest.raises(ValueError, match="W=4 only"):
        rv.variant.fn(*w3.fresh().args, **kw)


@pytest.mark.parametrize(("name", "op"), ENTRIES, ids=[f"{n}:{o}" for n, o in ENTRIES])
def test_state_lands_in_a_non_contiguous_pool(adapters, name, op):
    specs = (False, True) if op == "causal_conv1d_update" and name != "dao" else (False,)
    for extra_rows in (0, 2):
        for spec in specs:
            case = _case(op, noncontig=True, extra_rows=extra_rows, spec=spec).fresh()
            before = case.pool_base.clone()
            adapters[name][op].variant.fn(*case.args, **case.kwargs)
            assert not torch.equal(before, case.pool_base), (extra_rows, spec)
            assert verify(adapters[name][op].variant.fn, case) is None, (extra_rows, spec)


def test_a_kernel_handed_a_contiguous_copy_of_the_pool_is_caught(adapters):
    """SGLang's adoption of causal_conv1d_update_v2 passed ``conv_states.contiguous()``."""
    broken = ascend_conv.npu_triton_variants(f"{ascend_conv.__name__}:into_copy")["causal_conv1d_update"].variant.fn
    good = adapters["npu_triton_update"]["causal_conv1d_update"].variant.fn
    contiguous = _case("causal_conv1d_update")
    assert verify(broken, contiguous) is None, "on a contiguous pool .contiguous() is the pool itself"
    strided = _case("causal_conv1d_update", noncontig=True)
    assert verify(good, strided) is None
    assert "conv_state:" in (verify(broken, strided) or "")


def test_a_scatter_into_a_copy_of_the_pool_is_caught(adapters, monkeypatch):
    real = _adapters.scatter_rows

    def into_copy(pool, *args):
        real(pool.contiguous(), *args)

    case = _case("causal_conv1d_update", noncontig=True, spec=True)
    fn_case = _case("causal_conv1d_fn", noncontig=True)
    assert verify(adapters["asc"]["causal_conv1d_update"].variant.fn, case) is None
    monkeypatch.setattr(asc, "scatter_rows", into_copy)
    monkeypatch.setattr(_adapters, "scatter_rows", into_copy)
    assert "conv_state:" in (verify(adapters["asc"]["causal_conv1d_update"].variant.fn, case) or "")
    assert "conv_states:" in (verify(adapters["pto"]["causal_conv1d_fn"].variant.fn, fn_case) or "")


def test_kernels_are_recognised_by_schema_and_a_mismatch_says_what_was_found():
    pto_on_asc = pto.PtoAdapter(OpRef("kv_test_asc::causal_conv1d")).probe()
    assert "kv_test_asc::causal_conv1d has the schema" in pto_on_asc and "int run_mode=0" in pto_on_asc
    assert "PTO-ISA" in pto_on_asc
    asc_on_pto = asc.AscAdapter(OpRef("kv_test_pto::causal_conv1d")).probe()
    assert "bool activation_mode=False" in asc_on_pto and "Ascend C" in asc_on_pto
    missing = asc.AscAdapter(OpRef("kv_test_none::causal_conv1d")).probe()
    assert missing == "op kv_test_none::causal_conv1d is not registered"
    wrong = npu_triton.NpuTritonAdapter(FunctionRef(f"{ascend_conv.__name__}:wrong_signature")).probe()
    assert "wrong_signature(x, conv_state, weight, bias=None, activation=None) is not" in wrong
    absent = npu_triton.NpuTritonAdapter(FunctionRef("kv_no_such_module:f")).probe()
    assert absent == "kv_no_such_module not installed (pip install kv_no_such_module)"
    assert asc.AscAdapter(OpRef("kv_test_asc::causal_conv1d")).probe() is None


def test_kv_pto_op_names_a_pto_build_beside_the_ascend_c_one():
    assert pto.default_ref({}).qualname == "npu::causal_conv1d"
    ref = pto.default_ref({"KV_PTO_OP": "kv_test_pto::causal_conv1d"})
    assert ref.qualname == "kv_test_pto::causal_conv1d" and ref.device == "npu"
    assert pto.PtoAdapter(OpRef(ref.qualname)).probe() is None


def test_registered_variants_say_precisely_why_they_cannot_run_here(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel_variants.reload()
    reasons = {(rv.op, rv.id): rv.unavailable_reason() for rv in kernel_variants.variants()}
    expected_ids = {"asc", "pto", "npu_triton_update", "npu_conv_update", "triton", "dao"}
    assert expected_ids <= {vid for _, vid in reasons}
    if _adapters.import_reason(["torch_npu"]) is not None:
        for key in [("causal_conv1d_fn", "asc"), ("causal_conv1d_update", "asc"), ("causal_conv1d_fn", "pto"),
                    ("causal_conv1d_update", "npu_triton_update"), ("causal_conv1d_update", "npu_conv_update")]:
            assert reasons[key] == "torch_npu not installed (pip install torch_npu)"
    if not torch.cuda.is_available():
        assert "CUDA" in reasons[("causal_conv1d_fn", "dao")] or "not installed" in reasons[("causal_conv1d_fn", "dao")]
        assert reasons[("causal_conv1d_fn", "triton")] in (
            "triton not installed (pip install triton)",
            "no CUDA device (set TRITON_INTERPRET=1 to run on CPU under the interpreter)")


def test_import_needs_none_of_the_optional_packages():
    code = ("import sys, kernel_variants as kv\n"
            "[v.unavailable_reason() for v in kv.variants() if v.id in ('triton', 'dao')]\n"
            "heavy = {'torch_npu', 'sgl_kernel_npu', 'triton', 'causal_conv1d'} & set(sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
