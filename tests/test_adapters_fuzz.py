"""Property test of the engine adapters' fast steps over drawn sequences of engine calls.

The fast steps keep the views they hand the op (the pool, a prefill's x, a slot table's column)
and re-point them at the next step's tensors, and restride a prefill's fresh output in place
(``_runtime/csrc/layout.cpp``: ``Lent``, ``engine_layout``). A sequence mixes vLLM and sglang, decode and
prefill, dtypes, widths of the channel axis, pool layouts, slot tables, pads, grad and inference
mode, and holds on to some results and inputs across later steps. Each step against the same
adapter with its fast step refused (the general path) on copies: the result (values, shape,
strides) and the whole pool bit for bit; and every tensor held from an earlier step still has its
values, shape and strides. Seeded, so CI runs the same examples every time."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.fast_steps import general_path

from kernel_variants.integrations import sglang as kv_sglang
from kernel_variants.integrations import vllm as kv_vllm

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

W, N_SLOTS = 4, 6
EXAMPLES = 150


@st.composite
def steps(draw):
    engine = draw(st.sampled_from(["vllm", "sglang"]))
    prefill = draw(st.booleans())
    batch = draw(st.integers(1, 3))
    # vLLM's null block 0 is its pad; sglang's pad is -1.
    pad = 0 if engine == "vllm" else -1
    slots = draw(st.permutations(range(1, N_SLOTS)))[:batch]
    slots = [pad if draw(st.integers(0, 5)) == 0 else s for s in slots]
    return {
        "engine": engine,
        "prefill": prefill,
        "batch": batch,
        "dim": draw(st.sampled_from([8, 16, 24])),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "pool": draw(st.sampled_from(["transposed", "contiguous"])),
        "table": engine == "vllm" and draw(st.booleans()),
        "slots": slots,
        # An empty sequence sends a prefill to the general path (the fast one asks for none).
        "lengths": [draw(st.integers(0 if draw(st.integers(0, 5)) == 0 else 1, 4)) for _ in range(batch)],
        "init": [draw(st.booleans()) for _ in range(batch)],
        "inference": draw(st.booleans()),
        "hold": draw(st.sampled_from(["nothing", "nothing", "result", "x", "pool view"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _inputs(s):
    g = torch.Generator().manual_seed(s["seed"])
    D, dt = s["dim"], s["dtype"]
    if s["pool"] == "transposed":  # vLLM's [N, S, dim] allocation seen as (N, dim, S)
        pool = torch.randn(N_SLOTS, W - 1, D, generator=g).to(dt).transpose(1, 2)
    else:
        pool = torch.randn(N_SLOTS, D, W - 1, generator=g).to(dt)
    weight = torch.randn(D, W, generator=g).to(dt)
    bias = torch.randn(D, generator=g).to(dt)
    idx = torch.tensor(s["slots"], dtype=torch.int32)
    if s["table"]:
        idx = torch.stack([idx, torch.zeros_like(idx)], 1)  # a slot table, read at column 0
    if s["prefill"]:
        T = sum(s["lengths"])
        x = torch.randn(T, D, generator=g).to(dt).t()  # the engine's (dim, T)
        qsl = torch.tensor([0, *torch.tensor(s["lengths"]).cumsum(0).tolist()], dtype=torch.int32)
        init = torch.tensor(s["init"])
        return x, pool, weight, bias, idx, qsl, init
    x = torch.randn(s["batch"], D, generator=g).to(dt)
    return x, pool, weight, bias, idx, None, None


def _call(s, x, pool, weight, bias, idx, qsl, init):
    engine = kv_vllm if s["engine"] == "vllm" else kv_sglang
    if not s["prefill"]:
        return engine.causal_conv1d_update(x, pool, weight, bias, "silu", conv_state_indices=idx)
    if s["engine"] == "vllm":
        return engine.causal_conv1d_fn(x, weight, bias, conv_states=pool, query_start_loc=qsl, cache_indices=idx,
                                       has_initial_state=init, activation="silu")
    return engine.causal_conv1d_fn(x, weight, bias, conv_states=pool, query_start_loc=qsl,
                                   seq_lens_cpu=list(s["lengths"]), cache_indices=idx, has_initial_state=init,
                                   activation="silu")


def _same(got, want):
    assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(st.lists(steps(), min_size=2, max_size=10))
def test_fast_steps_over_a_sequence_equal_the_general_path_and_leave_held_tensors_alone(sequence):
    held = []  # (a tensor kept from an earlier step, its values, shape and strides then)
    for s in sequence:
        # Engines make their activations under inference_mode when they serve in it.
        mode = torch.inference_mode() if s["inference"] else contextlib.nullcontext()
        with mode:
            args = _inputs(s)
            # Each call its own pool, laid out as the engine's (a clone keeps a transposed view's strides).
            mine, theirs = list(args), list(args)
            mine[1], theirs[1] = (args[1].clone(memory_format=torch.preserve_format) for _ in range(2))
            assert mine[1].stride() == theirs[1].stride() == args[1].stride()
            got = _call(s, *mine)
            with general_path():
                want = _call(s, *theirs)
        _same(got, want)
        _same(mine[1], theirs[1])
        kept = {"result": got, "x": mine[0], "pool view": mine[1][1:3]}.get(s["hold"])
        if kept is not None:
            held.append((kept, kept.clone(), kept.shape, kept.stride()))
        del got, want, mine, theirs, kept
        for t, values, shape, stride in held:
            assert t.shape == shape and t.stride() == stride
            torch.testing.assert_close(t, values, rtol=0, atol=0)
