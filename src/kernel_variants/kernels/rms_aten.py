"""``aten`` for the RMSNorm ops (the gated one too): what one writes without this project,
``torch.nn.functional.rms_norm`` (with ``1 + weight`` as its scale for the Gemma ops, and a
torch add in front for the residual forms). ATen computes half-precision inputs in fp32
internally. It has no ``variance_size``: the plain ops' calls with one go elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_variants.ops.gated_rms_norm import GatedCapabilities
from kernel_variants.ops.rms_norm import NormCapabilities
from kernel_variants.plugin import Capabilities, Variant, hookimpl


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., D]; weight: [D]. Returns x's shape and dtype."""
    return F.rms_norm(x, (x.shape[-1],), 1 + weight, eps)


def add_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D]; weight: [D]. Returns (out, x + residual)."""
    s = x + residual
    return F.rms_norm(s, (s.shape[-1],), 1 + weight, eps), s


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
             variance_size: int | None = None) -> torch.Tensor:
    """x: [..., D]; weight: [D] (x's dtype or fp32) or None. Returns x's shape and dtype."""
    if weight is not None and weight.dtype != x.dtype:  # an fp32 weight under a half x: F.rms_norm wants one dtype
        return F.rms_norm(x.float(), (x.shape[-1],), weight, epsilon).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, epsilon)


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, x_residual: [..., D]; weight: [D] or None. Returns (normed, x + x_residual)."""
    s = x + x_residual
    return rms_norm(s, weight, epsilon), s


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                   group_size: int | None = None, norm_before_gate: bool = False,
                   activation: str = "silu") -> torch.Tensor:
    """x, z: [..., D]; weight: [D] or None. Returns x's shape and dtype: the groups as a trailing
    dim of one F.rms_norm, everything in fp32, no Python loop."""
    act = torch.sigmoid if activation == "sigmoid" else F.silu
    s = x.float()
    g = None if z is None else act(z.float())
    if g is not None and not norm_before_gate:
        s = s * g
    size = group_size or s.shape[-1]
    n = F.rms_norm(s.unflatten(-1, (-1, size)), (size,), None, eps).flatten(-2)
    if weight is not None:
        n = n * weight  # an fp32 product, whatever the weight's dtype
    if g is not None and norm_before_gate:
        n = n * g
    return n.to(x.dtype)


_CAPS = Capabilities(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16"}, autograd=True)
_WHAT = "F.rms_norm(x, (D,), 1 + weight, eps)"
_PLAIN = NormCapabilities(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16"}, autograd=True)


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(id="aten", op="gemma_rms_norm", version="1", fn=gemma_rms_norm, priority=10, isolate=False,
                     capabilities=_CAPS, description=_WHAT))
    register(Variant(id="aten", op="add_gemma_rms_norm", version="1", fn=add_gemma_rms_norm, priority=10, isolate=False,
                     capabilities=_CAPS, description=f"x + residual, then {_WHAT}"))
    register(Variant(id="aten", op="rms_norm", version="1", fn=rms_norm, priority=10, isolate=False,
                     capabilities=_PLAIN, description="F.rms_norm(x, (D,), weight, epsilon)"))
    register(Variant(id="aten", op="fused_add_rms_norm", version="1", fn=fused_add_rms_norm, priority=10,
                     isolate=False, capabilities=_PLAIN, description="x + x_residual, then F.rms_norm"))
    register(Variant(id="aten", op="gated_rms_norm", version="1", fn=gated_rms_norm, priority=10, isolate=False,
                     capabilities=GatedCapabilities(devices={"cpu", "cuda", "npu"},
                                                    dtypes={"float32", "bfloat16", "float16"}, autograd=True),
                     description="the gate, then F.rms_norm over (groups, group_size) in fp32"))
