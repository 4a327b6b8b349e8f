"""The gated delta rule op family: the linear attention of Qwen3-Next's (and Qwen3.5's) GDN
layers, as vLLM (its CPU ops and fla's kernels) and sgl-kernel-npu call it
(docs/contract.md, "Gated delta rule").

- :func:`gated_delta_rule_update`: decode and verify, the gating fused from ``A_log``, ``a``,
  ``b``, ``dt_bias``; T >= 1 tokens per sequence from a pool slot, the slot updated in place;
- :func:`chunk_gated_delta_rule`: prefill of whole sequences (varlen) with ``g`` and ``beta``
  given (:func:`gdn_gating` makes them as vLLM does), from a slot's state or zeros, the final
  state written back.

Per v head h (state ``S`` ``[K, V]`` in fp32, q and k of its q/k head, L2-normalised)::

    S = S * exp(g);  u = beta * (v - Sᵀ k);  S = S + k ⊗ u;  o = Sᵀ (q * scale)

The dispatch key is (B, Hv, L): sequences, v heads, tokens per sequence (rounded up mean).
"""

from __future__ import annotations

import torch

from kernel_variants._registry.hookspecs import hookimpl
from kernel_variants._registry.models import Variant
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.entry import make_op
from kernel_variants.ops.gdn import _cases, _reference, _spec
from kernel_variants.ops.gdn._reference import gdn_gating
from kernel_variants.ops.gdn._spec import CHUNK, UPDATE, GdnCapabilities, GdnFeatures


def gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode (or speculative verify) step of the gated delta rule, the gating fused in.

    Args:
        q, k: ``[T, Hk, K]``, float32/bfloat16/float16 (v's dtype), any strides.
        v: ``[T, Hv, V]``, Hv a multiple of Hk (v head h reads q/k head ``h // (Hv // Hk)``).
        a, b: ``[T, Hv]`` (v's dtype or float32): the decay's and the write strength's inputs.
        A_log, dt_bias: ``[Hv]`` float32. Per token ``g = -exp(A_log) * softplus(a + dt_bias)``
            (softplus with ``softplus_beta`` and ``softplus_threshold``, as torch's) and
            ``beta = sigmoid(b)``.
        state: ``[N, Hv, K, V]`` pool, float32 or bfloat16, each slot dense, updated in place.
        state_indices: ``[B]`` int32/int64, each sequence's slot (None: slot b); a slot equal to
            ``pad_slot_id`` gives zero output and reads and writes nothing.
        cu_seqlens: ``[B+1]`` int32/int64 start offsets of the T tokens (None: B = T sequences
            of one token).
        use_qk_l2norm: q and k divided by ``sqrt(sum(x^2) + 1e-6)`` first. scale: q's scale
            (None: ``K ** -0.5``).
        out: None, or a tensor of v's shape, dtype and device, written and returned.

    Returns:
        o ``[T, Hv, V]`` in v's dtype; the state is carried in fp32 across a sequence's tokens
        and rounded to the pool's dtype once.
    """
    return _UPDATE(q, k, v, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, use_qk_l2norm, scale,
                   softplus_beta, softplus_threshold, pad_slot_id, out)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    ssm_states: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prefill of whole sequences, packed (varlen), with the gating given.

    Args:
        q, k: ``[T, Hk, K]``; v: ``[T, Hv, V]`` (as :func:`gated_delta_rule_update`).
        g: ``[T, Hv]`` float32, the log decay (``-inf``: forget everything); beta: ``[T, Hv]``
            float32 or v's dtype, the write strength. :func:`gdn_gating` makes both.
        cu_seqlens: ``[B+1]`` start offsets (empty sequences allowed); None: one sequence.
        ssm_states: None (every sequence from zeros, no state kept) or an ``[N, Hv, K, V]`` pool
            (float32 or bfloat16, each slot dense), written in place.
        state_indices: ``[B]`` slot per sequence (None: slot b); ``pad_slot_id`` skips one.
        has_initial_state: ``[B]`` bool, whether the sequence starts from its slot (None: all
            from zeros). An empty sequence writes its initial state.
        use_qk_l2norm, scale, out: as :func:`gated_delta_rule_update`.

    Returns:
        o ``[T, Hv, V]`` in v's dtype.
    """
    return _CHUNK(q, k, v, g, beta, cu_seqlens, ssm_states, state_indices, has_initial_state, use_qk_l2norm, scale,
                  pad_slot_id, out)


_ORACLE = "the recurrence in fp32, one token at a time (Python); the oracle for every other variant"
_REFERENCE_CAPS = dict(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True)
_FAMILY = dict(axes=("B", "Hv", "L"), features=GdnFeatures, capabilities=GdnCapabilities,
               check_options=_cases.CHECK_OPTIONS, out_like="v", written_within_tolerance=True)


def _oracle(op: str, fn) -> Variant:
    return Variant(id="reference", op=op, version="1", fn=fn, priority=-100, isolate=False,
                   capabilities=GdnCapabilities(**_REFERENCE_CAPS), description=_ORACLE)


UPDATE_SPEC = OpSpec(
    name=UPDATE, signature=gated_delta_rule_update, check=_spec.check_update, value_checks=_spec.update_value_checks,
    reference=_oracle(UPDATE, _reference.gated_delta_rule_update), make_case=_cases.spec_case(UPDATE),
    conformance=_cases.conformance(_cases.UPDATE_CASES), edge_cases=_cases.UPDATE_CASES, sweeps=_cases.sweeps(UPDATE),
    default_sweep="gdn-decode-smoke", mutates=("state",), aliases=("gdn_decode",),
    normalize={"softplus_beta": float, "softplus_threshold": float},
    description="GDN decode / verify: gating fused in, T tokens per sequence from a pool slot, updated in place",
    **_FAMILY,
)
CHUNK_SPEC = OpSpec(
    name=CHUNK, signature=chunk_gated_delta_rule, check=_spec.check_chunk, value_checks=_spec.chunk_value_checks,
    reference=_oracle(CHUNK, _reference.chunk_gated_delta_rule), make_case=_cases.spec_case(CHUNK),
    conformance=_cases.conformance(_cases.CHUNK_CASES), edge_cases=_cases.CHUNK_CASES, sweeps=_cases.sweeps(CHUNK),
    default_sweep="gdn-smoke", mutates=("ssm_states",), aliases=("gdn_prefill",),
    description="GDN prefill: varlen sequences from a slot's state or zeros, g and beta given, final states written",
    **_FAMILY,
)
SPECS = {UPDATE: UPDATE_SPEC, CHUNK: CHUNK_SPEC}
_cases.SPECS.update(SPECS)
_UPDATE, _CHUNK = make_op(UPDATE_SPEC), make_op(CHUNK_SPEC)


@hookimpl
def kv_register_ops(register) -> None:
    for spec in SPECS.values():
        register(spec)


__all__ = ["GdnCapabilities", "GdnFeatures", "chunk_gated_delta_rule", "gated_delta_rule_update", "gdn_gating"]
