"""The Gemma RMSNorm op family, with the semantics of sgl-kernel-npu's functions of these names:
:func:`gemma_rms_norm` and :func:`add_gemma_rms_norm` (the residual add fused in front).

Gemma stores the norm's scale as ``weight`` with the effective scale ``1 + weight``; the sum, the
mean of squares and the scaling are in fp32, the result in x's dtype. The dispatch key is
``(T, D)``: T rows (the product of x's leading dims) of D channels. Everything specific to the
two ops is in this package (``_spec``); the core knows them only through the specs below.
"""

from __future__ import annotations

import torch

from kernel_variants._registry.hookspecs import hookimpl
from kernel_variants._registry.models import Capabilities, Variant
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.entry import make_op
from kernel_variants.ops.gemma_rms_norm import _spec
from kernel_variants.ops.gemma_rms_norm._spec import ADD, FN, RmsFeatures


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma RMSNorm: ``x * rsqrt(mean(x^2, -1) + eps) * (1 + weight)``, in fp32.

    Args:
        x: ``[..., D]``, float32, bfloat16 or float16 (T = the product of the leading dims; T = 0
            gives an empty result).
        weight: ``[D]``, x's dtype and device.
        eps: a non-negative float.
        out: None, or a tensor of x's shape, dtype and device: the result is written there and
            ``out`` is returned. It may be exactly ``x`` (in place); any other overlap with an
            argument is a ValueError, and nothing is written then.

    Returns:
        A new tensor of x's shape and dtype (or ``out``). x and weight are not written.
    """
    return _FN(x, weight, eps, out)


def add_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float = 1e-6, *,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and Gemma RMSNorm in one: ``s = x + residual`` (summed in x's dtype), then
    ``out = s * rsqrt(mean(s^2, -1) + eps) * (1 + weight)`` in fp32.

    Args:
        x: ``[..., D]``, float32, bfloat16 or float16. residual: x's shape, dtype and device.
        weight: ``[D]``, x's dtype and device. eps: a non-negative float.
        out: None, or a tuple ``(o, r)`` of tensors of x's shape, dtype and device: the norm is
            written into ``o``, the sum into ``r``, and ``(o, r)`` is returned. ``out=(x,
            residual)`` is sglang's in-place fused add-RMSNorm: x becomes the norm and residual
            the sum (both are read before either is written). Any other overlap with an
            argument is a ValueError, and nothing is written then.

    Returns:
        ``(out, residual_sum)``: new tensors of x's shape and dtype, ``residual_sum`` being ``s``.
        No input is written, unless ``out=`` names it.
    """
    return _ADD(x, weight, residual, eps, out)


def _op_spec(name: str, signature, check, reference, **more) -> OpSpec:
    """One op of the family: what the two share (the key's axes, no flags, the base
    capabilities, the cases, a reference that covers every call) and what is its own (``more``)."""
    caps = Capabilities(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16"}, autograd=True,
                        takes_out=True, in_place=True)  # the reference computes apart, then writes out
    oracle = Variant(id="reference", op=name, version="1", fn=reference, priority=-100, isolate=False,
                     capabilities=caps, description="the contract in plain torch, fp32; the oracle for every other variant")
    return OpSpec(name=name, signature=signature, check=check, reference=oracle, make_case=_spec.spec_case(name),
                  sweeps=_spec.sweeps(name), axes=("T", "D"), features=RmsFeatures, capabilities=Capabilities,
                  conformance=_spec.conformance, normalize={"eps": float}, **more)


FN_SPEC = _op_spec(FN, gemma_rms_norm, _spec.check_fn, _spec.reference_fn, default_sweep="rms-smoke",
                   out_aliases={"out": "x"}, aliases=("rms",), description="Gemma RMSNorm (scale 1 + weight)")
# sglang's fused add-rmsnorm runs in place: the norm over x, the sum over residual.
ADD_SPEC = _op_spec(ADD, add_gemma_rms_norm, _spec.check_add, _spec.reference_add, default_sweep="add-rms-smoke",
                    outputs=("out", "residual_sum"), out_aliases={"out": "x", "residual_sum": "residual"},
                    aliases=("add_rms",), description="residual add, then Gemma RMSNorm; returns (out, residual_sum)")

SPECS = {FN: FN_SPEC, ADD: ADD_SPEC}
_spec.SPECS.update(SPECS)
_FN, _ADD = make_op(FN_SPEC), make_op(ADD_SPEC)


@hookimpl
def kv_register_ops(register) -> None:
    for spec in SPECS.values():
        register(spec)


__all__ = ["add_gemma_rms_norm", "gemma_rms_norm"]
