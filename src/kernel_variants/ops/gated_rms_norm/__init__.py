"""The gated RMSNorm op, with the semantics of vLLM's ``RMSNormGated`` (``forward_static``):
:func:`gated_rms_norm`, RMSNorm per group of channels with a gate ``act(z)`` applied before the
norm (Mamba2's ``Mixer2RMSNormGated``) or after it (Qwen3-Next's GDN output norm).

Everything is in fp32 and rounded once to x's dtype. The dispatch key is ``(T, D)``: T rows (the
product of x's leading dims) of D channels; whether a gate is given, where and which activation,
the number of groups and the weight's kind are the call's features.
"""

from __future__ import annotations

import torch

from kernel_variants._registry.hookspecs import hookimpl
from kernel_variants._registry.models import Variant
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.entry import make_op
from kernel_variants.ops.gated_rms_norm import _spec
from kernel_variants.ops.gated_rms_norm._spec import OP, GatedCapabilities, GatedFeatures


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                   group_size: int | None = None, norm_before_gate: bool = False, activation: str = "silu", *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Gated RMSNorm (vLLM's ``RMSNormGated.forward_static``), in fp32:

    - with z and not ``norm_before_gate``: ``x = x * act(z)``;
    - per group of ``group_size`` channels: ``n = x * rsqrt(mean(x^2 over the group) + eps) * weight``;
    - with z and ``norm_before_gate``: ``n = n * act(z)``;

    and ``n`` is returned rounded once to x's dtype.

    Args:
        x: ``[..., D]``, float32, bfloat16 or float16 (T = the product of the leading dims; T = 0
            gives an empty result).
        z: None (no gate), or the gate: x's shape, dtype and device.
        weight: None (no scale), or ``[D]`` on x's device, in x's dtype or float32.
        eps: a non-negative float.
        group_size: None (one group of D channels), or a divisor of D: each ``group_size``
            channels are normalised by their own mean of squares (``D // group_size`` groups).
        norm_before_gate: whether the gate scales the norm (True) or its input (False, Mamba2's).
        activation: ``"silu"`` (alias ``"swish"``) or ``"sigmoid"``: ``act`` of the gate. Ignored
            without z.
        out: None, or a tensor of x's shape, dtype and device: the result is written there and
            ``out`` is returned. It may be exactly ``x`` (in place); any other overlap with an
            argument is a ValueError, and nothing is written then.

    Returns:
        A new tensor of x's shape and dtype (or ``out``). x, z and weight are not written.
    """
    return _FN(x, z, weight, eps, group_size, norm_before_gate, activation, out)


_CAPS = GatedCapabilities(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16"}, autograd=True,
                          takes_out=True, in_place=True)  # computes apart, then writes out
SPEC = OpSpec(
    name=OP, signature=gated_rms_norm, check=_spec.check, axes=("T", "D"), features=GatedFeatures,
    capabilities=GatedCapabilities, make_case=_spec.make_case, conformance=_spec.conformance,
    sweeps=_spec.sweeps(), default_sweep="gated-norm-smoke", out_aliases={"out": "x"},
    normalize={"eps": float, "activation": _spec.normalize_activation},
    reference=Variant(id="reference", op=OP, version="1", fn=_spec.reference, priority=-100, isolate=False,
                      capabilities=_CAPS,
                      description="vLLM's RMSNormGated.forward_static in plain torch, fp32; the oracle for every "
                                  "other variant"),
    description="RMSNorm per group with a gate act(z) before or after it (vLLM's RMSNormGated)",
)
_spec.SPECS[OP] = SPEC
_FN = make_op(SPEC)


@hookimpl
def kv_register_ops(register) -> None:
    register(SPEC)


__all__ = ["gated_rms_norm"]
