"""``cpu_native`` for the plain RMSNorm ops (vLLM IR's ``rms_norm`` / ``fused_add_rms_norm``):
the Gemma ops' C++ row kernel (``cpu_native/csrc/gemma_rms_norm_*``), which takes the scale's
offset (1 for Gemma's ``1 + weight``, 0 here), an optional weight and the channels that make
the mean (``variance_size``) as parameters: one kernel, one build, for both families.

Where it departs from vLLM's composite, within the dtype's tolerance: the norm is scaled by the
weight in fp32 and rounded once (vLLM rounds the norm to the weight's dtype first), and in the
add form it normalises the sum rounded to x's dtype (vLLM the fp32 sum); ``residual`` is that
rounded sum in both, bit for bit.

The gated op (vLLM's ``RMSNormGated``) is the same kernel again, with the gate (before or after
the norm, SiLU or the sigmoid, computed from ``exp(-|z|)`` so that no |z| overflows) and groups
as parameters.
"""

from __future__ import annotations

import torch

from kernel_variants._native import build
from kernel_variants.kernels.cpu_native import _NATIVE_RMS, _rows
from kernel_variants.kernels.cpu_native._build import RMS
from kernel_variants.ops.gated_rms_norm import GatedCapabilities
from kernel_variants.ops.rms_norm import NormCapabilities
from kernel_variants.plugin import Variant, hookimpl


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., D]; weight: [D] or None (x's dtype or fp32, any stride). Returns a new tensor of
    x's shape and dtype, or ``out`` written (x's shape and dtype; it may be x itself)."""
    ext = build.load_extension(RMS)
    direct = out is not None and out.shape == x.shape and out.is_contiguous()
    res = ext.rms_norm(_rows(x), weight, epsilon, variance_size, _rows(out) if direct else None)
    if out is None or direct:
        return out if direct else res.view(x.shape)
    return out.copy_(res.view(x.shape))


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None, *,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, x_residual: [..., D]; weight: [D] or None. Returns (normed, x + x_residual), new
    tensors of x's shape, or the pair ``out`` written (it may be ``(x, x_residual)``: vLLM's
    in-place form; each element is read before it is written)."""
    ext = build.load_extension(RMS)
    direct = out is not None and all(o.shape == x.shape and o.is_contiguous() for o in out)
    given = (_rows(out[0]), _rows(out[1])) if direct else (None, None)
    o, s = ext.fused_add_rms_norm(_rows(x), _rows(x_residual), weight, epsilon, variance_size, *given)
    if direct:
        return out[0], out[1]
    o, s = o.view(x.shape), s.view(x.shape)
    # Both results are complete before either copy, so an out that is an input is safe.
    return (o, s) if out is None else (out[0].copy_(o), out[1].copy_(s))


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                   group_size: int | None = None, norm_before_gate: bool = False, activation: str = "silu", *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x, z: [..., D]; weight: [D] or None (x's dtype or fp32, any stride). The same row kernel
    with the gate (before or after the norm, SiLU or sigmoid) and groups as parameters. Returns a
    new tensor of x's shape and dtype, or ``out`` written (x's shape and dtype; it may be x)."""
    ext = build.load_extension(RMS)
    direct = out is not None and out.shape == x.shape and out.is_contiguous()
    res = ext.gated_rms_norm(_rows(x), None if z is None else _rows(z), weight, eps, group_size, norm_before_gate,
                             activation == "sigmoid", _rows(out) if direct else None)
    if out is None or direct:
        return out if direct else res.view(x.shape)
    return out.copy_(res.view(x.shape))


@hookimpl
def kv_register_variants(register) -> None:
    caps = NormCapabilities(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, variance_size=True,
                            takes_out=True, in_place=True)
    common = dict(id="cpu_native", version="1", priority=30, capabilities=caps, **_NATIVE_RMS)
    register(Variant(op="rms_norm", fn=rms_norm, description="the Gemma ops' fused C++ row kernel, offset 0", **common))
    register(Variant(op="fused_add_rms_norm", fn=fused_add_rms_norm,
                     description="the Gemma ops' fused C++ residual add and row kernel, offset 0", **common))
    gated = GatedCapabilities(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True,
                              in_place=True)  # each element of x is read before its output is written
    register(Variant(id="cpu_native", op="gated_rms_norm", version="1", fn=gated_rms_norm, priority=30,
                     capabilities=gated, **_NATIVE_RMS,
                     description="the Gemma ops' C++ row kernel with a vectorised gate (SiLU/sigmoid) and groups"))
