"""Features, capabilities and validation of the gated delta rule ops (Qwen3-Next's GDN linear
attention), with the semantics of vLLM-CPU's GDN ops and fla's gated delta rule:
docs/contract.md, "Gated delta rule".

Notation: T packed tokens of B sequences, Hk heads of K channels for q and k, Hv heads of V
channels for v (v head h reads q/k head ``h // (Hv // Hk)``), a state pool ``[N, Hv, K, V]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from kernel_variants._dtypes import dtype_name
from kernel_variants._registry.keys import CallKey, Features, KeyParts
from kernel_variants._runtime.values import Offsets, SlotIds, plan
from kernel_variants._validate import shape_str, tensor
from kernel_variants.ops.ssm._spec import (
    NONCONTIG_STATES,
    PoolCapabilities,
    enough_slots,
    index,
    run,
    state_pool,
)

UPDATE, CHUNK = "gated_delta_rule_update", "chunk_gated_delta_rule"
StateKind = Literal["float32", "bfloat16", "none"]
_DATA = (torch.float32, torch.bfloat16, torch.float16)


class GdnFeatures(Features):
    """What besides (B, Hv, L) decides which variants can run a call and how fast: the widths
    (``k_dim`` K, ``v_dim`` V), how many v heads share a q/k head (``groups``), the pool's dtype
    ("none": a prefill without a pool), whether q and k are L2-normalised, and whether the
    softplus of the gating has a beta other than 1 (``softplus_beta``; decode only)."""

    k_dim: int = 128
    v_dim: int = 128
    groups: int = 2
    state: StateKind = "float32"
    l2norm: bool = True
    softplus_beta: bool = False


class GdnCapabilities(PoolCapabilities):
    """What a gated-delta-rule variant can run: besides the pool, L2 normalisation off as well as
    on (``l2norm_off``) and a softplus beta other than 1 (vLLM-CPU 0.32's decode kernel takes the
    argument and ignores it: its variant says so here)."""

    states: frozenset[StateKind] = frozenset({"float32", "bfloat16", "none"})
    l2norm_off: bool = True
    softplus_beta: bool = True

    def uncovered(self, key: CallKey) -> str | None:
        why = super().uncovered(key)
        if why is not None:
            return why
        f = key.features
        if not f.l2norm and not self.l2norm_off:
            return "q/k without L2 normalisation not supported"
        if f.softplus_beta and not self.softplus_beta:
            return "softplus_beta other than 1.0 not honoured"
        return None

    def summary(self) -> str:
        parts = [super().summary()]
        parts += [w for w, ok in (("l2norm only", self.l2norm_off), ("softplus beta 1 only", self.softplus_beta))
                  if not ok]
        return "; ".join(parts)


def _heads(name: str, t: object, total: int, what: str, dtypes=_DATA) -> torch.Tensor:
    """A [T, H, D] tensor of a float dtype."""
    tensor(name, t)
    assert isinstance(t, torch.Tensor)
    if t.ndim != 3 or t.shape[0] != total or min(t.shape[1:]) < 1:
        raise ValueError(f"{name}: expected shape [T={total}, {what}], got {shape_str(t)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {dtype_name(t.dtype)}")
    return t


def _qkv(q: object, k: object, v: object) -> tuple[torch.Tensor, int, int, int, int]:
    """q, k [T, Hk, K] and v [T, Hv, V]; returns (v, Hk, K, Hv, V)."""
    tensor("v", v)
    assert isinstance(v, torch.Tensor)
    if v.ndim != 3:
        raise ValueError(f"v: expected shape [T, Hv, V], got {shape_str(v)}")
    total = v.shape[0]
    v = _heads("v", v, total, "Hv, V")
    q = _heads("q", q, total, "Hk, K")
    if q.dtype != v.dtype:
        raise TypeError(f"q: expected dtype {dtype_name(v.dtype)} (v's), got {dtype_name(q.dtype)}")
    _heads("k", k, total, "Hk, K")
    assert isinstance(k, torch.Tensor)
    if k.shape != q.shape or k.dtype != q.dtype:
        raise ValueError(f"k: expected q's shape {shape_str(q)} and dtype, got {shape_str(k)} {dtype_name(k.dtype)}")
    hk, kd = q.shape[1:]
    hv, vd = v.shape[1:]
    if hv % hk:
        raise ValueError(f"v: expected Hv a multiple of Hk={hk} (q's heads), got Hv={hv}")
    for name, t in (("q", q), ("k", k)):
        if t.device != v.device:
            raise ValueError(f"{name}: expected device {v.device} (v's), got {t.device}")
    return v, hk, kd, hv, vd


def _per_token(name: str, t: object, v: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """[T, Hv] on v's device, of one of ``dtypes``."""
    tensor(name, t)
    assert isinstance(t, torch.Tensor)
    want = (v.shape[0], v.shape[1])
    if tuple(t.shape) != want:
        raise ValueError(f"{name}: expected shape [T={want[0]}, Hv={want[1]}], got {shape_str(t)}")
    if t.dtype not in dtypes:
        names = " or ".join(dict.fromkeys(dtype_name(d) for d in dtypes))
        raise TypeError(f"{name}: expected dtype {names}, got {dtype_name(t.dtype)}")
    if t.device != v.device:
        raise ValueError(f"{name}: expected device {v.device} (v's), got {t.device}")


def _per_head(name: str, t: object, v: torch.Tensor) -> None:
    tensor(name, t)
    assert isinstance(t, torch.Tensor)
    if tuple(t.shape) != (v.shape[1],) or t.dtype != torch.float32 or t.device != v.device:
        raise ValueError(f"{name}: expected a float32 tensor of shape [Hv={v.shape[1]}] on {v.device}, "
                         f"got {dtype_name(t.dtype)} {shape_str(t)} on {t.device}")


def _flags(use_qk_l2norm: object, scale: object, pad_slot_id: object) -> None:
    if not isinstance(use_qk_l2norm, bool):
        raise TypeError(f"use_qk_l2norm: expected True or False, got {type(use_qk_l2norm).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale)):
        raise TypeError(f"scale: expected None or a finite float, got {scale!r}")
    if type(pad_slot_id) is not int:
        raise TypeError(f"pad_slot_id: expected int, got {type(pad_slot_id).__name__}")


def _batch(cu_seqlens: object, v: torch.Tensor, default: int) -> int:
    index("cu_seqlens", cu_seqlens, cu_seqlens.shape[0] if isinstance(cu_seqlens, torch.Tensor) else 0, v)
    if cu_seqlens is None:
        return default
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape [B+1] with B >= 1, got {shape_str(cu_seqlens)}")
    return cu_seqlens.shape[0] - 1


def _key(v: torch.Tensor, batch: int, hk: int, kd: int, hv: int, vd: int, pool: torch.Tensor | None, gaps: bool,
         l2norm: bool, beta: bool) -> KeyParts:
    state = "none" if pool is None else dtype_name(pool.dtype)
    features = GdnFeatures(k_dim=kd, v_dim=vd, groups=hv // hk, state=state, l2norm=l2norm, softplus_beta=beta)
    length = max(1, -(-v.shape[0] // batch))
    return v.device.type, dtype_name(v.dtype), features, (batch, hv, length), (
        frozenset({NONCONTIG_STATES}) if gaps else frozenset())


def _pool(name: str, pool: object, v: torch.Tensor, hv: int, kd: int, vd: int) -> tuple[torch.Tensor, bool]:
    pool, gaps = state_pool(name, pool, v, (hv, kd, vd), "[N, Hv={}, K={}, V={}]", (torch.float32, torch.bfloat16))
    return pool, gaps


def check_update(q, k, v, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, use_qk_l2norm, scale,
                 softplus_beta, softplus_threshold, pad_slot_id, *, values: bool) -> KeyParts:
    """Validate a ``gated_delta_rule_update`` call; return its key parts (B, Hv, L)."""
    v, hk, kd, hv, vd = _qkv(q, k, v)
    if v.shape[0] < 1:
        raise ValueError(f"v: expected T >= 1 tokens, got {shape_str(v)}")
    _per_token("a", a, v, (v.dtype, torch.float32))
    _per_token("b", b, v, (v.dtype, torch.float32))
    _per_head("A_log", A_log, v)
    _per_head("dt_bias", dt_bias, v)
    pool, gaps = _pool("state", state, v, hv, kd, vd)
    batch = _batch(cu_seqlens, v, v.shape[0])
    _flags(use_qk_l2norm, scale, pad_slot_id)
    for name, x in (("softplus_beta", softplus_beta), ("softplus_threshold", softplus_threshold)):
        if isinstance(x, bool) or not isinstance(x, int | float) or not x > 0 or not math.isfinite(x):
            raise ValueError(f"{name}: expected a positive finite float, got {x!r}")
    index("state_indices", state_indices, batch, v)
    enough_slots("state_indices", state_indices, batch, pool, "state")
    if values:
        args = (q, k, v, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, use_qk_l2norm, scale, softplus_beta,
                softplus_threshold, pad_slot_id)
        run(update_value_checks(*args), args)
    return _key(v, batch, hk, kd, hv, vd, pool, gaps, use_qk_l2norm, softplus_beta != 1.0)


def check_chunk(q, k, v, g, beta, cu_seqlens, ssm_states, state_indices, has_initial_state, use_qk_l2norm, scale,
                pad_slot_id, *, values: bool) -> KeyParts:
    """Validate a ``chunk_gated_delta_rule`` call; return its key parts (B, Hv, L)."""
    v, hk, kd, hv, vd = _qkv(q, k, v)
    _per_token("g", g, v, (torch.float32,))
    _per_token("beta", beta, v, (torch.float32, v.dtype))
    batch = _batch(cu_seqlens, v, 1)
    _flags(use_qk_l2norm, scale, pad_slot_id)
    pool, gaps = None, False
    if ssm_states is not None:
        pool, gaps = _pool("ssm_states", ssm_states, v, hv, kd, vd)
        enough_slots("state_indices", state_indices, batch, pool, "ssm_states")
    else:
        for name, x in (("state_indices", state_indices), ("has_initial_state", has_initial_state)):
            if x is not None:
                raise ValueError(f"{name}: expected None without ssm_states, got a tensor")
    index("state_indices", state_indices, batch, v)
    index("has_initial_state", has_initial_state, batch, v, dtypes=(torch.bool,), what="bool")
    if values:
        args = (q, k, v, g, beta, cu_seqlens, ssm_states, state_indices, has_initial_state, use_qk_l2norm, scale,
                pad_slot_id)
        run(chunk_value_checks(*args), args)
    return _key(v, batch, hk, kd, hv, vd, pool, gaps, use_qk_l2norm, False)


def update_value_checks(q, k, v, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, use_qk_l2norm, scale,
                        softplus_beta, softplus_threshold, pad_slot_id) -> Callable[[Sequence[Any]], None] | None:
    checks: list[Any] = []
    batch = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is not None:
        checks.append(Offsets(9, "cu_seqlens", v.shape[0], f"T={v.shape[0]} (v.shape[0])"))
    if state_indices is not None:
        checks.append(SlotIds(8, "state_indices", state.shape[0], pad_slot_id, batch))
    return plan(v, checks)


def chunk_value_checks(q, k, v, g, beta, cu_seqlens, ssm_states, state_indices, has_initial_state, use_qk_l2norm,
                       scale, pad_slot_id) -> Callable[[Sequence[Any]], None] | None:
    checks: list[Any] = []
    if cu_seqlens is not None:
        checks.append(Offsets(5, "cu_seqlens", v.shape[0], f"T={v.shape[0]} (v.shape[0])"))
    if ssm_states is not None and state_indices is not None:
        checks.append(SlotIds(7, "state_indices", ssm_states.shape[0], pad_slot_id, state_indices.shape[0]))
    return plan(v, checks)
