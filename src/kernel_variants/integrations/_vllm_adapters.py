"""vLLM's two functions, with the signatures of
``vllm/model_executor/layers/mamba/ops/causal_conv1d.py`` (and of the releases before the null
block), over kernel_variants' ops. Re-exported by :mod:`kernel_variants.integrations.vllm`,
whose docstring describes the layouts and padding rules.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants.integrations._common import decode, decode_varlen, mark, prefill
from kernel_variants.integrations._fast import decode_step, prefill_step
from kernel_variants.integrations._layout import as_activation, refuse, slot_column

ENGINE = "vLLM"
#: vLLM's ``vllm.v1.attention.backends.utils`` values.
PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0


def _sentinel(null_block_id: int | None, pad_slot_id: int | None) -> int:
    if null_block_id is not None:
        return int(null_block_id)
    if pad_slot_id is not None:
        return int(pad_slot_id)
    return PAD_SLOT_ID  # nothing is skipped; -1 is never a slot


@mark
def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int | None = PAD_SLOT_ID,
    null_block_id: int | None = NULL_BLOCK_ID,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    num_computed_tokens: torch.Tensor | None = None,
    block_size_to_align: int | None = 0,
    metadata: Any = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """vLLM's prefill. x: ``(dim, T)`` (a view of ``[T, dim]``); weight ``(dim, W)``; bias
    ``(dim,)``; conv_states ``(N, dim, S)`` (a view of ``[N, S, dim]``), S >= W-1, updated in
    place in its first W-1 rows; query_start_loc ``[B+1]``; cache_indices ``[B]`` (or
    ``[B, blocks]``, column 0 used); has_initial_state ``[B]`` bool.

    Sequences whose slot is ``null_block_id`` (or ``pad_slot_id`` when that is None) are
    skipped. ``pad_slot_id`` is otherwise only vLLM's internal launch sentinel. ``metadata``,
    ``validate_data``, ``num_computed_tokens`` and ``block_size_to_align`` are ignored.

    Returns ``(dim, T)``, the transpose of a ``[T, dim]`` tensor, like vLLM's.
    """
    if (block_idx_first_scheduled_token is None and block_idx_last_scheduled_token is None
            and initial_state_idx is None):
        # An int null block is the sentinel as it is: no frame for the usual case.
        y = prefill_step(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                         null_block_id if type(null_block_id) is int else _sentinel(null_block_id, pad_slot_id))
        if y is not None:
            return y
    refuse(
        ENGINE,
        block_idx_first_scheduled_token=block_idx_first_scheduled_token,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
    )
    if x.ndim != 2:
        raise ValueError(f"{ENGINE}: x: expected (dim, tokens), got shape {list(x.shape)}")
    return prefill(
        ENGINE, x, weight, bias, conv_states, query_start_loc, slot_column(cache_indices),
        has_initial_state, as_activation(activation), _sentinel(null_block_id, pad_slot_id),
        channel_first=True,
    )


@mark
def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    null_block_id: int | None = NULL_BLOCK_ID,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    validate_data: bool = False,
    out: torch.Tensor | None = None,
    *,
    retrieve_parent_token: torch.Tensor | None = None,
    pad_slot_id: int | None = None,
) -> torch.Tensor:
    """vLLM's decode / speculative verify. x: ``(B, dim)``, ``(B, dim, L)`` (a view of
    ``[B, L, dim]``), or ``[T, dim]`` with query_start_loc ``[B+1]`` and max_query_len;
    conv_state ``(N, dim, S)`` (a view of ``[N, S, dim]``), updated in place in its first W-1
    rows (W-1+L-1 with num_accepted_tokens ``[B]``); weight ``(dim, W)``; bias ``(dim,)``;
    conv_state_indices ``[B]`` (or ``[B, blocks]``, column 0 used).

    Slots equal to ``null_block_id`` (or to ``pad_slot_id``, the pre-null-block keyword, when
    ``null_block_id`` is None) are skipped. Packed sequences of unequal lengths are run one at
    a time (reading query_start_loc on the host; refused inside a graph capture).
    ``validate_data`` is ignored.

    Returns a tensor of x's shape, and for ``(B, dim, L)`` input the same transposed layout;
    with ``out`` (x's shape, as vLLM takes it) the result is written there and ``out`` returned.
    """
    if (out is None and num_accepted_tokens is None and block_idx_last_scheduled_token is None
            and initial_state_idx is None and retrieve_parent_token is None
            and (query_start_loc is None or max_query_len == 1)):
        y = decode_step(x, conv_state, weight, bias, activation, conv_state_indices,
                        null_block_id if type(null_block_id) is int else _sentinel(null_block_id, pad_slot_id),
                        query_start_loc)
        if y is not None:
            return y
    refuse(
        ENGINE,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
        retrieve_parent_token=retrieve_parent_token,
    )
    return update_into(x, conv_state, weight, bias, activation, conv_state_indices,
                       num_accepted_tokens, query_start_loc, max_query_len,
                       _sentinel(null_block_id, pad_slot_id), out)


def update_into(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | bool | None,
    conv_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    max_query_len: int | None,
    sentinel: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The decode behind vLLM's and vLLM-CPU's ``causal_conv1d_update`` (shapes as there),
    written into ``out`` (x's shape) when given."""
    if out is not None and out.shape != x.shape:
        raise ValueError(f"{ENGINE}: out: expected x's shape {list(x.shape)}, got {list(out.shape)}")
    act = as_activation(activation)
    indices = slot_column(conv_state_indices)
    if query_start_loc is not None:
        y = decode_varlen(
            ENGINE, x, conv_state.transpose(-1, -2), weight, bias, act, indices,
            num_accepted_tokens, query_start_loc, max_query_len, sentinel, short_plain=False,
        )
    else:
        y = decode(ENGINE, x, conv_state, weight, bias, act, indices, num_accepted_tokens,
                   sentinel, channel_first=True)
    return y if out is None else out.copy_(y)


@mark
def causal_conv1d_fn_legacy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int | None = PAD_SLOT_ID,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    num_computed_tokens: torch.Tensor | None = None,
    block_size_to_align: int | None = 0,
    metadata: Any = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """:func:`causal_conv1d_fn` with the signature of vLLM before the null block (no
    ``null_block_id``): sequences whose slot is ``pad_slot_id`` are skipped, slot 0 is a slot."""
    return causal_conv1d_fn(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        activation, pad_slot_id, None, block_idx_first_scheduled_token,
        block_idx_last_scheduled_token, initial_state_idx, num_computed_tokens,
        block_size_to_align, metadata, validate_data,
    )


@mark
def causal_conv1d_update_legacy(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int | None = PAD_SLOT_ID,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """:func:`causal_conv1d_update` with the signature of vLLM before the null block: slots
    equal to ``pad_slot_id`` are skipped, slot 0 is a slot. Shapes as there."""
    return causal_conv1d_update(
        x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
        query_start_loc, max_query_len, None, block_idx_last_scheduled_token, initial_state_idx,
        validate_data, retrieve_parent_token=retrieve_parent_token, pad_slot_id=pad_slot_id,
    )
