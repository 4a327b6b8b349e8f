"""Every malformed call fails before any kernel runs, names the argument, and writes nothing."""

from __future__ import annotations

import pytest
import torch

import kernel_variants

B, L, D, W, N, S = 3, 4, 8, 4, 5, 3


def _fn_call():
    return dict(
        x=torch.randn(B, L, D), weight=torch.randn(D, W), bias=torch.randn(D),
        conv_states=torch.randn(N, S, D), cache_indices=torch.tensor([4, 0, 2], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False, True]), activation="silu",
    )


def _varlen_call():
    call = _fn_call()
    call["x"] = torch.randn(10, D)
    call["query_start_loc"] = torch.tensor([0, 3, 3, 10], dtype=torch.int64)
    return call


def _update_call():
    return dict(
        x=torch.randn(B, 2, D), conv_state=torch.randn(N, S + 1, D), weight=torch.randn(D, W),
        bias=torch.randn(D), conv_state_indices=torch.tensor([1, -1, 3], dtype=torch.int64),
        num_accepted_tokens=torch.tensor([1, 2, 2], dtype=torch.int32), activation="silu",
    )


FN = "causal_conv1d_fn"
UP = "causal_conv1d_update"
BAD = {
    # name: (op, base, changes, exception, message fragment)
    "x ndim": (FN, _fn_call, dict(x=torch.randn(B, L, D, 1)), ValueError, r"x: expected shape \[B, L, D\]"),
    "x not a tensor": (FN, _fn_call, dict(x=[[1.0]]), TypeError, "x: expected a torch.Tensor, got list"),
    "x int dtype": (FN, _fn_call, dict(x=torch.ones(B, L, D, dtype=torch.int32)), TypeError, "x: expected a floating dtype"),
    "weight D mismatch": (FN, _fn_call, dict(weight=torch.randn(D + 1, W)), ValueError, r"weight: expected shape \[D=8, W\], got \[9, 4\]"),
    "weight ndim": (FN, _fn_call, dict(weight=torch.randn(D)), ValueError, "weight: expected shape"),
    "weight dtype": (FN, _fn_call, dict(weight=torch.randn(D, W, dtype=torch.float64)), TypeError, "weight: expected dtype float32 .x's., got float64"),
    "weight device": (FN, _fn_call, dict(weight=torch.randn(D, W, device="meta")), ValueError, "weight: expected device cpu"),
    "bias D mismatch": (FN, _fn_call, dict(bias=torch.randn(D - 1)), ValueError, r"bias: expected shape \[D=8\], got \[7\]"),
    "bias dtype": (FN, _fn_call, dict(bias=torch.randn(D).half()), TypeError, "bias: expected dtype float32"),
    "activation": (FN, _fn_call, dict(activation="relu"), ValueError, "activation: expected None, \"silu\" or \"swish\", got 'relu'"),
    "states D mismatch": (FN, _fn_call, dict(conv_states=torch.randn(N, S, D + 2)), ValueError, r"conv_states: expected shape \[N, S, D=8\], got \[5, 3, 10\]"),
    "states too short": (FN, _fn_call, dict(conv_states=torch.randn(N, S - 1, D)), ValueError, "conv_states: expected S >= 3 rows"),
    "states dtype": (FN, _fn_call, dict(conv_states=torch.randn(N, S, D).bfloat16()), TypeError, "conv_states: expected dtype float32"),
    "indices dtype": (FN, _fn_call, dict(cache_indices=torch.tensor([4.0, 0, 2])), TypeError, "cache_indices: expected dtype int32 or int64, got float32"),
    "indices length": (FN, _fn_call, dict(cache_indices=torch.tensor([0, 1], dtype=torch.int32)), ValueError, r"cache_indices: expected shape \[3\], got \[2\]"),
    "slot out of range": (FN, _fn_call, dict(cache_indices=torch.tensor([4, 5, 2], dtype=torch.int32)), ValueError, r"cache_indices: expected slot indices in \[0, 5\) or pad_slot_id=-1, got 5 at position 1"),
    "negative slot": (FN, _fn_call, dict(cache_indices=torch.tensor([4, -2, 2], dtype=torch.int32)), ValueError, "got -2 at position 1"),
    "slot out of range beside a pad": (FN, _fn_call, dict(cache_indices=torch.tensor([-1, 5, 2], dtype=torch.int32)), ValueError, r"cache_indices: expected slot indices in \[0, 5\) or pad_slot_id=-1, got 5 at position 1"),
    "two sequences one slot": (FN, _fn_call, dict(cache_indices=torch.tensor([2, 0, 2], dtype=torch.int32)), ValueError, "cache_indices: expected distinct slots, got slot 2 twice"),
    "too few slots without indices": (FN, _fn_call, dict(cache_indices=None, conv_states=torch.randn(2, S, D)), ValueError, "conv_states: expected at least B=3 slots"),
    "initial state dtype": (FN, _fn_call, dict(has_initial_state=torch.tensor([1, 0, 1])), TypeError, "has_initial_state: expected dtype bool, got int64"),
    "initial state length": (FN, _fn_call, dict(has_initial_state=torch.tensor([True])), ValueError, r"has_initial_state: expected shape \[3\]"),
    "indices without states": (FN, _fn_call, dict(conv_states=None), ValueError, "cache_indices: expected None when conv_states is None"),
    "pad_slot_id type": (FN, _fn_call, dict(pad_slot_id=-1.0), TypeError, "pad_slot_id: expected int, got float"),
    "qsl with 3-d x": (FN, _fn_call, dict(query_start_loc=torch.tensor([0, 4, 8, 12])), ValueError, r"x: expected shape \[T, D\] when query_start_loc is given"),
    "qsl not from 0": (FN, _varlen_call, dict(query_start_loc=torch.tensor([1, 3, 3, 10])), ValueError, "query_start_loc: expected to start at 0, got 1"),
    "qsl decreasing": (FN, _varlen_call, dict(query_start_loc=torch.tensor([0, 5, 3, 10])), ValueError, "query_start_loc: expected non-decreasing values, got 5 then 3"),
    "qsl not ending at T": (FN, _varlen_call, dict(query_start_loc=torch.tensor([0, 3, 3, 9])), ValueError, r"query_start_loc: expected to end at T=10 \(x.shape\[0\]\), got 9"),
    "qsl dtype": (FN, _varlen_call, dict(query_start_loc=torch.tensor([0.0, 3, 3, 10])), TypeError, "query_start_loc: expected dtype int32 or int64"),
    "qsl length vs indices": (FN, _varlen_call, dict(query_start_loc=torch.tensor([0, 10])), ValueError, r"cache_indices: expected shape \[1\], got \[3\]"),
    "update x ndim": (UP, _update_call, dict(x=torch.randn(D)), ValueError, r"x: expected shape \[B, D\] or \[B, L, D\], got \[8\]"),
    "update state missing": (UP, _update_call, dict(conv_state=None), TypeError, "conv_state: expected a torch.Tensor, got NoneType"),
    "update state too short for spec": (UP, _update_call, dict(conv_state=torch.randn(N, S, D)), ValueError, r"conv_state: expected S >= 4 rows \(W-1\+L-1 rows for speculative decoding"),
    "update state too short": (UP, _update_call, dict(conv_state=torch.randn(N, 2, D), num_accepted_tokens=None), ValueError, "conv_state: expected S >= 3 rows"),
    "accepted zero": (UP, _update_call, dict(num_accepted_tokens=torch.tensor([1, 0, 2])), ValueError, "num_accepted_tokens: expected values in 1..L=2, got 0 at position 1"),
    "accepted above L": (UP, _update_call, dict(num_accepted_tokens=torch.tensor([3, 1, 1])), ValueError, "num_accepted_tokens: expected values in 1..L=2, got 3 at position 0"),
    "accepted dtype": (UP, _update_call, dict(num_accepted_tokens=torch.tensor([1.0, 1, 1])), TypeError, "num_accepted_tokens: expected dtype int32 or int64"),
    "update slot out of range": (UP, _update_call, dict(conv_state_indices=torch.tensor([1, 9, 3])), ValueError, "conv_state_indices: expected slot indices in"),
    "update two sequences one slot": (UP, _update_call, dict(conv_state_indices=torch.tensor([3, -1, 3])), ValueError, "conv_state_indices: expected distinct slots"),
    "update weight D": (UP, _update_call, dict(weight=torch.randn(D - 1, W)), ValueError, r"weight: expected shape \[D=8, W\]"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_refused_before_anything_is_written(name):
    op, base, changes, exc, match = BAD[name]
    call = {**base(), **changes}
    pools = [t for k, t in call.items() if k in ("conv_states", "conv_state") and isinstance(t, torch.Tensor)]
    before = [p.clone() for p in pools]
    with pytest.raises(exc, match=match):
        getattr(kernel_variants, op)(**call)
    for p, b in zip(pools, before, strict=True):
        assert torch.equal(p, b), "a refused call wrote to the state"


@pytest.mark.parametrize("name", ["slot out of range", "two sequences one slot", "qsl decreasing"])
def test_explain_validates_like_the_op(name):
    op, base, changes, exc, match = BAD[name]
    call = {**base(), **changes}
    with pytest.raises(exc, match=match):
        kernel_variants.explain(op, **call)


def test_value_checks_are_off_only_off_the_cpu(monkeypatch):
    """KV_CHECK_VALUES=0 spares accelerators a device sync per call; on the CPU reading an index
    tensor costs nothing, so the checks stay on there and a bad slot never reaches a variant
    (a variant refusing it midway could leave the pool half-written)."""
    from kernel_variants._runtime import call as _op

    monkeypatch.setenv("KV_CHECK_VALUES", "0")
    kernel_variants.reload()
    for slots in ([2, 0, 2], [2, 0, 9], [-2, 0, 1]):
        call = {**_fn_call(), "cache_indices": torch.tensor(slots, dtype=torch.int32)}
        pool = call["conv_states"].clone()
        for vid in ("reference", "torch_shift", "aten", "cpu_native"):
            with kernel_variants.force(causal_conv1d_fn=vid), pytest.raises(ValueError, match="cache_indices"):
                kernel_variants.causal_conv1d_fn(**call)
            assert torch.equal(call["conv_states"], pool), f"{vid} wrote the pool before the error"
    monkeypatch.setattr(_op, "host_values", lambda t: False)  # as on an accelerator
    call = {**_fn_call(), "cache_indices": torch.tensor([2, 0, 2], dtype=torch.int32)}
    kernel_variants.explain(FN, **call)  # metadata is still checked, values are not
    with pytest.raises(ValueError, match="weight"):
        kernel_variants.explain(FN, **{**call, "weight": torch.randn(3, W)})


def test_valid_calls_of_the_matrix_run():
    for base, op in ((_fn_call, FN), (_varlen_call, FN), (_update_call, UP)):
        call = base()
        assert getattr(kernel_variants, op)(**call).shape == call["x"].shape


def test_slot_count_is_metadata_and_checked_without_value_checks(monkeypatch):
    monkeypatch.setenv("KV_CHECK_VALUES", "0")
    kernel_variants.reload()
    call = {**_fn_call(), "cache_indices": None, "conv_states": torch.randn(2, S, D)}
    with pytest.raises(ValueError, match="conv_states: expected at least B=3 slots"):
        kernel_variants.causal_conv1d_fn(**call)


@pytest.mark.parametrize("bad", [1.0, True, "1"])
def test_a_memoised_call_still_refuses_a_pad_slot_id_of_the_wrong_type(bad):
    call = _fn_call()
    kernel_variants.causal_conv1d_fn(**call, pad_slot_id=1)  # memoises this signature
    with pytest.raises(TypeError, match=f"pad_slot_id: expected int, got {type(bad).__name__}"):
        kernel_variants.causal_conv1d_fn(**call, pad_slot_id=bad)
