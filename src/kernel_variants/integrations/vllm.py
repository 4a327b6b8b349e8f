"""vLLM drop-ins: ``causal_conv1d_fn`` and ``causal_conv1d_update`` with the signatures of
``vllm/model_executor/layers/mamba/ops/causal_conv1d.py``, running kernel_variants' ops.

Three lines inside a running vLLM worker::

    from kernel_variants.integrations import vllm as kv_vllm
    handle = kv_vllm.patch()      # every loaded binding of vLLM's two functions now runs ours
    ...; handle.undo()            # or: with kv_vllm.patch(): ...

How vLLM lays its tensors out, and how each maps to the channel-last ops (views only):

- prefill ``x`` is ``(dim, tokens)``, the transpose of vLLM's ``[tokens, dim]`` activations:
  ``x.transpose(0, 1)`` is that ``[T, D]`` tensor again. The result is returned the same way.
- the pool is ``cache.transpose(-1, -2)`` of an ``[N, W-1(+spec), D]`` allocation, ``(N, D, S)``;
  its transpose is the allocation itself. vLLM keeps the history in the slot's first W-1 rows
  (W-1+L-1 with ``num_accepted_tokens``) and never touches the rest, so the ops get that many
  leading rows as a view.
- ``weight`` is ``(dim, width)``, as the ops take it.
- decode ``x`` is ``(batch, dim)``, ``(batch, dim, seqlen)`` (a transposed view) or, with
  ``query_start_loc``, ``[tokens, dim]``; the result has x's shape and strides.

Padding: since vLLM PR #35431 padded entries of the state indices are the null block
(``null_block_id``, 0), which the kernels skip; before it they were ``pad_slot_id`` (-1).
Here the sentinel is ``null_block_id`` when it is not None, else ``pad_slot_id``; ``patch()``
installs :func:`causal_conv1d_fn_legacy` / :func:`causal_conv1d_update_legacy` (old signatures,
``pad_slot_id`` rule) into a vLLM whose functions have no ``null_block_id`` parameter.
Skipped sequences give zero output rows (vLLM leaves them uninitialised).

Not supported (NotImplementedError naming the argument): automatic prefix caching
(``block_idx_first_scheduled_token``, ``block_idx_last_scheduled_token``,
``initial_state_idx``), EAGLE tree verification (``retrieve_parent_token``), x and state of
different dtypes. Accepted and ignored, as they only tune vLLM's own kernel or only matter with
prefix caching: ``metadata``, ``validate_data``, ``num_computed_tokens``,
``block_size_to_align``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from kernel_variants.integrations._common import (
    Patch,
    as_activation,
    decode,
    decode_varlen,
    mark,
    patch_engine,
    prefill,
    refuse,
    slot_column,
)

ENGINE = "vLLM"
#: vLLM's ``vllm.v1.attention.backends.utils`` values.
PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0
#: Where vLLM defines the two functions; everything else binding them is found from there.
MODULE = "vllm.model_executor.layers.mamba.ops.causal_conv1d"

__all__ = [
    "MODULE",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "Patch",
    "causal_conv1d_fn",
    "causal_conv1d_fn_legacy",
    "causal_conv1d_update",
    "causal_conv1d_update_legacy",
    "patch",
]


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
    refuse(
        ENGINE,
        block_idx_first_scheduled_token=block_idx_first_scheduled_token,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
    )
    if x.ndim != 2:
        raise ValueError(f"{ENGINE}: x: expected (dim, tokens), got shape {list(x.shape)}")
    pool = conv_states.transpose(-1, -2) if conv_states is not None else None
    y = prefill(
        ENGINE, x.transpose(0, 1), weight, bias, pool, query_start_loc,
        slot_column(cache_indices), has_initial_state, as_activation(activation),
        _sentinel(null_block_id, pad_slot_id),
    )
    return y.transpose(0, 1)


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

    Returns a tensor of x's shape, and for ``(B, dim, L)`` input the same transposed layout.
    """
    refuse(
        ENGINE,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
        retrieve_parent_token=retrieve_parent_token,
    )
    act = as_activation(activation)
    sentinel = _sentinel(null_block_id, pad_slot_id)
    indices = slot_column(conv_state_indices)
    pool = conv_state.transpose(-1, -2)
    if query_start_loc is not None:
        if x.ndim != 2:
            raise ValueError(
                f"{ENGINE}: x: expected (tokens, dim) with query_start_loc, got {list(x.shape)}"
            )
        return decode_varlen(
            ENGINE, x, pool, weight, bias, act, indices, num_accepted_tokens, query_start_loc,
            max_query_len, sentinel, short_plain=False,
        )
    if x.ndim == 2:
        return decode(ENGINE, x, pool, weight, bias, act, indices, num_accepted_tokens, sentinel)
    if x.ndim == 3:
        y = decode(ENGINE, x.transpose(1, 2), pool, weight, bias, act, indices,
                   num_accepted_tokens, sentinel)
        return y.transpose(1, 2)
    raise ValueError(
        f"{ENGINE}: x: expected (batch, dim) or (batch, dim, seqlen), got {list(x.shape)}"
    )


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


def _has_null_block(fn: Callable[..., Any]) -> bool:
    try:
        return "null_block_id" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: assume the current vLLM
        return True


def _choose(current: Callable[..., Any], legacy: Callable[..., Any]) -> Callable[[Any], Any]:
    def factory(original: Any) -> Any:
        return current if _has_null_block(original) else legacy

    return factory


def patch() -> Patch:
    """Replace vLLM's ``causal_conv1d_fn`` and ``causal_conv1d_update`` with these adapters in
    every loaded module that binds them (vLLM's ops module, the mixers and backends that did
    ``from ... import``, any alias). vLLM must already be imported; nothing is imported here.

    Returns the undo handle (:class:`Patch`): ``.undo()``, or ``with patch(): ...``.
    Raises RuntimeError when vLLM's ops module is not loaded, or is already patched.
    """
    return patch_engine("vllm", {
        MODULE: {
            "causal_conv1d_fn": _choose(causal_conv1d_fn, causal_conv1d_fn_legacy),
            "causal_conv1d_update": _choose(causal_conv1d_update, causal_conv1d_update_legacy),
        },
    })
