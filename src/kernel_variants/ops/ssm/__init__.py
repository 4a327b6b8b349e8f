"""The state-space-scan op family: Mamba2's selective scan, as vLLM, Dao-AILab's ``mamba_ssm``
and sgl-kernel-npu call it, in the per-head form Mamba2 uses (docs/contract.md, "Selective scan").

- :func:`selective_state_update`: decode and speculative verify; T >= 1 tokens per sequence
  from a state pool slot, the slot updated in place;
- :func:`ssd_chunk_scan`: prefill of whole sequences (varlen), from a slot's state or zeros,
  the final state written back.

Both share one recurrence per head h (state ``[P, S]`` in fp32, ``g`` the head's group)::

    d = clamp(softplus(dt + dt_bias), dt_min, dt_max)     # each step optional, all fp32
    state = state * exp(d * A[h]) + d * outer(x, B[g])
    y = state @ C[g] + D[h] * x;  y *= silu(z)            # D and z optional

The dispatch key is (B, H, L): sequences, heads, tokens per sequence (a scan's mean, rounded
up); short and long sequences want different algorithms (token by token, or chunked).
"""

from __future__ import annotations

import math

import torch

from kernel_variants._registry.hookspecs import hookimpl
from kernel_variants._registry.models import Variant
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.entry import make_op
from kernel_variants.ops.ssm import _cases, _reference, _spec
from kernel_variants.ops.ssm._spec import SCAN, UPDATE, SsmCapabilities, SsmFeatures


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    *,
    state_batch_indices: torch.Tensor | None = None,
    dst_state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode (or speculative verify) step of the selective scan: each sequence's T tokens
    from its slot's state, the state written back once, after the last token.

    Args:
        state: ``[N, H, P, S]`` state pool, float32, bfloat16 or float16, updated in place; each
            slot dense (a pool that is a view with gaps between slots is fine).
        x: ``[B, H, P]`` (one token) or ``[B, T, H, P]``, float32/bfloat16/float16, any strides.
        dt: ``[B, H]`` or ``[B, T, H]``, x's dtype or float32: the raw step (see dt_bias, dt_softplus).
        A: ``[H]`` float32, one decay rate per head. B, C: ``[B, G, S]`` or ``[B, T, G, S]`` in
            x's dtype; head h reads group ``h // (H // G)``.
        D: ``[H]`` or None, the skip connection. z: x's shape or None, the gate (``y *= silu(z)``).
        dt_bias: ``[H]`` or None, added to dt. dt_softplus: softplus on dt (+ dt_bias).
        dt_min, dt_max: the step clamped to ``[dt_min, dt_max]`` (not clamped at the defaults).
        state_batch_indices: ``[B]`` int32/int64, the slot each sequence reads (None: slot b).
        dst_state_batch_indices: ``[B]``, the slot each writes (None: the one it reads).
        pad_slot_id: a sequence whose slot (read or written) equals it gives zero output and
            reads and writes nothing (vLLM passes its null block, 0).
        out: None, or a tensor of x's shape, dtype and device, written and returned.

    Returns:
        y, x's shape and dtype; the state is held in fp32 across the tokens and rounded to the
        pool's dtype once.
    """
    return _UPDATE(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, state_batch_indices,
                   dst_state_batch_indices, pad_slot_id, out)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    *,
    ssm_states: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prefill scan of whole sequences, packed (varlen): each starts from its slot's state
    or zeros, and its final state is written back to its slot.

    Args:
        x: ``[T, H, P]``, float32/bfloat16/float16, any strides. dt: ``[T, H]``, x's dtype or
            float32. A: ``[H]`` float32. B, C: ``[T, G, S]`` in x's dtype. D: ``[H]`` or None;
            z: x's shape or None; dt_bias: ``[H]`` or None; dt_softplus, dt_min, dt_max: as
            :func:`selective_state_update`.
        cu_seqlens: ``[B+1]`` int32/int64 start offsets, ``0 = start <= ... <= end = T`` (empty
            sequences allowed); None: one sequence of T tokens.
        ssm_states: None (every sequence starts from zeros; final states are not kept), or an
            ``[N, H, P, S]`` pool (float32/bfloat16/float16, each slot dense) written in place.
        state_indices: ``[B]`` int32/int64 slot per sequence (None: slot b). A slot equal to
            ``pad_slot_id`` gives zero output rows and reads and writes nothing.
        has_initial_state: ``[B]`` bool, whether the sequence starts from its slot's state (None:
            all start from zeros). An empty sequence writes its initial state (zeros without one).
        out: None, or a tensor of x's shape, dtype and device, written and returned.

    Returns:
        y ``[T, H, P]`` in x's dtype.
    """
    return _SCAN(x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, state_indices,
                 has_initial_state, pad_slot_id, out)


_ORACLE = "the recurrence in fp32, one token at a time (Python); the oracle for every other variant"
_REFERENCE_CAPS = dict(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True)
_FAMILY = dict(axes=("B", "H", "L"), features=SsmFeatures, capabilities=SsmCapabilities,
               check_options=_cases.CHECK_OPTIONS, normalize={"dt_min": float, "dt_max": float},
               written_within_tolerance=True)


def _oracle(op: str, fn) -> Variant:
    return Variant(id="reference", op=op, version="1", fn=fn, priority=-100, isolate=False,
                   capabilities=SsmCapabilities(**_REFERENCE_CAPS), description=_ORACLE)


UPDATE_SPEC = OpSpec(
    name=UPDATE, signature=selective_state_update, check=_spec.check_update,
    value_checks=_spec.update_value_checks, reference=_oracle(UPDATE, _reference.selective_state_update),
    make_case=_cases.spec_case(UPDATE), conformance=_cases.conformance(_cases.UPDATE_CASES),
    edge_cases=_cases.UPDATE_CASES, sweeps=_cases.sweeps(UPDATE), default_sweep="ssm-decode-smoke", mutates=("state",),
    out_like="x", aliases=("ssu",),
    description="Mamba2 decode / verify: T tokens per sequence from a pool slot, the state updated in place",
    **_FAMILY,
)
SCAN_SPEC = OpSpec(
    name=SCAN, signature=ssd_chunk_scan, check=_spec.check_scan, value_checks=_spec.scan_value_checks,
    reference=_oracle(SCAN, _reference.ssd_chunk_scan), make_case=_cases.spec_case(SCAN),
    conformance=_cases.conformance(_cases.SCAN_CASES), edge_cases=_cases.SCAN_CASES, sweeps=_cases.sweeps(SCAN),
    default_sweep="ssm-smoke", mutates=("ssm_states",), aliases=("ssd", "mamba2_prefill"),
    description="Mamba2 prefill: varlen sequences from a slot's state or zeros, final states written back",
    **_FAMILY,
)
SPECS = {UPDATE: UPDATE_SPEC, SCAN: SCAN_SPEC}
_cases.SPECS.update(SPECS)
_UPDATE, _SCAN = make_op(UPDATE_SPEC), make_op(SCAN_SPEC)


@hookimpl
def kv_register_ops(register) -> None:
    for spec in SPECS.values():
        register(spec)


__all__ = ["SsmCapabilities", "SsmFeatures", "selective_state_update", "ssd_chunk_scan"]
