"""The one dtype table: canonical names (as tables and capabilities store them), the short names
users type (``bf16``) and the torch dtypes they stand for."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# canonical name -> short name; canonical names are torch's own (torch.bfloat16 -> "bfloat16")
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
CHOICES = (*SHORT.values(), *SHORT)  # what a user may type: bf16 or bfloat16


def canonical(name: str) -> str:
    """``"bf16"`` or ``"bfloat16"`` -> ``"bfloat16"``; ``ValueError`` naming the choices otherwise."""
    if name in SHORT:
        return name
    for full, short in SHORT.items():
        if name == short:
            return full
    raise ValueError(f"dtype: expected one of {', '.join(CHOICES)}, got {name!r}")


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, canonical(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (any dtype, supported or not, for messages)."""
    return str(dtype).removeprefix("torch.")


def short(name: str) -> str:
    return SHORT.get(name, name)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for every input dtype but fp64, which keeps its precision."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32
