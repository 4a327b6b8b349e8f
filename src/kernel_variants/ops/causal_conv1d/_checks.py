"""Input validation for the conv ops: every malformed call fails here, before any kernel runs.

Checks come in two kinds. Metadata checks (ndim, sizes, dtypes, devices) are pure Python on
shapes. Value checks read the index tensors (slot ranges, duplicates, query_start_loc order,
num_accepted_tokens range) on the host: free on the CPU, where they always run, but a device
sync on an accelerator. There, by default, the device rule (:func:`device_fn_rule`,
:func:`device_update_rule`) runs instead: it makes every bad value harmless with device ops
and counts it for ``kv.check_errors()``, without a sync. ``KV_CHECK_VALUES=1`` runs the host
checks everywhere (debugging); ``KV_CHECK_VALUES=0`` runs neither off the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernel_variants._dtypes import dtype_name
from kernel_variants._registry.keys import Features, KeyParts
from kernel_variants._runtime import call as _call
from kernel_variants._runtime import device_errors
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.values import Bounded, Offsets, SlotIds, plan
from kernel_variants._validate import floating, like_x, shape_str, tensor
from kernel_variants.ops.causal_conv1d import _device_rule

_INDEX_DTYPES = (torch.int32, torch.int64)
NONCONTIG_STATES = "noncontig_states"  # a CallKey extra: the state pool is a strided view
_NONCONTIG = frozenset({NONCONTIG_STATES})
_NONE: frozenset[str] = frozenset()


def _index(name: str, t: torch.Tensor | None, length: int, x: torch.Tensor) -> None:
    if t is None:
        return
    tensor(name, t)
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {dtype_name(t.dtype)}")
    if t.ndim != 1 or t.shape[0] != length:
        raise ValueError(f"{name}: expected shape [{length}], got {shape_str(t)}")
    if t.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (x's), got {t.device}")


def _pad_slot_id(pad_slot_id: object) -> None:
    if type(pad_slot_id) is not int:  # bool is an int subclass, and 1.0 == 1 would hit the memo
        raise TypeError(f"pad_slot_id: expected int, got {type(pad_slot_id).__name__}")


def activation_name(activation: object) -> str:
    """The one reading of a conv activation, as a feature value: None -> "none", "silu" or its
    other name "swish" -> "silu"; anything else is a ValueError naming the argument."""
    if activation is None:
        return "none"
    if activation in ("silu", "swish"):
        return "silu"
    raise ValueError(f'activation: expected None, "silu" or "swish", got {activation!r}')


def _weight_bias(x: torch.Tensor, weight: object, bias: object, dim: int) -> int:
    tensor("weight", weight)
    assert isinstance(weight, torch.Tensor)
    if weight.ndim != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight: expected shape [D={dim}, W], got {shape_str(weight)}")
    width = weight.shape[1]
    if width < 1:
        raise ValueError(f"weight: expected width W >= 1, got W={width}")
    like_x("weight", weight, x)
    tensor("bias", bias, optional=True)
    if bias is not None:
        assert isinstance(bias, torch.Tensor)
        if bias.ndim != 1 or bias.shape[0] != dim:
            raise ValueError(f"bias: expected shape [D={dim}], got {shape_str(bias)}")
        like_x("bias", bias, x)
    return width


def _state_pool(name: str, pool: torch.Tensor, x: torch.Tensor, dim: int, min_rows: int, why: str) -> None:
    if pool.ndim != 3 or pool.shape[2] != dim:
        raise ValueError(f"{name}: expected shape [N, S, D={dim}], got {shape_str(pool)}")
    like_x(name, pool, x)
    if pool.shape[1] < min_rows:
        raise ValueError(f"{name}: expected S >= {min_rows} rows ({why}), got S={pool.shape[1]}")


def _enough_slots(name: str, idx: object, batch: int, pool: torch.Tensor, pool_name: str) -> None:
    """Without indices sequence b uses slot b: a shape fact, checked with the metadata."""
    if idx is None and batch > pool.shape[0]:
        raise ValueError(f"{pool_name}: expected at least B={batch} slots when {name} is None, got N={pool.shape[0]}")


def _run(checks: Callable[[Sequence[Any]], None] | None, args: Sequence[Any]) -> None:
    if checks is not None:
        checks(args)


def fn_value_checks(x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc, activation,
                    pad_slot_id) -> Callable[[Sequence[Any]], None] | None:
    """The value checks of ``causal_conv1d_fn`` calls with this call's metadata (which passed)."""
    checks: list[Callable[[Sequence[Any]], None]] = []
    if query_start_loc is not None:
        checks.append(Offsets(6, "query_start_loc", x.shape[0], f"T={x.shape[0]} (x.shape[0])"))
    if conv_states is not None and cache_indices is not None:
        checks.append(SlotIds(4, "cache_indices", conv_states.shape[0], pad_slot_id, cache_indices.shape[0]))
    return plan(x, checks)


def update_value_checks(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                        pad_slot_id) -> Callable[[Sequence[Any]], None] | None:
    """The value checks of ``causal_conv1d_update`` calls with this call's metadata (which passed)."""
    checks: list[Callable[[Sequence[Any]], None]] = []
    if conv_state_indices is not None:
        checks.append(SlotIds(5, "conv_state_indices", conv_state.shape[0], pad_slot_id, conv_state_indices.shape[0]))
    if num_accepted_tokens is not None:
        checks.append(Bounded(6, "num_accepted_tokens", 1, x.shape[1] if x.ndim == 3 else 1, "L"))
    return plan(x, checks)


def check_fn(features: type[Features], x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc,
             activation, pad_slot_id, *, values: bool) -> KeyParts:
    """Validate a ``causal_conv1d_fn`` call; return its key."""
    x = floating(x)
    varlen = query_start_loc is not None
    if varlen:
        if x.ndim != 2:
            raise ValueError(f"x: expected shape [T, D] when query_start_loc is given, got {shape_str(x)}")
        total, dim = x.shape
        tensor("query_start_loc", query_start_loc)
        if query_start_loc.dtype not in _INDEX_DTYPES:
            raise TypeError(
                f"query_start_loc: expected dtype int32 or int64, got {dtype_name(query_start_loc.dtype)}"
            )
        if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 2:
            raise ValueError(f"query_start_loc: expected shape [B+1] with B >= 1, got {shape_str(query_start_loc)}")
        if query_start_loc.device != x.device:
            raise ValueError(f"query_start_loc: expected device {x.device} (x's), got {query_start_loc.device}")
        batch = query_start_loc.shape[0] - 1
        seqlen = max(1, -(-total // batch))
    else:
        if x.ndim != 3:
            raise ValueError(f"x: expected shape [B, L, D] (or [T, D] with query_start_loc), got {shape_str(x)}")
        batch, seqlen, dim = x.shape
        if batch < 1 or seqlen < 1:
            raise ValueError(f"x: expected B >= 1 and L >= 1, got {shape_str(x)}")
    width = _weight_bias(x, weight, bias, dim)
    act = activation_name(activation)
    _pad_slot_id(pad_slot_id)
    tensor("conv_states", conv_states, optional=True)
    if conv_states is None:
        for name, t in (("cache_indices", cache_indices), ("has_initial_state", has_initial_state)):
            if t is not None:
                raise ValueError(f"{name}: expected None when conv_states is None, got a tensor")
    else:
        _state_pool("conv_states", conv_states, x, dim, width - 1, f"W-1 history rows for W={width}")
        _enough_slots("cache_indices", cache_indices, batch, conv_states, "conv_states")
    _index("cache_indices", cache_indices, batch, x)
    if has_initial_state is not None:
        tensor("has_initial_state", has_initial_state)
        if has_initial_state.dtype != torch.bool:
            raise TypeError(f"has_initial_state: expected dtype bool, got {dtype_name(has_initial_state.dtype)}")
        if has_initial_state.ndim != 1 or has_initial_state.shape[0] != batch:
            raise ValueError(f"has_initial_state: expected shape [{batch}], got {shape_str(has_initial_state)}")
        if has_initial_state.device != x.device:
            raise ValueError(f"has_initial_state: expected device {x.device} (x's), got {has_initial_state.device}")
    if values:
        args = (x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc, activation,
                pad_slot_id)
        _run(fn_value_checks(*args), args)
    noncontig = conv_states is not None and not conv_states.is_contiguous()
    flags = features(width=width, bias=bias is not None, activation=act, states=conv_states is not None,
                     varlen=varlen, spec=False)
    return x.device.type, dtype_name(x.dtype), flags, (batch, dim, seqlen), _NONCONTIG if noncontig else _NONE


def check_update(features: type[Features], x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                 pad_slot_id, *, values: bool) -> KeyParts:
    """Validate a ``causal_conv1d_update`` call; return its key."""
    x = floating(x)
    if x.ndim == 2:
        batch, dim = x.shape
        seqlen = 1
    elif x.ndim == 3:
        batch, seqlen, dim = x.shape
    else:
        raise ValueError(f"x: expected shape [B, D] or [B, L, D], got {shape_str(x)}")
    if batch < 1 or seqlen < 1:
        raise ValueError(f"x: expected B >= 1 and L >= 1, got {shape_str(x)}")
    width = _weight_bias(x, weight, bias, dim)
    act = activation_name(activation)
    _pad_slot_id(pad_slot_id)
    tensor("conv_state", conv_state)
    spec_call = num_accepted_tokens is not None
    if spec_call:
        _state_pool("conv_state", conv_state, x, dim, width - 1 + seqlen - 1,
                    f"W-1+L-1 rows for speculative decoding with W={width}, L={seqlen}")
    else:
        _state_pool("conv_state", conv_state, x, dim, width - 1, f"W-1 history rows for W={width}")
    _enough_slots("conv_state_indices", conv_state_indices, batch, conv_state, "conv_state")
    _index("conv_state_indices", conv_state_indices, batch, x)
    _index("num_accepted_tokens", num_accepted_tokens, batch, x)
    if values:
        args = (x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens, pad_slot_id)
        _run(update_value_checks(*args), args)
    flags = features(width=width, bias=bias is not None, activation=act, states=True, varlen=False, spec=spec_call)
    return x.device.type, dtype_name(x.dtype), flags, (batch, dim, seqlen), (
        _NONE if conv_state.is_contiguous() else _NONCONTIG)


# ------------------------------------------------------------------------------------------
# The device rule: what runs instead of the value checks off the CPU, without a host sync
# ------------------------------------------------------------------------------------------


def device_fn_rule(capabilities, x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc,
                   activation, pad_slot_id) -> Callable[[Sequence[Any]], tuple] | None:
    """The device rule of ``causal_conv1d_fn`` calls with this call's metadata, for the chosen
    variant (``capabilities``): ``rule(args) -> args`` (signature order, device tensors), or None
    when such calls have nothing to check (no ``query_start_loc``, no ``cache_indices``).

    - ``cache_indices`` ``[B]``: a slot outside ``[0, N)`` that is not ``pad_slot_id`` makes its
      sequence a pad (zero output rows, no state read or written). Rewritten, unless the
      chosen variant declares ``slot_bounds_safe`` (its kernel does the same).
    - ``query_start_loc`` ``[B+1]``: repaired to ``0 = start <= ... <= end = T`` (values clamped
      to ``[0, T]``, the ends set, then a running maximum), so that no kernel reads outside x;
      a sequence whose bounds changed is a pad when there is a state pool (without one there is
      no state to protect: its rows are computed over the repaired bounds).
    - live slots used twice are counted, not repaired (the memory touched stays inside the pool;
      the duplicated slot ends with one of the writes).
    Each kind is counted on the device for :func:`kernel_variants.check_errors`. No host read;
    one device op per call (``kernel_variants::conv_device_rule``).
    """
    if query_start_loc is None and cache_indices is None:  # cache_indices needs conv_states
        return None
    apply, device, safe = _device_rule.apply, x.device, capabilities.slot_bounds_safe
    batch = cache_indices.shape[0] if query_start_loc is None else query_start_loc.shape[0] - 1
    sizes = dict(batch=batch, n_slots=conv_states.shape[0] if conv_states is not None else 0,
                 total=x.shape[0] if query_start_loc is not None else 0, rewrite=not safe)
    if query_start_loc is None and safe:
        def count(args: Sequence[Any]) -> tuple:  # the variant masks bad slots itself
            apply(device, args[4], None, None, args[8], **sizes)
            return tuple(args)
        return count
    varlen, states = query_start_loc is not None, conv_states is not None

    def rule(args: Sequence[Any]) -> tuple:
        idx, _, qsl, fixed_pad = apply(device, args[4], None, args[6], args[8], **sizes)
        out = list(args)
        if varlen:
            out[6] = qsl
        if states:
            out[4], out[8] = idx, fixed_pad
        return tuple(out)
    return rule


def bad_value_counter(x: torch.Tensor) -> torch.Tensor | None:
    """For a decode kernel declaring ``counts_bad_values``: the counter it adds what it meets to
    (``int64 [4]``, one entry per kind of ``device_errors.KINDS``: a slot outside ``[0, N)``
    that is not ``pad_slot_id``; a live slot one more time than once; a ``num_accepted_tokens``
    outside ``1..L``), or None when it must count nothing: the values of a call on ``x``'s device
    are checked on the host (the CPU, ``KV_CHECK_VALUES=1``) or not at all
    (``KV_CHECK_VALUES=0``), or a graph is captured before any eager call made the counter."""
    if _call.host_values(x) or not dispatcher().device_values:
        return None
    return device_errors.counter(x.device)


def device_update_rule(capabilities, x, conv_state, weight, bias, activation, conv_state_indices,
                       num_accepted_tokens, pad_slot_id) -> Callable[[Sequence[Any]], tuple] | None:
    """The device rule of ``causal_conv1d_update`` calls with this call's metadata, for the
    chosen variant (``capabilities``): ``rule(args) -> args`` (signature order, device tensors),
    or None when such calls need none: nothing to check, or the variant declares
    ``counts_bad_values`` (its kernel counts into :func:`bad_value_counter` and masks).

    - ``conv_state_indices`` ``[B]``: a slot outside ``[0, N)`` that is not ``pad_slot_id``
      makes its sequence a pad (zero output, no state read or written).
    - ``num_accepted_tokens`` ``[B]``: a count outside ``1..L`` makes its sequence a pad too
      (any other count would address rows outside the slot), and is handed to the variant as 1.
    - live slots used twice are counted, not repaired (see :func:`device_fn_rule`).
    Rewritten unless the chosen variant declares ``slot_bounds_safe``; counted on the device for
    :func:`kernel_variants.check_errors` in every case. No host read; one device op per call
    (``kernel_variants::conv_device_rule``).
    """
    if (conv_state_indices is None and num_accepted_tokens is None) or capabilities.counts_bad_values:
        return None
    apply, device, safe = _device_rule.apply, x.device, capabilities.slot_bounds_safe
    sizes = dict(batch=x.shape[0], n_slots=conv_state.shape[0], length=x.shape[1] if x.ndim == 3 else 1,
                 rewrite=not safe)
    if safe:
        def count(args: Sequence[Any]) -> tuple:  # the variant masks bad values itself
            apply(device, args[5], args[6], None, args[7], **sizes)
            return tuple(args)
        return count
    accepted = num_accepted_tokens is not None

    def rule(args: Sequence[Any]) -> tuple:
        idx, fixed_accepted, _, fixed_pad = apply(device, args[5], args[6], None, args[7], **sizes)
        out = list(args)
        if accepted:
            out[6] = fixed_accepted
        out[5], out[7] = idx, fixed_pad
        return tuple(out)
    return rule
