"""The vLLM drop-ins (kernel_variants.integrations.vllm) on the CPU, without vLLM: prefill, decode
and speculative verification in vLLM's layouts, its refusals, and views, not copies.

How the inputs are built and checked: ``tests/helpers/engines.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engines import (
    N_SLOTS,
    D,
    Spy,
    W,
    _close,
    _ints,
    _oracle,
    _qsl,
    _weight,
)

from kernel_variants.integrations import _common
from kernel_variants.integrations import sglang as kv_sglang
from kernel_variants.integrations import vllm as kv_vllm

pytestmark = pytest.mark.usefixtures("reference_variant")


def _vllm_prefill(extra_rows: int = 0):
    lengths = [5, 3, 2, 6]
    hidden = torch.randn(sum(lengths), D)  # vLLM's [tokens, dim] activations
    cache = torch.randn(N_SLOTS, W - 1 + extra_rows, D)  # its [N, S, dim] allocation
    _, weight = _weight()
    return dict(
        hidden=hidden, cache=cache, weight=weight, bias=torch.randn(D), lengths=lengths,
        qsl=_qsl(lengths), slots=_ints([3, 0, 1, 4]),  # slot 0: vLLM's null block (padding)
        init=torch.tensor([True, True, False, True]),
    )


@pytest.mark.parametrize("extra_rows", [0, 2])
def test_vllm_prefill_matches_reference(extra_rows):
    c = _vllm_prefill(extra_rows)
    ref_pool = c["cache"][:, : W - 1].clone()  # vLLM's history: the first W-1 rows of a slot
    expected = _oracle().causal_conv1d_fn(
        c["hidden"], c["weight"], c["bias"], conv_states=ref_pool, cache_indices=c["slots"],
        has_initial_state=c["init"], query_start_loc=c["qsl"], activation="silu", pad_slot_id=0,
    )
    before = c["cache"].clone()
    x = c["hidden"].transpose(0, 1)
    out = kv_vllm.causal_conv1d_fn(
        x, c["weight"], c["bias"], c["cache"].transpose(-1, -2), c["qsl"],
        cache_indices=c["slots"], has_initial_state=c["init"], activation="silu",
    )
    assert out.shape == (D, sum(c["lengths"])) and out.stride() == x.stride()
    _close(out.transpose(0, 1), expected, "output")
    _close(c["cache"][:, : W - 1], ref_pool, "state rows 0..W-2", exact=True)
    _close(c["cache"][:, W - 1 :], before[:, W - 1 :], "rows past W-1 untouched", exact=True)
    _close(c["cache"][0], before[0], "null block untouched", exact=True)
    assert out[:, 5:8].abs().sum() == 0  # the null-block sequence: zero rows


def test_vllm_legacy_signature_skips_pad_slot_not_slot_0():
    c = _vllm_prefill()
    slots = _ints([3, -1, 0, 4])
    ref_pool = c["cache"].clone()
    expected = _oracle().causal_conv1d_fn(
        c["hidden"], c["weight"], c["bias"], conv_states=ref_pool, cache_indices=slots,
        has_initial_state=c["init"], query_start_loc=c["qsl"], activation="silu", pad_slot_id=-1,
    )
    out = kv_vllm.causal_conv1d_fn_legacy(
        c["hidden"].transpose(0, 1), c["weight"], c["bias"], c["cache"].transpose(-1, -2),
        c["qsl"], slots, c["init"], True, -1,
    )
    _close(out.transpose(0, 1), expected, "output")
    _close(c["cache"], ref_pool, "state", exact=True)


def test_vllm_prefill_empty_sequence_writes_no_state():
    lengths = [4, 0, 3]
    hidden = torch.randn(7, D)
    cache = torch.randn(N_SLOTS, W - 1, D)
    _, weight = _weight()
    before = cache.clone()
    kv_vllm.causal_conv1d_fn(
        hidden.transpose(0, 1), weight, None, cache.transpose(-1, -2), _qsl(lengths),
        cache_indices=_ints([1, 2, 3]), has_initial_state=torch.tensor([False, False, False]),
    )
    _close(cache[2], before[2], "empty sequence's slot", exact=True)
    assert not torch.equal(cache[1], before[1]) and not torch.equal(cache[3], before[3])


def test_vllm_decode_single_token():
    batch = 4
    hidden = torch.randn(batch, D)
    cache = torch.randn(N_SLOTS, W - 1, D)
    _, weight = _weight()
    bias = torch.randn(D)
    slots = _ints([5, 0, 2, 1])
    ref_pool = cache.clone()
    expected = _oracle().causal_conv1d_update(
        hidden, ref_pool, weight, bias, activation="silu", conv_state_indices=slots, pad_slot_id=0,
    )
    out = kv_vllm.causal_conv1d_update(
        hidden, cache.transpose(-1, -2), weight, bias, "silu", conv_state_indices=slots,
    )
    _close(out, expected, "output")
    _close(cache, ref_pool, "state", exact=True)


def test_vllm_spec_verify_channel_first_x():
    batch, length = 3, 3
    rows = W - 1 + length - 1
    hidden = torch.randn(batch, length, D)
    cache = torch.randn(N_SLOTS, rows + 1, D)  # one spare row the kernel must not touch
    _, weight = _weight()
    slots, accepted = _ints([2, 4, 1]), _ints([1, 3, 2])
    ref_pool = cache[:, :rows].clone()
    expected = _oracle().causal_conv1d_update(
        hidden, ref_pool, weight, None, activation=None, conv_state_indices=slots,
        num_accepted_tokens=accepted, pad_slot_id=0,
    )
    before = cache.clone()
    x = hidden.transpose(1, 2)  # (batch, dim, seqlen)
    out = kv_vllm.causal_conv1d_update(
        x, cache.transpose(-1, -2), weight, conv_state_indices=slots, num_accepted_tokens=accepted,
    )
    assert out.shape == x.shape and out.stride() == x.stride()
    _close(out.transpose(1, 2), expected, "output")
    _close(cache[:, :rows], ref_pool, "state", exact=True)
    _close(cache[:, rows:], before[:, rows:], "spare row", exact=True)


def test_vllm_contract_worked_example():
    """CONTRACT.md's numbers: W=4, L=3, S=5, n=2, all weights 1."""
    cache = torch.tensor([2.0, 3, 4, 5, 6]).view(1, 5, 1)
    x = torch.tensor([7.0, 8, 9]).view(1, 3, 1).transpose(1, 2)
    out = kv_vllm.causal_conv1d_update(
        x, cache.transpose(-1, -2), torch.ones(1, 4), conv_state_indices=_ints([0]),
        num_accepted_tokens=_ints([2]), null_block_id=None,
    )
    assert out.flatten().tolist() == [19.0, 24.0, 29.0]
    assert cache.flatten().tolist() == [4.0, 5.0, 7.0, 8.0, 9.0]


@pytest.mark.parametrize("lengths", [[3, 3, 3], [3, 0, 2]])
def test_vllm_packed_spec_verify(lengths):
    max_len = 3
    hidden = torch.randn(sum(lengths), D)
    cache = torch.randn(N_SLOTS, W - 1 + max_len - 1, D)
    _, weight = _weight()
    slots, accepted = _ints([4, 0, 2]), _ints([2, 1, 1])
    ref_pool = cache.clone()
    expected = torch.zeros_like(hidden)
    start = 0
    for b, n in enumerate(lengths):  # vLLM: sequence b uses W-1+n-1 state rows
        if n and int(slots[b]) != 0:
            expected[start : start + n] = _oracle().causal_conv1d_update(
                hidden[start : start + n].unsqueeze(0), ref_pool[:, : W - 2 + n], weight, None,
                activation="silu", conv_state_indices=slots[b : b + 1],
                num_accepted_tokens=accepted[b : b + 1], pad_slot_id=0,
            )[0]
        start += n
    out = kv_vllm.causal_conv1d_update(
        hidden, cache.transpose(-1, -2), weight, None, True, slots, accepted,
        query_start_loc=_qsl(lengths), max_query_len=max_len,
    )
    _close(out, expected, "output")
    _close(cache, ref_pool, "state", exact=True)


def test_vllm_refusals(monkeypatch):
    c = _vllm_prefill()
    args = (c["hidden"].transpose(0, 1), c["weight"], None, c["cache"].transpose(-1, -2), c["qsl"])
    with pytest.raises(NotImplementedError, match="block_idx_last_scheduled_token"):
        kv_vllm.causal_conv1d_fn(*args, block_idx_last_scheduled_token=_ints([0, 0, 0, 0]))
    with pytest.raises(NotImplementedError, match="initial_state_idx"):
        kv_vllm.causal_conv1d_fn(*args, initial_state_idx=_ints([0, 0, 0, 0]))
    with pytest.raises(NotImplementedError, match=r"conv state is torch\.float64"):
        kv_vllm.causal_conv1d_fn(*args[:3], c["cache"].double().transpose(-1, -2), c["qsl"])
    pool = torch.zeros(N_SLOTS, W - 1 + 2, D).transpose(-1, -2)
    with pytest.raises(NotImplementedError, match="retrieve_parent_token"):
        kv_vllm.causal_conv1d_update(torch.randn(2, D, 3), pool, c["weight"],
                                     retrieve_parent_token=_ints([0, 0]))
    hidden = torch.randn(4, D)
    with pytest.raises(NotImplementedError, match="shorter than max_query_len"):
        kv_vllm.causal_conv1d_update(hidden, pool, c["weight"], conv_state_indices=_ints([1, 2]),
                                     query_start_loc=_qsl([3, 1]), max_query_len=3)
    monkeypatch.setattr(_common, "capturing", lambda device: True)
    with pytest.raises(NotImplementedError, match="graph capture"):
        kv_vllm.causal_conv1d_update(hidden, pool, c["weight"], conv_state_indices=_ints([1, 2]),
                                     num_accepted_tokens=_ints([1, 1]),
                                     query_start_loc=_qsl([3, 1]), max_query_len=3)


def test_vllm_passes_views_not_copies(monkeypatch):
    spy = Spy(monkeypatch)
    c = _vllm_prefill(extra_rows=1)
    x = c["hidden"].transpose(0, 1)
    pool = c["cache"].transpose(-1, -2)
    kv_vllm.causal_conv1d_fn(x, c["weight"], c["bias"], pool, c["qsl"], c["slots"], c["init"])
    spy.assert_views(x, pool, c["weight"])
    spy.calls.clear()
    xd = torch.randn(3, 2, D).transpose(1, 2)
    kv_vllm.causal_conv1d_update(xd, pool, c["weight"], conv_state_indices=_ints([1, 2, 0]),
                                 num_accepted_tokens=_ints([1, 2, 1]))
    spy.assert_views(xd, pool, c["weight"])
    spy.calls.clear()
    packed = torch.randn(3, D)
    kv_vllm.causal_conv1d_update(packed, pool, c["weight"], conv_state_indices=_ints([1, 2]),
                                 num_accepted_tokens=_ints([1, 2]), query_start_loc=_qsl([1, 2]),
                                 max_query_len=2)
    assert len(spy.calls) == 2  # unequal lengths: one call per sequence, each a view
    spy.assert_views(packed, pool, c["weight"])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_trailing_slot_indices_are_ignored(engine):
    """vLLM's and sglang's own varlen tests pass more cache_indices (and flags) than sequences;
    their kernels read the first B."""
    lengths = [3, 5, 2]
    hidden = torch.randn(sum(lengths), D)
    _, weight = _weight()
    slots, init = _ints([2, 4, 1]), torch.tensor([True, False, True])
    extra_slots, extra_init = _ints([2, 4, 1, 5, 3]), torch.tensor([True, False, True, True, True])
    cache = torch.randn(N_SLOTS, W - 1, D)
    ref_pool = cache.clone()
    expected = _oracle().causal_conv1d_fn(hidden, weight, None, conv_states=ref_pool,
                                          cache_indices=slots, has_initial_state=init,
                                          query_start_loc=_qsl(lengths), activation="silu")
    if engine == "vllm":
        out = kv_vllm.causal_conv1d_fn(hidden.transpose(0, 1), weight, None,
                                       cache.transpose(-1, -2), _qsl(lengths), extra_slots,
                                       extra_init)
    else:
        out = kv_sglang.causal_conv1d_fn(hidden.transpose(0, 1), weight, None,
                                         cache.transpose(-1, -2), _qsl(lengths), lengths,
                                         cache_indices=extra_slots, has_initial_state=extra_init)
    _close(out.transpose(0, 1), expected, "output")
    _close(cache, ref_pool, "state (slots 5 and 3 untouched)", exact=True)
