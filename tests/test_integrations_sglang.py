"""The sglang drop-ins (kernel_variants.integrations.sglang) on the CPU, without sglang: its CUDA
call forms and sgl_kernel_npu's Ascend ones, its refusals, and views, not copies.

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

pytestmark = pytest.mark.usefixtures("reference_variant")


# --------------------------------------------------------------------------------------------
# sglang (CUDA paths)
# --------------------------------------------------------------------------------------------


def test_sglang_triton_prefill_with_padded_tokens():
    lengths = [4, 2, 5]
    hidden = torch.randn(sum(lengths) + 3, D)  # 3 padding tokens past query_start_loc[-1]
    pool_cf = torch.randn(N_SLOTS, D, W - 1)  # sglang's channel-first pool, contiguous
    _, weight = _weight()
    bias = torch.randn(D)
    slots, init = _ints([2, -1, 5]), torch.tensor([True, False, False])
    ref_pool = pool_cf.transpose(1, 2).contiguous()
    expected = _oracle().causal_conv1d_fn(
        hidden[: sum(lengths)], weight, bias, conv_states=ref_pool, cache_indices=slots,
        has_initial_state=init, query_start_loc=_qsl(lengths), activation="silu",
    )
    out = kv_sglang.causal_conv1d_fn(
        hidden.transpose(0, 1), weight, bias, pool_cf, _qsl(lengths), lengths,
        cache_indices=slots, has_initial_state=init, activation="silu",
    )
    assert out.shape == (D, hidden.shape[0])
    _close(out.transpose(0, 1)[: sum(lengths)], expected, "output")
    assert out[:, sum(lengths) :].abs().sum() == 0
    _close(pool_cf.transpose(1, 2), ref_pool, "state", exact=True)


def test_sglang_cuda_wrapper_prefill_batched_x():
    batch, length = 2, 5
    hidden = torch.randn(batch, length, D)
    pool_cf = torch.randn(N_SLOTS, D, W - 1)
    _, weight = _weight()
    slots, init = _ints([4, 1]), torch.tensor([True, False])
    ref_pool = pool_cf.transpose(1, 2).contiguous()
    expected = _oracle().causal_conv1d_fn(hidden, weight, None, conv_states=ref_pool,
                                          cache_indices=slots, has_initial_state=init)
    out = kv_sglang.causal_conv1d_fn_cuda(
        hidden.transpose(1, 2), weight, None, cache_indices=slots, has_initial_state=init,
        conv_states=pool_cf, activation=None,
    )
    _close(out.transpose(1, 2), expected, "output")
    _close(pool_cf.transpose(1, 2), ref_pool, "state", exact=True)


def test_sglang_decode_and_spec_update():
    _, weight = _weight()
    pool_cf = torch.randn(N_SLOTS, D, W - 1)  # sglang's channel-first pool
    hidden = torch.randn(3, D)
    slots = _ints([1, -1, 3])
    ref_pool = pool_cf.transpose(1, 2).contiguous()
    expected = _oracle().causal_conv1d_update(hidden, ref_pool, weight, None, activation="silu",
                                              conv_state_indices=slots)
    out = kv_sglang.causal_conv1d_update(hidden, pool_cf, weight, None, "silu",
                                         conv_state_indices=slots)
    _close(out, expected, "decode output")
    _close(pool_cf.transpose(1, 2), ref_pool, "decode state", exact=True)

    out = kv_sglang.causal_conv1d_update_cuda(hidden, pool_cf, weight, None, True, None, slots)
    expected = _oracle().causal_conv1d_update(hidden, ref_pool, weight, None, activation="silu",
                                              conv_state_indices=slots)
    _close(out, expected, "sgl_kernel wrapper output")
    _close(pool_cf.transpose(1, 2), ref_pool, "sgl_kernel wrapper state", exact=True)

    length = 2
    spec_cf = torch.randn(N_SLOTS, D, W - 1 + length - 1)
    hidden = torch.randn(2, length, D)
    slots, accepted = _ints([0, 2]), _ints([2, 1])
    ref_pool = spec_cf.transpose(1, 2).contiguous()
    expected = _oracle().causal_conv1d_update(hidden, ref_pool, weight, None, activation=None,
                                              conv_state_indices=slots,
                                              num_accepted_tokens=accepted)
    x = hidden.transpose(1, 2)  # sglang: mixed_qkv.view(B, L, -1).transpose(1, 2)
    out = kv_sglang.causal_conv1d_update(x, spec_cf, weight, conv_state_indices=slots,
                                         num_accepted_tokens=accepted)
    assert out.shape == x.shape and out.stride() == x.stride()
    _close(out.transpose(1, 2), expected, "verify output")
    _close(spec_cf.transpose(1, 2), ref_pool, "verify state", exact=True)


def test_sglang_refuses_its_own_speculative_machinery():
    _, weight = _weight()
    x = torch.randn(2, D, 3)
    pool = torch.zeros(N_SLOTS, D, W - 1)
    for name in ("intermediate_conv_window", "retrieve_next_token", "cache_seqlens"):
        with pytest.raises(NotImplementedError, match=name):
            kv_sglang.causal_conv1d_update(x, pool, weight, **{name: torch.zeros(2, 3)})


def test_sglang_passes_views_not_copies(monkeypatch):
    spy = Spy(monkeypatch)
    _, weight = _weight()
    pool_cf = torch.randn(N_SLOTS, D, W - 1)
    x = torch.randn(6, D).transpose(0, 1)
    kv_sglang.causal_conv1d_fn(x, weight, None, pool_cf, _qsl([4, 2]), [4, 2],
                               cache_indices=_ints([1, 2]))
    spy.assert_views(x, pool_cf, weight)
    spy.calls.clear()
    xd = torch.randn(2, 1, D).transpose(1, 2)
    kv_sglang.causal_conv1d_update(xd, pool_cf, weight, conv_state_indices=_ints([3, 4]))
    spy.assert_views(xd, pool_cf, weight)


# --------------------------------------------------------------------------------------------
# sglang on Ascend (sgl_kernel_npu's call forms)
# --------------------------------------------------------------------------------------------


def test_sglang_npu_prefill_as_the_ascend_backend_calls_it():
    lengths = [3, 5]
    _, weight = _weight()
    pool = torch.randn(N_SLOTS, W - 1, D)  # Ascend: [N, window, dim]
    hidden = torch.randn(sum(lengths), D)
    slots, init = _ints([2, 3]), torch.tensor([True, False])
    ref_pool = pool.clone()
    expected = _oracle().causal_conv1d_fn(hidden, weight, None, conv_states=ref_pool,
                                          cache_indices=slots, has_initial_state=init,
                                          query_start_loc=_qsl(lengths), activation="silu")
    tmp = pool[:, -(W - 1) :, :].transpose(1, 2).contiguous()  # sglang's own staging copy
    out = kv_sglang.causal_conv1d_fn_npu(
        hidden.transpose(0, 1), weight, None, activation="silu", conv_states=tmp,
        has_initial_state=init, cache_indices=slots, query_start_loc=_qsl(lengths),
        seq_lens_cpu=lengths,
    ).transpose(0, 1)
    pool[:, -(W - 1) :, :] = tmp.transpose(1, 2)
    _close(out, expected, "output")
    _close(pool, ref_pool, "state", exact=True)
    with pytest.raises(NotImplementedError, match="exactly W-1"):
        kv_sglang.causal_conv1d_fn_npu(hidden.transpose(0, 1), weight, conv_states=torch.zeros(
            N_SLOTS, D, W), cache_indices=slots, query_start_loc=_qsl(lengths))


def test_sglang_npu_update_v2_channel_last():
    batch, length = 3, 2
    rows = W - 1 + length - 1
    _, weight = _weight()
    weight_wd = weight.transpose(0, 1).contiguous()  # what sglang passes: [W, dim]
    pool = torch.randn(N_SLOTS, rows, D)
    hidden = torch.randn(batch, length, D)
    slots, accepted = _ints([1, -1, 4]), _ints([2, 1, 1])
    ref_pool = pool.clone()
    expected = _oracle().causal_conv1d_update(hidden, ref_pool, weight, None, activation="silu",
                                              conv_state_indices=slots,
                                              num_accepted_tokens=accepted)
    out = kv_sglang.causal_conv1d_update_v2(
        x=hidden, conv_state=pool, weight=weight_wd, bias=None, activation="silu",
        conv_state_indices=slots, num_accepted_tokens=accepted, pad_slot_id=-1,
    )
    _close(out, expected, "output")
    _close(pool, ref_pool, "state", exact=True)


def test_sglang_npu_update_npu_channel_first():
    _, weight = _weight()
    bias = torch.randn(D)
    pool_cf = torch.randn(N_SLOTS, D, W - 1)
    hidden = torch.randn(2, D)
    ref_pool = pool_cf.transpose(1, 2).contiguous()
    expected = _oracle().causal_conv1d_update(hidden, ref_pool, weight, bias, activation="silu",
                                              conv_state_indices=_ints([5, 0]))
    out = kv_sglang.causal_conv1d_update_npu(hidden, pool_cf, weight, bias, "silu",
                                             conv_state_indices=_ints([5, 0]))
    _close(out, expected, "output")  # the bias counts (sgl_kernel_npu's torch path drops it)
    _close(pool_cf.transpose(1, 2), ref_pool, "state", exact=True)


@pytest.mark.parametrize("in_capture", [False, True])
def test_sglang_ascend_op_form(monkeypatch, in_capture):
    spy = Spy(monkeypatch)
    _, weight = _weight()
    weight_wd = weight.transpose(0, 1).contiguous()
    lengths = [2, 4]
    pool = torch.randn(N_SLOTS, W - 1, D)
    hidden = torch.randn(sum(lengths), D)
    slots, init = _ints([1, 2]), torch.tensor([False, True])
    ref_pool = pool.clone()
    expected = _oracle().causal_conv1d_fn(hidden, weight, None, conv_states=ref_pool,
                                          cache_indices=slots, has_initial_state=init,
                                          query_start_loc=_qsl(lengths), activation="silu")
    out = kv_sglang.npu_causal_conv1d(hidden, weight_wd, conv_states=pool, bias=None,
                                      query_start_loc=_qsl(lengths), cache_indices=slots,
                                      has_initial_state=init, activation_mode=1, run_mode=0)
    _close(out, expected, "prefill output")
    _close(pool, ref_pool, "prefill state", exact=True)
    spy.assert_views(hidden, pool, weight_wd)

    # verify: dense query_start_loc with step draft_token_num, pool of W-1+L-1 rows
    draft = 3
    spec_pool = torch.randn(N_SLOTS, W - 1 + draft - 1, D)
    tokens = torch.randn(2 * draft, D)
    accepted = _ints([3, 1])
    ref_pool = spec_pool.clone()
    expected = _oracle().causal_conv1d_update(tokens.view(2, draft, D), ref_pool, weight, None,
                                              activation="silu", conv_state_indices=slots,
                                              num_accepted_tokens=accepted).view(-1, D)
    monkeypatch.setattr(_common, "capturing", lambda device: in_capture)
    out = kv_sglang.npu_causal_conv1d(tokens, weight_wd, conv_states=spec_pool,
                                      query_start_loc=_ints([0, draft, 2 * draft]),
                                      cache_indices=slots, num_accepted_tokens=accepted,
                                      activation_mode=1, pad_slot_id=-1, run_mode=1)
    _close(out, expected, "verify output")
    _close(spec_pool, ref_pool, "verify state", exact=True)
