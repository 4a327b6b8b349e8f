"""The adapters' fast steps: the everyday engine calls on fewer Python steps, the same results as
the general path, the layout aliases and inference pools.

How the inputs are built and checked: ``tests/helpers/engines.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from helpers.engines import (
    N_SLOTS,
    D,
    Spy,
    W,
    _entries_only,
    _ints,
    _qsl,
)
from helpers.fast_steps import general_path

from kernel_variants.integrations import _fast
from kernel_variants.integrations import vllm as kv_vllm

pytestmark = pytest.mark.usefixtures("reference_variant")


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
    from kernel_variants._runtime.callcore import FUNCTIONS

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
