"""``aten`` for the Gemma RMSNorm ops: what one writes without this project,
``torch.nn.functional.rms_norm`` with ``1 + weight`` as its scale (and a torch add in front for
the residual form). ATen computes half-precision inputs in fp32 internally."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_variants.plugin import Capabilities, Variant, hookimpl


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., D]; weight: [D]. Returns x's shape and dtype."""
    return F.rms_norm(x, (x.shape[-1],), 1 + weight, eps)


def add_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D]; weight: [D]. Returns (out, x + residual)."""
    s = x + residual
    return F.rms_norm(s, (s.shape[-1],), 1 + weight, eps), s


_CAPS = Capabilities(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16"}, autograd=True)
_WHAT = "F.rms_norm(x, (D,), 1 + weight, eps)"


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(id="aten", op="gemma_rms_norm", version="1", fn=gemma_rms_norm, priority=10, isolate=False,
                     capabilities=_CAPS, description=_WHAT))
    register(Variant(id="aten", op="add_gemma_rms_norm", version="1", fn=add_gemma_rms_norm, priority=10, isolate=False,
                     capabilities=_CAPS, description=f"x + residual, then {_WHAT}"))

