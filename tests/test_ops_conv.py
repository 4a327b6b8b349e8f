"""The reference against the naive scalar oracle, over the corners of the contract."""

from __future__ import annotations

import pytest
import torch
from helpers import naive

from kernel_variants._tolerances import mismatch
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

FN_CASES = {
    "plain": dict(batch=2, dim=3, seqlen=5, states=False),
    "L=1": dict(batch=3, dim=2, seqlen=1),
    "L<W-1": dict(batch=3, dim=3, seqlen=2),
    "odd-D": dict(batch=2, dim=7, seqlen=4),
    "no-bias-no-act": dict(batch=2, dim=3, seqlen=4, bias=False, activation=None),
    "swish": dict(batch=2, dim=3, seqlen=4, activation="swish"),
    "varlen": dict(batch=4, dim=3, seqlen=3, varlen=True),
    "pad": dict(batch=3, dim=3, seqlen=4, pad=True, poison=True),
    "noncontig": dict(batch=3, dim=3, seqlen=3, noncontig=True, poison=True),
    "extra-rows": dict(batch=2, dim=3, seqlen=2, extra_rows=3, poison=True),
    "varlen-pad-noncontig": dict(batch=4, dim=2, seqlen=2, varlen=True, pad=True, noncontig=True, poison=True),
}

UPDATE_CASES = {
    "2d": dict(batch=3, dim=3, seqlen=1),
    "L=3": dict(batch=2, dim=3, seqlen=3),
    "odd-D": dict(batch=2, dim=5, seqlen=2),
    "extra-rows": dict(batch=2, dim=3, seqlen=2, extra_rows=2),
    "pad": dict(batch=3, dim=3, seqlen=2, pad=True, poison=True),
    "spec": dict(batch=3, dim=3, seqlen=3, spec=True),
    "spec-extra-rows-noncontig": dict(batch=3, dim=2, seqlen=3, spec=True, extra_rows=2, noncontig=True),
    "no-bias": dict(batch=2, dim=3, seqlen=2, bias=False, activation=None),
}


def _check(case, oracle):
    ref_out, ref_pools = case.run(getattr(reference, case.op))
    exp_out, exp_pools = case.run(oracle)
    assert mismatch(ref_out, exp_out, "output") is None, mismatch(ref_out, exp_out, "output")
    for name, pool in exp_pools.items():
        assert mismatch(ref_pools[name], pool, "state pool", exact=True) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("name", FN_CASES)
def test_fn_matches_naive(name, width, dtype):
    _check(make_case("causal_conv1d_fn", width=width, dtype=dtype, **FN_CASES[name]), naive.conv_fn)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("name", UPDATE_CASES)
def test_update_matches_naive(name, width, dtype):
    _check(make_case("causal_conv1d_update", width=width, dtype=dtype, **UPDATE_CASES[name]), naive.conv_update)


def test_worked_example_from_the_contract():
    """W=4, L=3, S=5, one channel, weights 1: outputs 19, 24, 29 and slot [4 5 7 8 9]."""
    state = torch.tensor([2.0, 3, 4, 5, 6]).reshape(1, 5, 1)
    x = torch.tensor([7.0, 8, 9]).reshape(1, 3, 1)
    out = reference.causal_conv1d_update(
        x, state, torch.ones(1, 4), num_accepted_tokens=torch.tensor([2])
    )
    assert out.flatten().tolist() == [19.0, 24.0, 29.0]
    assert state.flatten().tolist() == [4.0, 5.0, 7.0, 8.0, 9.0]


def test_short_sequence_carries_history_over():
    """L=1 < W-1=3: the new history is the old history's last two rows then the token."""
    states = torch.tensor([[1.0], [2.0], [3.0]]).reshape(1, 3, 1)
    x = torch.tensor([[[4.0]]])
    out = reference.causal_conv1d_fn(
        x, torch.ones(1, 4), conv_states=states, has_initial_state=torch.tensor([True])
    )
    assert out.item() == 10.0
    assert states.flatten().tolist() == [2.0, 3.0, 4.0]


def test_has_initial_state_false_reads_zeros_and_still_writes():
    states = torch.full((1, 3, 1), 100.0)
    x = torch.tensor([[[1.0], [2.0]]])
    out = reference.causal_conv1d_fn(x, torch.ones(1, 4), conv_states=states)
    assert out.flatten().tolist() == [1.0, 3.0]
    assert states.flatten().tolist() == [0.0, 1.0, 2.0]
