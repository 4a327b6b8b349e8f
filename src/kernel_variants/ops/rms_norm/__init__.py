"""The plain RMSNorm op family, with the semantics of vLLM IR's ops of these names
(``vllm.ir.ops.rms_norm`` and ``vllm.ir.ops.fused_add_rms_norm``): :func:`rms_norm` and
:func:`fused_add_rms_norm` (the residual add fused in front).

The sums, the mean of squares and the normalisation are in fp32; the weight is optional (vLLM's
``RMSNorm(has_weight=False)``), may be float32 under a half-precision x (vLLM's GemmaRMSNorm
passes ``weight.float() + 1``), and ``variance_size`` averages the squares over the first
channels only. The dispatch key is ``(T, D)``: T rows (the product of x's leading dims) of D
channels; the weight's kind and whether ``variance_size`` is given are the call's features.
The Gemma family (``ops/gemma_rms_norm``) is this op with the scale ``1 + weight``; its variants
run the same kernels with that offset.
"""

from __future__ import annotations

import torch

from kernel_variants._registry.hookspecs import hookimpl
from kernel_variants._registry.models import Variant
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.entry import make_op
from kernel_variants.ops.rms_norm import _spec
from kernel_variants.ops.rms_norm._spec import ADD, FN, NormCapabilities, NormFeatures


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm: ``x * rsqrt(mean(x[..., :variance_size]^2, -1) + epsilon) * weight``, in fp32.

    Args:
        x: ``[..., D]``, float32, bfloat16 or float16 (T = the product of the leading dims; T = 0
            gives an empty result).
        weight: None (no scale), or ``[D]`` on x's device, in x's dtype or float32. The
            normalised value is rounded to the weight's dtype before the multiply, as vLLM does.
        epsilon: a non-negative float.
        variance_size: None (the mean over all D channels), or ``1 <= variance_size <= D``: the
            mean over the first ``variance_size`` channels, the whole row normalised by it.
        out: None, or a tensor of x's shape, dtype and device: the result is written there and
            ``out`` is returned. It may be exactly ``x`` (in place); any other overlap with an
            argument is a ValueError, and nothing is written then.

    Returns:
        A new tensor of x's shape and dtype (or ``out``). x and weight are not written.
    """
    return _FN(x, weight, epsilon, variance_size, out)


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None, *,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and RMSNorm in one: ``s = x + x_residual`` in fp32, then
    ``rms_norm(s, weight, epsilon, variance_size)``.

    Args:
        x: ``[..., D]``, float32, bfloat16 or float16. x_residual: x's shape, dtype and device.
        weight, epsilon, variance_size: as :func:`rms_norm`.
        out: None, or a tuple ``(o, r)`` of tensors of x's shape, dtype and device: the norm is
            written into ``o``, the sum into ``r``, and ``(o, r)`` is returned. ``out=(x,
            x_residual)`` is vLLM's in-place form (``fused_add_rms_norm.maybe_inplace``): x
            becomes the norm and x_residual the sum (both read before either is written). Any
            other overlap with an argument is a ValueError, and nothing is written then.

    Returns:
        ``(normed, residual)``: new tensors of x's shape and dtype, ``residual`` being ``s``
        rounded to x's dtype (the norm is of the unrounded sum). No input is written, unless
        ``out=`` names it.
    """
    return _ADD(x, x_residual, weight, epsilon, variance_size, out)


def _op_spec(name: str, signature, check, reference, **more) -> OpSpec:
    """One op of the family: what the two share (axes, features, capabilities, cases, a
    reference that covers every call) and what is its own (``more``)."""
    caps = NormCapabilities(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16"}, autograd=True,
                            variance_size=True, takes_out=True, in_place=True)  # computes apart, then writes out
    oracle = Variant(id="reference", op=name, version="1", fn=reference, priority=-100, isolate=False,
                     capabilities=caps,
                     description="vLLM IR's native composite in plain torch, fp32; the oracle for every other variant")
    return OpSpec(name=name, signature=signature, check=check, reference=oracle, make_case=_spec.spec_case(name),
                  sweeps=_spec.sweeps(name), axes=("T", "D"), features=NormFeatures, capabilities=NormCapabilities,
                  conformance=_spec.conformance, normalize={"epsilon": float}, **more)


FN_SPEC = _op_spec(FN, rms_norm, _spec.check_fn, _spec.reference_fn, default_sweep="norm-rms-smoke",
                   out_aliases={"out": "x"},
                   description="RMSNorm (vLLM IR's rms_norm: scale weight or none, optional variance_size)")
# vLLM's maybe_inplace form writes the norm over x and the sum over x_residual.
ADD_SPEC = _op_spec(ADD, fused_add_rms_norm, _spec.check_add, _spec.reference_add,
                    default_sweep="fused-add-rms-smoke", outputs=("out", "residual"),
                    out_aliases={"out": "x", "residual": "x_residual"},
                    description="residual add in fp32, then RMSNorm; returns (normed, residual) "
                                "(vLLM IR's fused_add_rms_norm)")
_spec.SPECS.update({FN: FN_SPEC, ADD: ADD_SPEC})
_FN, _ADD = make_op(FN_SPEC), make_op(ADD_SPEC)


@hookimpl
def kv_register_ops(register) -> None:
    register(FN_SPEC)
    register(ADD_SPEC)


__all__ = ["fused_add_rms_norm", "rms_norm"]
