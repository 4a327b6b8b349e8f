"""sglang's causal_conv1d functions (Triton, sgl_kernel CUDA wrappers, sgl_kernel_npu) and the
Ascend C op's schema, over kernel_variants' ops. Re-exported by
:mod:`kernel_variants.integrations.sglang`, whose docstring describes the layouts.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants.integrations._common import decode, decode_varlen, mark, prefill
from kernel_variants.integrations._fast import decode_step, prefill_step
from kernel_variants.integrations._layout import as_activation, refuse

ENGINE = "sglang"
PAD_SLOT_ID = -1


def _channel_first_prefill(
    engine: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    activation: str | bool | None,
    pad_slot_id: int,
    seq_lens: list[int] | None,
    *,
    exact_rows: bool,
) -> torch.Tensor:
    """x ``(dim, T)`` (with query_start_loc, or one sequence without) or ``(B, dim, L)``;
    conv_states ``(N, dim, S)``; weight ``(dim, W)``. Returns x's shape and layout."""
    act = as_activation(activation)
    rows = conv_states.shape[-1] if conv_states is not None else None
    if exact_rows and rows is not None and rows != weight.shape[1] - 1:
        # sgl_kernel_npu's prefill puts the whole slot in front of x: only W-1 rows work there.
        raise NotImplementedError(
            f"{engine}: causal_conv1d_fn_npu with {rows} state rows per slot; it is "
            f"defined for exactly W-1 = {weight.shape[1] - 1}"
        )
    if query_start_loc is not None:
        if x.ndim != 2:
            raise ValueError(
                f"{engine}: x: expected (dim, tokens) with query_start_loc, got {list(x.shape)}"
            )
    elif x.ndim not in (2, 3):
        raise ValueError(
            f"{engine}: x: expected (dim, tokens) or (batch, dim, seqlen), got {list(x.shape)}"
        )
    # (dim, T) without offsets is one sequence.
    one = query_start_loc is None and x.ndim == 2
    y = prefill(engine, x.unsqueeze(0) if one else x, weight, bias, conv_states, query_start_loc,
                cache_indices, has_initial_state, act, int(pad_slot_id), seq_lens=seq_lens,
                channel_first=True)
    return y[0] if one else y


def _host_lengths(values: Any) -> list[int] | None:
    return [int(n) for n in values] if values is not None else None


@mark
def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens_cpu: list[int] | None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    validate_data: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """sglang's Triton prefill. x: ``(dim, T)`` (a view of ``[T, dim]``); weight ``(dim, W)``;
    bias ``(dim,)``; conv_states ``(N, dim, S)``, S >= W-1, updated in place in its first W-1
    rows; query_start_loc ``[B+1]``; seq_lens_cpu: the B lengths on the host (tokens of x past
    their sum are padding: zero in the result, never read); cache_indices, has_initial_state
    ``[B]``. Slots equal to ``pad_slot_id`` are skipped. ``validate_data`` and ``kwargs`` are
    ignored, as sglang ignores them.

    Returns ``(dim, T)``, the transpose of a ``[T, dim]`` tensor.
    """
    if seq_lens_cpu is not None:  # the lengths (none zero, summing to T) are checked in the call core
        y = prefill_step(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                         activation, pad_slot_id, False, seq_lens_cpu)
        if y is not None:
            return y
    if x.ndim != 2:
        raise ValueError(f"{ENGINE}: x: expected (dim, tokens), got shape {list(x.shape)}")
    return _channel_first_prefill(
        ENGINE, x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        activation, pad_slot_id, _host_lengths(seq_lens_cpu), exact_rows=False,
    )


@mark
def causal_conv1d_fn_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    conv_states: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs: Any,
) -> torch.Tensor:
    """sglang's sgl_kernel prefill wrapper. x: ``(dim, T)`` with query_start_loc ``[B+1]``, or
    ``(B, dim, L)`` (a view of ``[B, L, dim]``); weight ``(dim, W)``; conv_states
    ``(N, dim, S)``, first W-1 rows updated in place; cache_indices, has_initial_state ``[B]``.
    ``seq_lens_cpu`` in kwargs is used as in :func:`causal_conv1d_fn`; other kwargs ignored.

    Returns x's shape and layout (sglang's wrapper writes into x and returns it; this returns
    a new tensor and leaves x alone).
    """
    return _channel_first_prefill(
        ENGINE, x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        activation, pad_slot_id, _host_lengths(kwargs.get("seq_lens_cpu")), exact_rows=False,
    )


@mark
def causal_conv1d_fn_npu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    conv_states: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs: Any,
) -> torch.Tensor:
    """sgl_kernel_npu's prefill, as sglang's Ascend GDN backend calls it. x: ``(dim, T)`` with
    query_start_loc ``[B+1]``, or ``(B, dim, L)``; weight ``(dim, W)``; conv_states
    ``(N, dim, W-1)`` exactly (sglang passes ``pool[:, -(W-1):].transpose(1, 2)``), updated in
    place; cache_indices, has_initial_state ``[B]``. Slots equal to ``pad_slot_id`` are skipped
    (the original cannot skip). ``seq_lens_cpu`` in kwargs is used; other kwargs ignored.

    Returns x's shape: ``(dim, T)`` (padded tokens zero) or ``(B, dim, L)``.
    """
    return _channel_first_prefill(
        ENGINE, x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        activation, pad_slot_id, _host_lengths(kwargs.get("seq_lens_cpu")), exact_rows=True,
    )


@mark
def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    intermediate_conv_window: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    metadata: Any = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """sglang's Triton decode / verify. x: ``(B, dim)`` or ``(B, dim, L)`` (a view of
    ``[B, L, dim]``); conv_state ``(N, dim, S)``, updated in place in its first W-1 rows
    (W-1+L-1 with num_accepted_tokens ``[B]``); weight ``(dim, W)``; bias ``(dim,)``;
    conv_state_indices ``[B]``, slots equal to ``pad_slot_id`` skipped. ``metadata`` and
    ``validate_data`` are ignored.

    Returns x's shape and layout.
    """
    if (num_accepted_tokens is None and cache_seqlens is None and intermediate_conv_window is None
            and intermediate_state_indices is None and retrieve_next_token is None
            and retrieve_next_sibling is None and retrieve_parent_token is None):
        y = decode_step(x, conv_state, weight, bias, activation, conv_state_indices, int(pad_slot_id), table=False)
        if y is not None:
            return y
    refuse(
        ENGINE,
        cache_seqlens=cache_seqlens,
        intermediate_conv_window=intermediate_conv_window,
        intermediate_state_indices=intermediate_state_indices,
        retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling,
        retrieve_parent_token=retrieve_parent_token,
    )
    return decode(ENGINE, x, conv_state, weight, bias, as_activation(activation),
                  conv_state_indices, num_accepted_tokens, int(pad_slot_id), channel_first=True)


@mark
def causal_conv1d_update_cuda(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """sglang's sgl_kernel decode wrapper. x: ``(B, dim)`` or ``(B, dim, L)``; conv_state
    ``(N, dim, S)``, first W-1 rows updated in place; weight ``(dim, W)``; conv_state_indices
    ``[B]``. Returns x's shape and layout (a new tensor; sglang's wrapper overwrites x)."""
    if cache_seqlens is None:
        y = decode_step(x, conv_state, weight, bias, activation, conv_state_indices, int(pad_slot_id), table=False)
        if y is not None:
            return y
    refuse(ENGINE, cache_seqlens=cache_seqlens)
    return decode(ENGINE, x, conv_state, weight, bias, as_activation(activation),
                  conv_state_indices, None, int(pad_slot_id), channel_first=True)


@mark
def causal_conv1d_update_npu(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    intermediate_conv_window: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    metadata: Any = None,
    validate_data: bool = False,
    *,
    intermediate_state_indices: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """sgl_kernel_npu's ``causal_conv1d_update_npu``. Shapes and rules as
    :func:`causal_conv1d_update` (x ``(B, dim[, L])``, conv_state ``(N, dim, S)``, weight
    ``(dim, W)``). Unlike the original's plain-decode path, the bias is applied and
    ``pad_slot_id`` slots are skipped. Returns x's shape and layout."""
    return causal_conv1d_update(
        x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices,
        num_accepted_tokens, intermediate_conv_window, intermediate_state_indices,
        retrieve_next_token, retrieve_next_sibling, retrieve_parent_token, pad_slot_id,
        metadata, validate_data,
    )


@mark
def causal_conv1d_update_v2(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int = PAD_SLOT_ID,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """sgl_kernel_npu's channel-last ``causal_conv1d_update_v2``. x: ``[B, dim]``,
    ``[B, L, dim]``, or ``[T, dim]`` with query_start_loc ``[B+1]`` and max_query_len;
    conv_state ``[N, S, dim]``, updated in place in its first W-1 rows (W-1+L-1 with
    num_accepted_tokens ``[B]``); weight ``[W, dim]``; bias ``[dim]``; conv_state_indices
    ``[B]``, slots equal to ``pad_slot_id`` skipped. ``validate_data`` is ignored.

    Returns x's shape (a new tensor; the original writes its output over x).
    """
    refuse(
        ENGINE,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
    )
    act = as_activation(activation)
    weight_dw = weight.t()
    if query_start_loc is not None:
        return decode_varlen(
            ENGINE, x, conv_state, weight_dw, bias, act, conv_state_indices, num_accepted_tokens,
            query_start_loc, max_query_len, int(pad_slot_id), short_plain=False,
        )
    return decode(ENGINE, x, conv_state, weight_dw, bias, act, conv_state_indices,
                  num_accepted_tokens, int(pad_slot_id))


@mark
def npu_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    bias: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    activation_mode: int = 0,
    pad_slot_id: int = PAD_SLOT_ID,
    run_mode: int = 0,
) -> torch.Tensor:
    """The Ascend C op ``torch.ops.npu.causal_conv1d`` (sgl-kernel-npu), as sglang's Ascend
    GDN/KDA backends call it. x: ``[T, dim]`` with query_start_loc ``[B+1]`` (or ``[B, L, dim]``
    / decode ``[B, dim]`` without); weight ``[W, dim]``; conv_states ``[N, S, dim]``, history in
    each slot's first W-1 rows, updated in place; cache_indices, has_initial_state,
    num_accepted_tokens ``[B]``; activation_mode 0 (none) or 1 (SiLU); run_mode 0 (prefill) or
    1 (decode / verify). Slots equal to ``pad_slot_id`` are skipped (zero output rows).

    In decode, ``has_initial_state`` is ignored (the slot is always the history); packed decode
    sequences of unequal lengths are run one at a time, and inside a graph capture, where
    query_start_loc cannot be read, every sequence is taken to hold T/B tokens.

    Returns a new tensor of x's shape.
    """
    mode = int(activation_mode)
    if mode not in (0, 1):
        raise ValueError(f"{ENGINE}: activation_mode: expected 0 or 1, got {activation_mode!r}")
    act = "silu" if mode == 1 else None
    weight_dw = weight.t()
    if run_mode == 0:
        refuse(ENGINE, **{"num_accepted_tokens (with run_mode=0)": num_accepted_tokens})
        return prefill(ENGINE, x, weight_dw, bias, conv_states, query_start_loc, cache_indices,
                       has_initial_state, act, int(pad_slot_id))
    if run_mode != 1:
        raise ValueError(
            f"{ENGINE}: run_mode: expected 0 (prefill) or 1 (decode), got {run_mode!r}"
        )
    if query_start_loc is not None:
        return decode_varlen(
            ENGINE, x, conv_states, weight_dw, bias, act, cache_indices, num_accepted_tokens,
            query_start_loc, None, int(pad_slot_id), short_plain=True,
        )
    return decode(ENGINE, x, conv_states, weight_dw, bias, act, cache_indices,
                  num_accepted_tokens, int(pad_slot_id))

