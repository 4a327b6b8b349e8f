"""Realistic calls of the selective-scan ops, their edge cases and named sweeps.

Values are drawn as a Mamba2 layer makes them: x, B, C and z from projections (unit normal);
``dt`` raw from the projection with ``dt_bias`` = the inverse softplus of a step in [1e-3, 0.1]
(Mamba2's initialisation) and softplus on; ``A = -exp(U(0, log 16))`` per head; ``D`` around 1.
With ``poison`` every slot a call must not read (other sequences', those of sequences without
an initial state, the pad's) holds NaN, and the pad sequence's tokens are NaN too, so reading
or computing one shows up in the output; every slot it must not write is compared bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from kernel_variants._dtypes import as_dtype
from kernel_variants._registry.case import Case, Sweep
from kernel_variants._registry.models import Capabilities
from kernel_variants.ops.ssm._spec import SCAN, UPDATE

SPECS: dict[str, Any] = {}  # filled in by the package once its specs exist


def lengths_of(gen: torch.Generator, batch: int, length: int, varied: bool) -> list[int]:
    """B lengths adding up to B * L: all L, or (``varied``) drawn in [0, 2L], empty ones among them."""
    if not varied or batch == 1:
        return [length] * batch
    lengths = torch.randint(0, 2 * length + 1, (batch,), generator=gen).tolist()
    lengths[0] = 0  # an empty sequence, which still carries (or zeroes) its state
    diff, i = batch * length - sum(lengths), 1
    while diff:
        step = max(-lengths[i], min(diff, 2 * length))
        lengths[i] += step
        diff -= step
        i = 1 + i % (batch - 1)
    return lengths


def _view(t: torch.Tensor, strided: bool, offset: bool) -> torch.Tensor:
    """``t`` as engines pass it: a slice of a wider allocation (row stride past its width) that
    starts a few elements in. The values are t's."""
    if not (strided or offset) or t.ndim < 2:
        return t
    lead, width = t.shape[0], math.prod(t.shape[1:])
    extra = 5 if strided else 0
    start = 3 if offset else 0
    base = torch.full((lead, width + extra + start), float("nan"), dtype=t.dtype, device=t.device)
    view = base[:, start:start + width]
    view.copy_(t.reshape(lead, width))
    return view.view(t.shape) if view.is_contiguous() else view.unflatten(1, t.shape[1:])


def make_case(op: str, shape: tuple[int, ...], *, dtype: torch.dtype | str = torch.float32,
              device: str | torch.device = "cpu", seed: int = 0, headdim: int = 64, dstate: int = 128,
              ngroups: int = 1, state: str = "float32", z: bool = False, dt_limit: bool = False,
              tokens_axis: bool = False, varlen: bool = True, pad: bool = False, poison: bool = False,
              noncontig: bool = False, strided: bool = False, offset: bool = False,
              index_dtype: torch.dtype = torch.int32, slot_indices: bool = True, initial: str = "some",
              pad_slot_id: int = -1, softplus: bool = True, skip: bool = True, bias: bool = True,
              dt_scale: float = 1.0, x_scale: float = 1.0, a: str = "mamba2", inputs: str = "normal",
              split_dst: bool = False) -> Case:
    """A call of ``op`` on (B, H, L) with the features' widths.

    ``tokens_axis``: an update's x as [B, T, H, P] even for T = 1. ``varlen``: a scan's sequences
    of varied lengths adding to B * L (empty ones among them) instead of B of L each. ``pad``:
    one sequence (the middle one) maps to ``pad_slot_id``. ``noncontig``: the pool a view with
    gaps between slots; ``strided``/``offset``: x, dt, B, C and z slices of wider allocations.
    ``initial``: which sequences start from their slot ("some", "none", "all", or "omitted": no
    flags passed). ``dt_scale``: dt raw times this (1e4: softplus far past its threshold);
    ``x_scale``: x times this (a large step with a small x keeps the state's size, and so how far
    two correct fp32 summation orders can land apart, as in the other cases);
    ``a``: "mamba2", "zero" (A = 0: no decay) or "steep" (A = -1e4: the state decays to zero);
    ``inputs``: "normal", "zero" or "outliers" (a few entries of x and B at +-30: thirty sigmas, and
    fp32 sums of their products still within fp32's tolerance in any order).
    ``split_dst``: an update writes other slots than it reads."""
    dtype, sdtype = as_dtype(dtype), as_dtype(state) if state != "none" else None
    gen = torch.Generator().manual_seed(seed)
    batch, heads, length = shape
    lengths = [length] * batch if op == UPDATE else lengths_of(gen, batch, length, varlen)
    total = sum(lengths)

    def randn(*size: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(size, generator=gen) * scale).to(dt)

    lead: tuple[int, ...] = (total,) if op == SCAN else ((batch, length) if tokens_axis or length > 1 else (batch,))
    x = randn(*lead, heads, headdim, scale=x_scale)
    Bm, Cm = randn(*lead, ngroups, dstate), randn(*lead, ngroups, dstate)
    if inputs == "zero":
        x.zero_()
    elif inputs == "outliers":
        x.view(-1)[:: max(1, x.numel() // 7)] = 30.0
        Bm.view(-1)[1 :: max(1, Bm.numel() // 5)] = -30.0
    dt = randn(*lead, heads, scale=0.5 * dt_scale)
    if not softplus:
        dt = (torch.rand(dt.shape, generator=gen) * 0.1 * dt_scale).to(dtype)
    A = -torch.exp(torch.rand(heads, generator=gen) * math.log(16.0))
    if a == "zero":
        A.zero_()
    elif a == "steep":
        A.fill_(-1e4)
    step = 1e-3 + torch.rand(heads, generator=gen) * (0.1 - 1e-3)
    dt_bias = torch.log(torch.expm1(step)) if bias else None
    D = 1.0 + 0.1 * torch.randn(heads, generator=gen) if skip else None
    gate = randn(*lead, heads, headdim) if z else None

    n_slots = batch + 3
    perm = torch.randperm(n_slots, generator=gen).tolist()
    if 0 <= pad_slot_id < n_slots:
        perm.remove(pad_slot_id)  # an in-range pad id is never a live slot
    slots = perm[:batch]
    if not slot_indices:
        slots = list(range(batch))
    pad_at = batch // 2 if pad else None
    if pad_at is not None:
        slots[pad_at] = pad_slot_id
    flags = {"some": [b % 2 == 1 for b in range(batch)], "none": [False] * batch, "all": [True] * batch,
             "omitted": [False] * batch}[initial]
    if op == UPDATE:
        flags = [True] * batch

    pool = base = None
    if sdtype is not None:
        if noncontig:  # every other slot of a larger allocation, from its second slot on
            base = randn(2 * n_slots + 1, heads, headdim, dstate, scale=0.5, dt=sdtype)
            pool = base[1::2]
        else:
            base = pool = randn(n_slots, heads, headdim, dstate, scale=0.5, dt=sdtype)
        if poison:
            read = {s for s, f in zip(slots, flags, strict=True) if f and s != pad_slot_id}
            for s in range(pool.shape[0]):
                if s not in read:
                    pool[s] = float("nan")
    if poison and pad_at is not None:
        rows = slice(sum(lengths[:pad_at]), sum(lengths[:pad_at + 1])) if op == SCAN else pad_at
        x[rows] = float("nan")

    x, dt, Bm, Cm = (_view(t, strided, offset) for t in (x, dt, Bm, Cm))
    gate = None if gate is None else _view(gate, strided, offset)
    x, dt, Bm, Cm, A = (t.to(device) for t in (x, dt, Bm, Cm, A))
    gate, D, dt_bias = (None if t is None else t.to(device) for t in (gate, D, dt_bias))
    if pool is not None:
        base = base.to(device)
        pool = base.as_strided(pool.shape, pool.stride(), pool.storage_offset())
    limits = (1e-3, 0.05) if dt_limit else (0.0, math.inf)
    idx = torch.tensor(slots, dtype=index_dtype, device=device) if slot_indices else None
    if op == UPDATE:
        kwargs: dict[str, Any] = dict(state_batch_indices=idx, pad_slot_id=pad_slot_id)
        if split_dst and idx is not None:
            free = [s for s in range(n_slots) if s not in slots and s != pad_slot_id]
            dst = [s if s == pad_slot_id or not free else free.pop() for s in slots]
            kwargs["dst_state_batch_indices"] = torch.tensor(dst, dtype=index_dtype, device=device)
        args = (pool, x, dt, A, Bm, Cm, D, gate, dt_bias, softplus, *limits)
        return Case(SPECS[op], args, kwargs, {"state": base})
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=index_dtype, device=device)
    kwargs = dict(ssm_states=pool, pad_slot_id=pad_slot_id)
    if pool is not None:
        kwargs["state_indices"] = idx
        if initial != "omitted":
            kwargs["has_initial_state"] = torch.tensor(flags, dtype=torch.bool, device=device)
    args = (x, dt, A, Bm, Cm, cu, D, gate, dt_bias, softplus, *limits)
    return Case(SPECS[op], args, kwargs, {"ssm_states": base} if base is not None else {})


def spec_case(op: str):
    def case(shape: tuple[int, ...], **options: Any) -> Case:
        return make_case(op, shape, **options)

    return case


# Small widths keep the reference (a Python loop per token) quick; every trap of the contract.
_SMALL = dict(headdim=8, dstate=16)
SHARED: dict[str, dict[str, Any]] = {
    "plain": dict(shape=(3, 4, 1), **_SMALL),
    "mamba2-width": dict(shape=(2, 3, 2), headdim=64, dstate=128),
    "groups": dict(shape=(3, 6, 2), ngroups=3, **_SMALL),
    "odd-widths": dict(shape=(2, 3, 3), headdim=5, dstate=9, ngroups=3),
    "gate": dict(shape=(3, 4, 2), z=True, **_SMALL),
    "dt-limits": dict(shape=(2, 4, 3), dt_limit=True, **_SMALL),
    "pad": dict(shape=(4, 4, 2), pad=True, poison=True, **_SMALL),
    "pad-in-range": dict(shape=(4, 4, 2), pad=True, pad_slot_id=0, poison=True, **_SMALL),
    "pad-past-pool": dict(shape=(3, 4, 2), pad=True, pad_slot_id=1 << 20, poison=True, **_SMALL),
    "B=1-pad": dict(shape=(1, 4, 2), pad=True, poison=True, **_SMALL),
    "noncontig-pool": dict(shape=(3, 4, 2), noncontig=True, poison=True, **_SMALL),
    "strided-offset-inputs": dict(shape=(3, 4, 2), strided=True, offset=True, z=True, **_SMALL),
    "int64-indices": dict(shape=(3, 4, 2), index_dtype=torch.int64, pad=True, poison=True, **_SMALL),
    "slot-b": dict(shape=(3, 4, 2), slot_indices=False, **_SMALL),
    "bf16-state": dict(shape=(3, 4, 2), state="bfloat16", **_SMALL),
    "fp16-state": dict(shape=(2, 4, 2), state="float16", **_SMALL),
    "bf16-state-odd-dstate": dict(shape=(2, 4, 1), state="bfloat16", headdim=8, dstate=12),
    # raw dt past softplus's threshold (linear there); x small so the state stays O(1)
    "softplus-linear": dict(shape=(2, 4, 3), dt_scale=50.0, x_scale=0.05, **_SMALL),
    # raw dt to 1e4: exp overflows unless softplus is linear past its threshold; clamped after
    # where the class clamps, else a step of ~1e4, with x small so the state stays O(1) (a class
    # without dt limits builds this case unclamped)
    "softplus-overflow-limited": dict(shape=(2, 4, 3), dt_scale=1e4, x_scale=1e-4, dt_limit=True, **_SMALL),
    "no-softplus": dict(shape=(2, 4, 2), softplus=False, bias=False, **_SMALL),
    "A-zero": dict(shape=(2, 4, 3), a="zero", **_SMALL),
    "A-steep": dict(shape=(2, 4, 3), a="steep", **_SMALL),
    "zero-inputs": dict(shape=(2, 4, 2), inputs="zero", **_SMALL),
    "outliers": dict(shape=(2, 4, 2), inputs="outliers", z=True, **_SMALL),
    "no-D-no-bias": dict(shape=(2, 4, 2), skip=False, bias=False, **_SMALL),
}
UPDATE_CASES: dict[str, dict[str, Any]] = {
    **SHARED,
    "tokens-axis-T=1": dict(shape=(2, 4, 1), tokens_axis=True, **_SMALL),
    "verify-T=4": dict(shape=(3, 4, 4), pad=True, poison=True, z=True, **_SMALL),
    "split-dst": dict(shape=(3, 4, 1), split_dst=True, poison=True, **_SMALL),
}
SCAN_CASES: dict[str, dict[str, Any]] = {
    **SHARED,
    "long": dict(shape=(1, 2, 300), headdim=16, dstate=32),
    "varlen-chunks": dict(shape=(4, 3, 70), pad=True, poison=True, **_SMALL),
    "equal-lengths": dict(shape=(3, 4, 40), varlen=False, **_SMALL),
    "no-initial": dict(shape=(3, 4, 9), initial="none", poison=True, **_SMALL),
    "all-initial": dict(shape=(3, 4, 9), initial="all", **_SMALL),
    "flags-omitted": dict(shape=(3, 4, 9), initial="omitted", poison=True, **_SMALL),
    "no-pool": dict(shape=(3, 4, 9), state="none", **_SMALL),
    "empty": dict(shape=(3, 4, 0), poison=True, **_SMALL),
}
# The traps a calibration's check at each measured shape holds: a pad sequence and NaN in
# every slot the call must not read.
CHECK_OPTIONS: dict[str, Any] = dict(pad=True, poison=True)


def conformance(named: dict[str, dict[str, Any]]):
    def cases(caps: Capabilities) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from named.items()

    return cases


def sweeps(op: str) -> dict[str, Sweep]:
    """The scan's ``ssm-cpu``: mamba2-1.3b's widths (H=64 heads of 64, dstate 128), one sequence
    of 2..2048 tokens and two batches, where token-by-token and chunked cross over; the update's
    ``ssm-cpu-decode``: B in 1..64, one token, and a 4-token verify. ``ssm-smoke`` and
    ``ssm-decode-smoke``: a few small shapes. (One name per op: ``kv calibrate --sweep`` names one.)"""
    widths = {"headdim": 64, "dstate": 128}
    if op == UPDATE:
        return {
            "ssm-cpu-decode": Sweep("ssm-cpu-decode", op, (*((b, 64, 1) for b in (1, 4, 16, 64)), (4, 64, 4)), widths,
                                    description="mamba2-1.3b widths: decode B=1..64, and a 4-token verify"),
            "ssm-decode-smoke": Sweep("ssm-decode-smoke", op, ((1, 8, 1), (4, 8, 1)), {"headdim": 16, "dstate": 32},
                                      description="a few small shapes, seconds to calibrate"),
        }
    lengths = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    return {
        "ssm-cpu": Sweep("ssm-cpu", op, (*((1, 64, n) for n in lengths), (4, 64, 256), (16, 64, 64)), widths,
                         description="mamba2-1.3b widths: where token-by-token and chunked cross over"),
        "ssm-smoke": Sweep("ssm-smoke", op, ((1, 8, 16), (2, 8, 64)), {"headdim": 16, "dstate": 32},
                           description="a few small shapes, seconds to calibrate"),
    }
