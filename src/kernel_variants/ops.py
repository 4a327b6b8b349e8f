"""The public ops. Each call is validated, then runs the variant chosen for its key."""

from __future__ import annotations

import torch

from kernel_variants._checks import (
    CallKey,
    check_fn,
    check_fn_values,
    check_update,
    check_update_values,
)
from kernel_variants.dispatch._dispatcher import VariantFailed, dispatcher, pins_in_context
from kernel_variants.dispatch._select import Decision


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_states: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    activation: str | None = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Depthwise causal 1-D convolution over whole sequences (prefill), channel-last.

    Args:
        x: ``[B, L, D]``, or ``[T, D]`` with ``query_start_loc`` for packed variable lengths.
        weight: ``[D, W]``. bias: ``[D]`` or None.
        conv_states: ``[N, S, D]`` cache pool, S >= W-1, or None. The last W-1 rows of a slot are
            the history (oldest first); after the call they hold the last W-1 rows of history ++
            sequence. Updated in place, also when it is a non-contiguous view.
        cache_indices: ``[B]`` int32/int64 slot per sequence (None: slot b). A slot equal to
            ``pad_slot_id`` skips the sequence: zero output, no state read or written.
        has_initial_state: ``[B]`` bool, whether the slot's history is used (None: all False).
        query_start_loc: ``[B+1]`` int32/int64, 0 = start <= ... <= end = T.
        activation: None, ``"silu"`` or ``"swish"``.

    Returns:
        A tensor of x's shape and dtype; accumulation is in fp32.
    """
    if torch.compiler.is_compiling():  # traced: one custom op, which dispatches when the graph runs
        from kernel_variants import _custom_ops

        return _custom_ops.causal_conv1d_fn(x, weight, bias, conv_states=conv_states, cache_indices=cache_indices,
                                            has_initial_state=has_initial_state, query_start_loc=query_start_loc,
                                            activation=activation, pad_slot_id=pad_slot_id)
    d = dispatcher()
    try:
        # Everything the metadata checks and the decision depend on; a hit skips both.
        sig = (
            x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
            None if bias is None else (bias.shape, bias.dtype, bias.device),
            None if conv_states is None else (conv_states.shape, conv_states.stride(), conv_states.dtype, conv_states.device),
            None if cache_indices is None else (cache_indices.shape, cache_indices.dtype, cache_indices.device),
            None if has_initial_state is None else (has_initial_state.shape, has_initial_state.dtype, has_initial_state.device),
            None if query_start_loc is None else (query_start_loc.shape, query_start_loc.dtype, query_start_loc.device),
            activation, pad_slot_id, type(pad_slot_id), pins_in_context(),
        )
        hit = d.memo.get(sig)
    except (AttributeError, TypeError):  # not tensors, or unhashable arguments: checks say which
        sig = hit = None
    if hit is None:
        key = check_fn(x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc,
                       activation, pad_slot_id, d.check_values)
        hit = d.resolve(sig, key)
    elif d.check_values:
        check_fn_values(x, conv_states, cache_indices, query_start_loc, pad_slot_id)
    vid, fn, act = hit
    try:
        return fn(x, weight, bias, conv_states=conv_states, cache_indices=cache_indices,
                  has_initial_state=has_initial_state, query_start_loc=query_start_loc,
                  activation=act, pad_slot_id=pad_slot_id)
    except Exception as exc:
        raise VariantFailed(f"variant {vid!r} of causal_conv1d_fn failed: {type(exc).__name__}: {exc}") from exc


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """One decode (or speculative verify) step of the causal convolution, channel-last.

    Args:
        x: ``[B, D]`` (one token) or ``[B, L, D]``.
        conv_state: ``[N, S, D]`` cache pool, S >= W-1 (S >= W-1+L-1 with num_accepted_tokens),
            updated in place. Without ``num_accepted_tokens`` the slot becomes the last S rows of
            slot ++ x; with it the history starts at row ``n-1`` and the slot shifts by ``n``.
        weight: ``[D, W]``. bias: ``[D]`` or None.
        conv_state_indices: ``[B]`` int32/int64 slot per sequence (None: slot b); slots equal
            to ``pad_slot_id`` give zero output and are neither read nor written.
        num_accepted_tokens: ``[B]`` int32/int64 in 1..L, for speculative decoding.

    Returns:
        A tensor of x's shape and dtype.
    """
    if torch.compiler.is_compiling():  # traced: one custom op, which dispatches when the graph runs
        from kernel_variants import _custom_ops

        return _custom_ops.causal_conv1d_update(x, conv_state, weight, bias, activation=activation,
                                                conv_state_indices=conv_state_indices,
                                                num_accepted_tokens=num_accepted_tokens, pad_slot_id=pad_slot_id)
    d = dispatcher()
    try:
        sig = (
            x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
            None if bias is None else (bias.shape, bias.dtype, bias.device),
            conv_state.shape, conv_state.stride(), conv_state.dtype, conv_state.device,
            None if conv_state_indices is None else (conv_state_indices.shape, conv_state_indices.dtype, conv_state_indices.device),
            None if num_accepted_tokens is None else (num_accepted_tokens.shape, num_accepted_tokens.dtype, num_accepted_tokens.device),
            activation, pad_slot_id, type(pad_slot_id), pins_in_context(),
        )
        hit = d.memo.get(sig)
    except (AttributeError, TypeError):
        sig = hit = None
    if hit is None:
        key = check_update(x, conv_state, weight, bias, activation, conv_state_indices,
                           num_accepted_tokens, pad_slot_id, d.check_values)
        hit = d.resolve(sig, key)
    elif d.check_values:
        check_update_values(x, conv_state, conv_state_indices, num_accepted_tokens, pad_slot_id)
    vid, fn, act = hit
    try:
        return fn(x, conv_state, weight, bias, activation=act,
                  conv_state_indices=conv_state_indices, num_accepted_tokens=num_accepted_tokens,
                  pad_slot_id=pad_slot_id)
    except Exception as exc:
        raise VariantFailed(f"variant {vid!r} of causal_conv1d_update failed: {type(exc).__name__}: {exc}") from exc


_CHECKS = {"causal_conv1d_fn": check_fn, "causal_conv1d_update": check_update}
_PARAMS = {
    "causal_conv1d_fn": ("x", "weight", "bias", "conv_states", "cache_indices", "has_initial_state",
                         "query_start_loc", "activation", "pad_slot_id"),
    "causal_conv1d_update": ("x", "conv_state", "weight", "bias", "activation", "conv_state_indices",
                             "num_accepted_tokens", "pad_slot_id"),
}
_DEFAULTS = {"pad_slot_id": -1}


def call_key(op_name: str, *args: object, **kwargs: object) -> CallKey:
    """Validate a call to ``op_name`` given as it would be written, and return its key."""
    if op_name not in _CHECKS:
        raise ValueError(f"op_name: expected one of {', '.join(_CHECKS)}, got {op_name!r}")
    names = _PARAMS[op_name]
    if len(args) > 4 or (op_name == "causal_conv1d_fn" and len(args) > 3):
        raise TypeError(f"{op_name}: too many positional arguments ({len(args)})")
    bound = dict(zip(names, args, strict=False))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"{op_name}: unexpected argument {k!r}")
        if k in bound:
            raise TypeError(f"{op_name}: got multiple values for argument {k!r}")
        bound[k] = v
    full = [bound.get(n, _DEFAULTS.get(n)) for n in names]
    return _CHECKS[op_name](*full, values=dispatcher().check_values)


def explain(op_name: str, *args: object, **kwargs: object) -> Decision:
    """The decision the dispatcher makes for this call, with every variant's verdict and reason.

    Takes the op's arguments exactly as the op would; runs nothing. ``print()`` it for a trace.
    """
    key = call_key(op_name, *args, **kwargs)
    d = dispatcher()
    return d.decide(key, d.pinned(op_name), tune=False)
