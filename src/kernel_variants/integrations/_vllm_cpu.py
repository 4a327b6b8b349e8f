"""vLLM-CPU's own functions: the CPU platform's ``causal_conv1d_fn_cpu`` /
``causal_conv1d_update_cpu`` with their padding rule, and the two GDN wrappers over its C++
kernels, whose weight may be packed. Re-exported by :mod:`kernel_variants.integrations.vllm`.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants.integrations._common import decode, mark, prefill
from kernel_variants.integrations._fast import decode_step, prefill_step
from kernel_variants.integrations._layout import refuse
from kernel_variants.integrations._vllm_adapters import (
    ENGINE,
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    causal_conv1d_fn,
    update_into,
)

#: Names, in the null-block era of vLLM, of the CPU platform's own functions and of the module
#: that defines them (vLLM-CPU binds them under MODULE's names at import).
CPU_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d"


@mark
def causal_conv1d_fn_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs: Any,
) -> torch.Tensor:
    """vLLM-CPU's prefill (``ops/cpu/causal_conv1d.py``, bound as ``causal_conv1d_fn`` on the
    CPU platform), with its rule: sequences whose slot is ``pad_slot_id`` (-1) are skipped and
    slot 0 is processed like any other; ``null_block_id`` and vLLM's other keywords
    (``metadata``, ``validate_data``...) are accepted and, as there, ignored. Prefix caching
    arguments with values are refused (vLLM-CPU's function cannot run them either). Shapes as
    :func:`causal_conv1d_fn`; empty sequences write no state, as there.
    """
    refuse(
        ENGINE,
        block_idx_first_scheduled_token=kwargs.get("block_idx_first_scheduled_token"),
        block_idx_last_scheduled_token=kwargs.get("block_idx_last_scheduled_token"),
        initial_state_idx=kwargs.get("initial_state_idx"),
    )
    return causal_conv1d_fn(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        activation, pad_slot_id, None,
    )


# Keywords of vLLM's decode that change nothing the fast decode step does (any other must be None).
_IGNORED = frozenset({"null_block_id", "max_query_len", "validate_data", "metadata"})


@mark
def causal_conv1d_update_cpu(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    pad_slot_id: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """vLLM-CPU's decode (``ops/cpu/causal_conv1d.py``), with its rule: the skipped slot is
    ``pad_slot_id`` when given, else ``null_block_id`` (keyword) when given and not None, else
    vLLM's NULL_BLOCK_ID (0). ``num_accepted_tokens`` and ``max_query_len`` are honoured as in
    :func:`causal_conv1d_update` (vLLM-CPU's function drops them); ``out`` (x's shape) is
    written and returned. Other keywords are ignored, as there. Shapes as
    :func:`causal_conv1d_update`.
    """
    sentinel = pad_slot_id
    if sentinel is None:
        sentinel = kwargs.get("null_block_id", NULL_BLOCK_ID)
        if sentinel is None:
            sentinel = NULL_BLOCK_ID
    # vLLM passes its prefix-caching keywords as None on every call: their values decide.
    if (all(v is None for k, v in kwargs.items() if k not in _IGNORED)
            and (query_start_loc is None or kwargs.get("max_query_len") == 1)):
        y = decode_step(x, conv_state, weight, bias, activation, conv_state_indices, int(sentinel), query_start_loc)
        if y is not None:
            return y
    refuse(
        ENGINE,
        block_idx_last_scheduled_token=kwargs.get("block_idx_last_scheduled_token"),
        initial_state_idx=kwargs.get("initial_state_idx"),
        retrieve_parent_token=kwargs.get("retrieve_parent_token"),
    )
    return update_into(x, conv_state, weight, bias, activation, conv_state_indices,
                       kwargs.get("num_accepted_tokens"), query_start_loc,
                       kwargs.get("max_query_len", -1), int(sentinel), kwargs.get("out"))


#: vLLM-CPU's GDN layers (Qwen3-Next) call the C++ conv kernels through these two wrappers.
GDN_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
#: ``causal_conv1d_weight_pack`` lays a ``[D, 4]`` bf16 weight out in blocks of 32 channels,
#: each holding taps (0, 1) then taps (2, 3), channel-interleaved: ``[D/32, 2, 32, 2]``.
PACK_BLOCK, PACK_WIDTH = 32, 4


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The ``[D, 4]`` weight that vLLM-CPU's ``causal_conv1d_weight_pack`` packed (a copy: no
    ``[D, W]`` view of the packed layout exists). ValueError for a tensor of another shape."""
    if packed.ndim != 2 or packed.shape[1] != PACK_WIDTH or packed.shape[0] % PACK_BLOCK:
        raise ValueError(f"{ENGINE}: weight: expected a packed [D, {PACK_WIDTH}] weight with D a "
                         f"multiple of {PACK_BLOCK}, got shape {list(packed.shape)}")
    dim = packed.shape[0]
    blocks = packed.contiguous().view(dim // PACK_BLOCK, PACK_WIDTH // 2, PACK_BLOCK, 2)
    return blocks.permute(0, 2, 1, 3).reshape(dim, PACK_WIDTH)


def _unpacked(weight: torch.Tensor, is_weight_packed: bool) -> torch.Tensor:
    if not is_weight_packed:
        return weight.view(weight.shape[0], -1) if weight.ndim == 3 else weight
    from kernel_variants.kernels.vllm_cpu import PackCache

    global _UNPACKED
    if _UNPACKED is None:
        _UNPACKED = PackCache(lambda w: unpack_weight(w.detach()))
    return _UNPACKED.get(weight)


_UNPACKED: Any = None


@mark
def gdn_causal_conv1d_fwd_cpu(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    silu_activation: bool,
    is_weight_packed: bool,
) -> torch.Tensor:
    """vLLM-CPU's GDN prefill wrapper (``gdn_attention._causal_conv1d_fwd_cpu``), which calls
    ``torch.ops._C.causal_conv1d_fwd_cpu``: x ``(dim, T)`` (a view of ``[T, dim]``), weight
    packed by ``causal_conv1d_weight_pack`` (``is_weight_packed``; unpacked once per weight),
    conv_states ``(N, dim, S)`` in either of vLLM's layouts (a view of ``[N, S, dim]``, or the
    dim-first allocation itself), history in the first W-1 rows. The C++ kernel skips no
    slot; here a slot of -1 (which it would write outside the pool) is skipped and every other
    one, 0 included, is processed. Returns ``(dim, T)``."""
    weight = _unpacked(weight, is_weight_packed)
    y = prefill_step(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                     "silu" if silu_activation else None, PAD_SLOT_ID, False)
    if y is not None:
        return y
    return prefill(
        ENGINE, x, weight, bias, conv_states, query_start_loc,
        cache_indices, has_initial_state, "silu" if silu_activation else None, PAD_SLOT_ID,
        channel_first=True,
    )


@mark
def gdn_causal_conv1d_update_cpu(
    *,
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_activation: bool,
    conv_state_indices: torch.Tensor,
    is_weight_packed: bool,
    num_accepted_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM-CPU's GDN decode / verify wrapper (``gdn_attention._causal_conv1d_update_cpu``, over
    ``torch.ops._C.causal_conv1d_update_cpu``): x ``[B, dim]`` or ``[B, L, dim]`` (verify, with
    num_accepted_tokens ``[B]``), conv_states ``(N, dim, S)`` as in
    :func:`gdn_causal_conv1d_fwd_cpu`, weight packed or ``[dim, W]``. Slot rule as there.
    Returns x's shape."""
    weight = _unpacked(weight, is_weight_packed)
    if num_accepted_tokens is None:
        y = decode_step(x, conv_states, weight, bias, "silu" if silu_activation else None, conv_state_indices,
                        PAD_SLOT_ID, table=False)
        if y is not None:
            return y
    return decode(
        ENGINE, x, conv_states.transpose(-1, -2), weight, bias,
        "silu" if silu_activation else None, conv_state_indices, num_accepted_tokens, PAD_SLOT_ID,
    )
