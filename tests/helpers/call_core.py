"""What the call-core tests share (tests/test_call_core_*.py): the compiled call core and the Python call path: the same keys, decisions, results and errors.

Every call is made twice per path (the first one decides and teaches the core its entry, the
second is served by the core, where it is on), with ``KV_CALL_CORE`` on and off. The core is
built here when it is not (as ``kv build`` does); a machine without a C++ toolchain skips this
file, and every other test file passes there on the Python path.
"""

from __future__ import annotations

import pytest
import torch

import kernel_variants as kv
from kernel_variants._native import build
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants.ops.causal_conv1d import ConvCapabilities, _reference
from kernel_variants.plugin import Variant

# Each call-core test file's marks: skipped without a C++ toolchain, the core built first
# (the ``call_core_built`` fixture, in conftest.py).
CORE_MARKS = [pytest.mark.skipif(build.toolchain_missing() is not None,
                                 reason=f"the call core cannot be built here: {build.toolchain_missing()}"),
              pytest.mark.usefixtures("call_core_built")]

B, L, D, W, N, S = 3, 4, 8, 4, 6, 3
FN, UP = "causal_conv1d_fn", "causal_conv1d_update"


def _fn_call(seed: int = 0, **changes):
    g = torch.Generator().manual_seed(seed)
    call = dict(x=torch.randn(B, L, D, generator=g), weight=torch.randn(D, W, generator=g),
                bias=torch.randn(D, generator=g), conv_states=torch.randn(N, S, D, generator=g),
                cache_indices=torch.tensor([4, 0, 2], dtype=torch.int32),
                has_initial_state=torch.tensor([True, False, True]), activation="silu")
    call.update(changes)
    return call


def _varlen_call(seed: int = 0, **changes):
    call = _fn_call(seed)
    call["x"] = torch.randn(10, D, generator=torch.Generator().manual_seed(seed + 1))
    call["query_start_loc"] = torch.tensor([0, 3, 3, 10], dtype=torch.int64)
    call.update(changes)
    return call


def _update_call(seed: int = 0, **changes):
    g = torch.Generator().manual_seed(seed)
    call = dict(x=torch.randn(B, 2, D, generator=g), conv_state=torch.randn(N, S + 1, D, generator=g),
                weight=torch.randn(D, W, generator=g), bias=torch.randn(D, generator=g),
                conv_state_indices=torch.tensor([1, -1, 3], dtype=torch.int64),
                num_accepted_tokens=torch.tensor([1, 2, 2], dtype=torch.int32), activation="swish")
    call.update(changes)
    return call


def _decode_call(seed: int = 0, **changes):
    g = torch.Generator().manual_seed(seed)
    call = dict(x=torch.randn(1, D, generator=g), conv_state=torch.randn(N, W - 1, D, generator=g),
                weight=torch.randn(D, W, generator=g), conv_state_indices=torch.tensor([5], dtype=torch.int32))
    call.update(changes)
    return call


def _rms_call(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(4, D, generator=g), weight=torch.randn(D, generator=g))


CALLS = {
    "fn, states and slots": (FN, _fn_call),
    "fn, no states": (FN, lambda seed=0: _fn_call(seed, conv_states=None, cache_indices=None, has_initial_state=None)),
    "fn, varlen": (FN, _varlen_call),
    "fn, strided pool": (FN, lambda seed=0: _fn_call(seed, conv_states=torch.randn(
        S, N, D, generator=torch.Generator().manual_seed(seed)).transpose(0, 1))),
    "fn, pad slot": (FN, lambda seed=0: _fn_call(seed, cache_indices=torch.tensor([4, 7, 2], dtype=torch.int64),
                                                  pad_slot_id=7)),
    "update, speculative": (UP, _update_call),
    "update, decode step": (UP, _decode_call),
    "gemma_rms_norm": ("gemma_rms_norm", _rms_call),
}


def _run(op: str, call: dict) -> tuple[object, dict]:
    """(the result, the tensors after the call: states are written in place)."""
    res = getattr(kv, op)(**call)
    return res, {k: v.clone() for k, v in call.items() if isinstance(v, torch.Tensor)}


def _decisions() -> dict:
    return {sig: hit.vid for sig, hit in dispatcher().memo.items()}


def _calls_twice(calls, grad: bool = False):
    out = []
    with torch.enable_grad() if grad else torch.no_grad():
        for op, make in calls.values():
            out.append([_run(op, make(seed)) for seed in (0, 1)])
    return out


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, tuple | list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def _error(op: str, call: dict) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        getattr(kv, op)(**call)
    return type(info.value), str(info.value)


def _recording(op: str, seen: list, fail: bool = False):
    ref = _reference.causal_conv1d_fn if op == FN else _reference.causal_conv1d_update

    def fn(*args, **kwargs):
        seen.append((len(args), dict(kwargs)))
        if fail:
            raise RuntimeError("kernel exploded")
        return ref(*args, **kwargs)

    return Variant(id="rec", op=op, version="1", fn=fn, capabilities=ConvCapabilities(
        devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, num_accepted_tokens=True, varlen=True))
