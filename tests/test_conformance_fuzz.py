"""Property test of both conv ops: drawn shapes, widths, strides, slot maps, pad ids (outside
and inside the slot range), initial-state masks, packed lengths, accepted-token counts and
aliasing; the dispatched op, pinned to each CPU variant in turn, against the reference on a
copy: outputs within tolerance, the whole pool bit for bit, and an aliased call refused before
anything is written. Seeded, so CI runs the same examples every time."""

from __future__ import annotations

import pytest
import torch

import kernel_variants as kv
from kernel_variants._policy import NoVariantError
from kernel_variants._tolerances import mismatch
from kernel_variants.ops.causal_conv1d import _reference as ref

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

CPU_VARIANTS = ("reference", "torch_shift", "aten", "cpu_native")
EXAMPLES = 300


def _strided(t: torch.Tensor, on: bool) -> torch.Tensor:
    if not on:
        return t
    big = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype)
    view = big[..., ::2]
    view.copy_(t)
    return view


@st.composite
def calls(draw):
    op = draw(st.sampled_from(["causal_conv1d_fn", "causal_conv1d_update"]))
    batch, dim = draw(st.integers(1, 4)), draw(st.integers(1, 24))
    width = draw(st.integers(2, 4))
    spec = op == "causal_conv1d_update" and draw(st.booleans())
    seqlen = draw(st.integers(2 if spec else 1, 5))
    rows = width - 1 + (seqlen - 1 if spec else 0) + draw(st.integers(0, 2))
    pad = draw(st.sampled_from([-1, 0]))  # 0: vLLM's null block, a pad id inside the slot range
    n_slots = batch + 3
    usable = [s for s in range(n_slots) if s != pad]
    slots = draw(st.permutations(usable))[:batch]
    slots = [pad if draw(st.integers(0, 4)) == 0 else s for s in slots]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lead = draw(st.integers(0, 1))
    base = torch.randn(n_slots * (1 + lead), rows + lead, dim, generator=gen)
    pool = base[:: 1 + lead, lead:] if lead else base
    weight = _strided(torch.randn(dim, width, generator=gen) / width, draw(st.booleans()))
    bias = torch.randn(dim, generator=gen) if draw(st.booleans()) else None
    idx = torch.tensor(slots, dtype=torch.int32)
    act = draw(st.sampled_from([None, "silu", "swish"]))
    alias = draw(st.integers(0, 9)) == 0
    if op == "causal_conv1d_fn":
        varlen = draw(st.booleans())
        if varlen:
            lengths = [draw(st.integers(0, 4)) for _ in range(batch)]
            x = torch.randn(sum(lengths), dim, generator=gen)
            qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        else:
            x, qsl = torch.randn(batch, seqlen, dim, generator=gen), None
        x = _strided(x, draw(st.booleans()))
        if alias and not varlen and x.shape[1] <= rows:
            x = pool[: batch, : x.shape[1]]
        else:
            alias = False
        init = torch.rand(batch, generator=gen) < 0.6
        kwargs = dict(conv_states=pool, cache_indices=idx, has_initial_state=init, query_start_loc=qsl,
                      activation=act, pad_slot_id=pad)
        return op, (x, weight, bias), kwargs, base, alias
    x = torch.randn(batch, seqlen, dim, generator=gen) if seqlen > 1 or spec else torch.randn(batch, dim, generator=gen)
    x = _strided(x, draw(st.booleans()))
    if alias and x.ndim == 2:
        x = pool[: batch, 0]
    else:
        alias = False
    nat = torch.tensor([draw(st.integers(1, seqlen)) for _ in range(batch)], dtype=torch.int32) if spec else None
    kwargs = dict(activation=act, conv_state_indices=idx, num_accepted_tokens=nat, pad_slot_id=pad)
    return op, (x, pool, weight, bias), kwargs, base, alias


def _fresh(op, args, kwargs, base):
    """The call on a copy of the pool allocation (same strides and offset)."""
    copy = base.clone()
    pool = kwargs.get("conv_states") if op == "causal_conv1d_fn" else args[1]
    view = copy.as_strided(pool.size(), pool.stride(), pool.storage_offset())
    if op == "causal_conv1d_fn":
        return args, {**kwargs, "conv_states": view}, copy
    return (args[0], view, *args[2:]), kwargs, copy


@hypothesis.settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(call=calls(), vid=st.sampled_from(CPU_VARIANTS))
def test_dispatched_op_matches_the_reference(call, vid):
    op, args, kwargs, base, alias = call
    public = getattr(kv, op)
    if alias:
        before = base.clone()
        with kv.force(**{op: vid}), pytest.raises(ValueError, match="expected memory apart"):
            public(*args, **kwargs)
        assert torch.equal(base, before), "an aliased call wrote the pool"
        return
    r_args, r_kwargs, r_pool = _fresh(op, args, kwargs, base)
    expected = getattr(ref, op)(*r_args, **r_kwargs)
    d_args, d_kwargs, d_pool = _fresh(op, args, kwargs, base)
    try:
        with kv.force(**{op: vid}):
            got = public(*d_args, **d_kwargs)
    except NoVariantError:
        hypothesis.assume(False)  # the pinned variant does not claim this call (aten: no varlen)
    assert mismatch(got, expected, "output") is None, mismatch(got, expected, "output")
    assert mismatch(d_pool, r_pool, "state pool", exact=True) is None, mismatch(d_pool, r_pool, "state pool", exact=True)
