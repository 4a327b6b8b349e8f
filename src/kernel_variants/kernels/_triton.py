"""What the Triton variants share: finding a usable triton, the interpreter switch, launching
under the tensor's device, and block-size arithmetic."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re

import torch

from kernel_variants.kernels._adapters import dist_version

# What the kernel's speed depends on besides its source: its rows go stale when one changes.
DEPENDS = ("triton", "torch")
MIN_TRITON = (3, 4)


def installed_triton() -> str:
    """The installed triton, from package metadata (nothing imported)."""
    return dist_version("triton", "pytorch-triton", "pytorch-triton-rocm")


def interpreting() -> bool:
    """Whether Triton will interpret kernels (``TRITON_INTERPRET``), read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def probe() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed (pip install triton)"
    installed = installed_triton()
    found = re.match(r"triton-(\d+)\.(\d+)", installed.replace("pytorch-", ""))
    if found and (int(found[1]), int(found[2])) < MIN_TRITON:
        return (f"{installed} is older than triton {MIN_TRITON[0]}.{MIN_TRITON[1]} (the kernels take "
                "triton.language from a closure, which triton.jit resolves since 3.4)")
    if interpreting():
        return None
    if not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run on CPU under the interpreter)"
    return None


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def device_guard(t: torch.Tensor):
    """Launch under ``t``'s device: Triton compiles for and launches on the current device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
