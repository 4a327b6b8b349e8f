"""Realistic calls of the gated delta rule ops, their edge cases and named sweeps.

Values as a Qwen3-Next GDN layer makes them: q, k, v, a and b from projections (unit normal),
``A_log = log(U(1, 16))``, ``dt_bias`` the inverse softplus of a step in [1e-3, 0.1]; for the
prefill op ``g`` and ``beta`` from :func:`gdn_gating`. With ``poison`` every slot a call must not
read holds NaN and the pad sequence's tokens are NaN too (see the selective-scan cases).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from kernel_variants._dtypes import as_dtype
from kernel_variants._registry.case import Case, Sweep
from kernel_variants._registry.models import Capabilities
from kernel_variants.ops.gdn._reference import gdn_gating
from kernel_variants.ops.gdn._spec import UPDATE
from kernel_variants.ops.ssm._cases import lengths_of

SPECS: dict[str, Any] = {}  # filled in by the package once its specs exist


def make_case(op: str, shape: tuple[int, ...], *, dtype: torch.dtype | str = torch.bfloat16,
              device: str | torch.device = "cpu", seed: int = 0, k_dim: int = 128, v_dim: int = 128, groups: int = 2,
              state: str = "float32", l2norm: bool = True, softplus_beta: bool = False, varlen: bool = True,
              pad: bool = False, poison: bool = False, noncontig: bool = False, strided: bool = False,
              index_dtype: torch.dtype = torch.int32, slot_indices: bool = True, initial: str = "some",
              pad_slot_id: int = -1, decay: str = "normal", write: str = "normal", inputs: str = "normal",
              packed: bool = False) -> Case:
    """A call of ``op`` on (B, Hv, L).

    ``softplus_beta``: the gating's softplus at beta 2 (decode). ``strided``: q, k and v views of
    one mixed projection [T, 2*Hk*K + Hv*V], as vLLM splits it. ``decay``: "normal", "none"
    (g = 0) or "total" (g = -inf: the state forgets everything). ``write``: "normal", "zero"
    (beta = 0: nothing written) or "full" (beta = 1). ``inputs``: "normal", "zero-qk" (some
    tokens' q and k all zero, under L2 normalisation too) or "outliers" (+-30 entries).
    ``packed``: a decode call with cu_seqlens even at one token per sequence. The rest as the
    selective-scan cases (``kernel_variants.ops.ssm._cases.make_case``)."""
    dtype, sdtype = as_dtype(dtype), as_dtype(state) if state != "none" else None
    gen = torch.Generator().manual_seed(seed)
    batch, hv, length = shape
    hk = max(1, hv // groups)
    lengths = [length] * batch if op == UPDATE else lengths_of(gen, batch, length, varlen)
    total = sum(lengths)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(size, generator=gen) * scale

    mixed = randn(total, 2 * hk * k_dim + hv * v_dim)
    if inputs == "outliers":
        mixed.view(-1)[:: max(1, mixed.numel() // 9)] = 30.0
    if strided:  # views of one projection, as vLLM's split of mixed_qkv hands them over
        base = mixed.to(dtype)
        q = base[:, : hk * k_dim].unflatten(1, (hk, k_dim))
        k = base[:, hk * k_dim: 2 * hk * k_dim].unflatten(1, (hk, k_dim))
        v = base[:, 2 * hk * k_dim:].unflatten(1, (hv, v_dim))
    else:
        q, k, v = (t.to(dtype).contiguous() for t in mixed.split([hk * k_dim, hk * k_dim, hv * v_dim], 1))
        q, k, v = q.view(total, hk, k_dim), k.view(total, hk, k_dim), v.view(total, hv, v_dim)
    if not l2norm:  # unnormalised keys must be short for the delta rule to stay stable (|k| <~ 1)
        q, k = q * k_dim ** -0.5, k * k_dim ** -0.5
    if inputs == "zero-qk" and total:
        q[:: 2].zero_()
        k[1:: 3].zero_()
    a, b = randn(total, hv).to(dtype), randn(total, hv).to(dtype)
    if write == "zero":
        b.fill_(-1e4)
    elif write == "full":
        b.fill_(1e4)
    A_log = torch.log(1 + 15 * torch.rand(hv, generator=gen))
    step = 1e-3 + torch.rand(hv, generator=gen) * (0.1 - 1e-3)
    dt_bias = torch.log(torch.expm1(step))

    n_slots = batch + 3
    perm = torch.randperm(n_slots, generator=gen).tolist()
    if 0 <= pad_slot_id < n_slots:
        perm.remove(pad_slot_id)
    slots = perm[:batch] if slot_indices else list(range(batch))
    pad_at = batch // 2 if pad else None
    if pad_at is not None:
        slots[pad_at] = pad_slot_id
    flags = [True] * batch if op == UPDATE else {
        "some": [b_ % 2 == 1 for b_ in range(batch)], "none": [False] * batch, "all": [True] * batch,
        "omitted": [False] * batch}[initial]
    pool = base_pool = None
    if sdtype is not None:
        size = (2 * n_slots + 1 if noncontig else n_slots, hv, k_dim, v_dim)
        base_pool = (randn(*size, scale=0.3)).to(sdtype)
        pool = base_pool[1::2] if noncontig else base_pool
        if poison:
            read = {s for s, f in zip(slots, flags, strict=True) if f and s != pad_slot_id}
            for s in range(pool.shape[0]):
                if s not in read:
                    pool[s] = float("nan")
    if poison and pad_at is not None:
        lo = sum(lengths[:pad_at])
        v[lo: lo + lengths[pad_at]] = float("nan")
    idx = torch.tensor(slots, dtype=index_dtype) if slot_indices else None
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=index_dtype)
    q, k, v, a, b, A_log, dt_bias = (t.to(device) for t in (q, k, v, a, b, A_log, dt_bias))
    idx, cu = (None if t is None else t.to(device) for t in (idx, cu))
    if base_pool is not None:
        base_pool = base_pool.to(device)
        pool = base_pool.as_strided(pool.shape, pool.stride(), pool.storage_offset())
    if op == UPDATE:
        kwargs: dict[str, Any] = dict(use_qk_l2norm=l2norm, softplus_beta=2.0 if softplus_beta else 1.0,
                                      pad_slot_id=pad_slot_id)
        args = (q, k, v, a, b, A_log, dt_bias, pool, idx, cu if length > 1 or packed else None)
        return Case(SPECS[op], args, kwargs, {"state": base_pool})
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    if decay == "none":
        g.zero_()
    elif decay == "total":
        g.fill_(-math.inf)
    kwargs = dict(ssm_states=pool, use_qk_l2norm=l2norm, pad_slot_id=pad_slot_id)
    if pool is not None:
        kwargs["state_indices"] = idx
        if initial != "omitted":
            kwargs["has_initial_state"] = torch.tensor(flags, dtype=torch.bool, device=device)
    return Case(SPECS[op], (q, k, v, g, beta, cu), kwargs, {"ssm_states": base_pool} if base_pool is not None else {})


def spec_case(op: str):
    def case(shape: tuple[int, ...], **options: Any) -> Case:
        return make_case(op, shape, **options)

    return case


_SMALL = dict(k_dim=8, v_dim=16)
SHARED: dict[str, dict[str, Any]] = {
    "plain": dict(shape=(3, 4, 1), **_SMALL),
    "qwen3-next-width": dict(shape=(2, 4, 2), k_dim=128, v_dim=128),
    "no-groups": dict(shape=(2, 3, 2), groups=1, **_SMALL),
    "four-groups": dict(shape=(2, 8, 2), groups=4, **_SMALL),
    "odd-widths": dict(shape=(2, 2, 3), k_dim=5, v_dim=7, groups=1),
    "no-l2norm": dict(shape=(2, 4, 2), l2norm=False, **_SMALL),
    "pad": dict(shape=(4, 4, 2), pad=True, poison=True, **_SMALL),
    "pad-in-range": dict(shape=(4, 4, 2), pad=True, pad_slot_id=0, poison=True, **_SMALL),
    "pad-past-pool": dict(shape=(3, 4, 2), pad=True, pad_slot_id=1 << 20, poison=True, **_SMALL),
    "B=1-pad": dict(shape=(1, 4, 2), pad=True, poison=True, **_SMALL),
    "noncontig-pool": dict(shape=(3, 4, 2), noncontig=True, poison=True, **_SMALL),
    "strided-qkv": dict(shape=(3, 4, 2), strided=True, **_SMALL),
    "int64-indices": dict(shape=(3, 4, 2), index_dtype=torch.int64, pad=True, poison=True, **_SMALL),
    "slot-b": dict(shape=(3, 4, 2), slot_indices=False, **_SMALL),
    "bf16-state": dict(shape=(3, 4, 2), state="bfloat16", **_SMALL),
    "zero-qk": dict(shape=(2, 4, 3), inputs="zero-qk", **_SMALL),
    "zero-qk-no-l2norm": dict(shape=(2, 4, 3), inputs="zero-qk", l2norm=False, **_SMALL),
    "outliers": dict(shape=(2, 4, 3), inputs="outliers", **_SMALL),
    "beta-0": dict(shape=(2, 4, 3), write="zero", **_SMALL),
    "beta-1": dict(shape=(2, 4, 3), write="full", **_SMALL),
    # Qwen3-Next's widths with a bf16 pool (vLLM-CPU's pool dtype; its kernels' only one).
    "wide-bf16-state": dict(shape=(3, 4, 2), k_dim=128, v_dim=128, state="bfloat16", pad=True, poison=True),
    "wide-bf16-noncontig": dict(shape=(3, 4, 2), k_dim=128, v_dim=128, state="bfloat16", noncontig=True,
                                poison=True),
}
UPDATE_CASES: dict[str, dict[str, Any]] = {
    **SHARED,
    "packed-one-token": dict(shape=(3, 4, 1), packed=True, **_SMALL),
    "verify-T=4": dict(shape=(3, 4, 4), pad=True, poison=True, **_SMALL),
    "softplus-beta-2": dict(shape=(3, 4, 2), softplus_beta=True, **_SMALL),
}
CHUNK_CASES: dict[str, dict[str, Any]] = {
    **SHARED,
    "long": dict(shape=(1, 2, 200), k_dim=16, v_dim=16, groups=1),
    "varlen": dict(shape=(4, 4, 40), pad=True, poison=True, **_SMALL),
    "no-initial": dict(shape=(3, 4, 9), initial="none", poison=True, **_SMALL),
    "flags-omitted": dict(shape=(3, 4, 9), initial="omitted", poison=True, **_SMALL),
    "no-pool": dict(shape=(3, 4, 9), state="none", **_SMALL),
    "no-decay": dict(shape=(2, 4, 9), decay="none", **_SMALL),
    "total-decay": dict(shape=(2, 4, 9), decay="total", **_SMALL),
    "empty": dict(shape=(3, 4, 0), poison=True, **_SMALL),
    "wide-bf16-varlen": dict(shape=(4, 4, 9), k_dim=128, v_dim=128, state="bfloat16", pad=True, poison=True),
    "wide-no-initial": dict(shape=(3, 4, 5), k_dim=128, v_dim=128, state="bfloat16", initial="none", poison=True),
    "wide-no-pool": dict(shape=(2, 4, 5), k_dim=128, v_dim=128, state="none"),
    "wide-empty": dict(shape=(3, 4, 0), k_dim=128, v_dim=128, state="bfloat16", poison=True),
}
CHECK_OPTIONS: dict[str, Any] = dict(pad=True, poison=True)


def conformance(named: dict[str, dict[str, Any]]):
    def cases(caps: Capabilities) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from named.items()

    return cases


def sweeps(op: str) -> dict[str, Sweep]:
    """Qwen3-Next's widths (Hk 16, Hv 32, K = V = 128): ``gdn-cpu-decode`` (B in 1..64, one
    token; a 4-token verify) for the update, ``gdn-cpu`` (one sequence of 2..2048 tokens, and
    batches) for the prefill; ``-smoke`` ones of small shapes."""
    widths = {"k_dim": 128, "v_dim": 128, "groups": 2}
    small = {"k_dim": 16, "v_dim": 16, "groups": 2}
    if op == UPDATE:
        return {
            "gdn-cpu-decode": Sweep("gdn-cpu-decode", op, (*((b, 32, 1) for b in (1, 4, 16, 64)), (4, 32, 4)), widths,
                                    description="Qwen3-Next widths: decode B=1..64, and a 4-token verify"),
            "gdn-decode-smoke": Sweep("gdn-decode-smoke", op, ((1, 4, 1), (4, 4, 1)), small,
                                      description="a few small shapes, seconds to calibrate"),
        }
    lengths = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    return {
        "gdn-cpu": Sweep("gdn-cpu", op, (*((1, 32, n) for n in lengths), (4, 32, 256)), widths,
                         description="Qwen3-Next widths: where recurrent and chunked cross over"),
        "gdn-smoke": Sweep("gdn-smoke", op, ((1, 4, 16), (2, 4, 64)), small,
                           description="a few small shapes, seconds to calibrate"),
    }
