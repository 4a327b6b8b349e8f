"""Argument checks every op shares: each names the argument, what was expected and what came."""

from __future__ import annotations

import torch

from kernel_variants._dtypes import dtype_name

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def tensor(name: str, t: object, *, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        want = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name}: expected {want}, got {type(t).__name__}")


def like_x(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.dtype != x.dtype:
        raise TypeError(f"{name}: expected dtype {dtype_name(x.dtype)} (x's), got {dtype_name(t.dtype)}")
    if t.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (x's), got {t.device}")


def floating(x: object) -> torch.Tensor:
    tensor("x", x)
    assert isinstance(x, torch.Tensor)
    if x.dtype not in FLOATS:
        raise TypeError(
            f"x: expected a floating dtype (float32, bfloat16, float16, float64), got {dtype_name(x.dtype)}"
        )
    return x


