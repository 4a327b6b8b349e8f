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


def cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` for a grid. Plain arithmetic: ``triton.cdiv`` is a jitted function, and
    called from the host it costs a decode call microseconds."""
    return -(-n // d)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """Launch under ``t``'s device: Triton compiles for and launches on the current device.
    No guard where it is the current one already (its switch and switch back cost a decode
    call 2.4 us of host time on the H200's host)."""
    dev = t.device
    if dev.type != "cuda" or dev.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(dev)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where it is contiguous (``is_contiguous`` reads a flag; ``.contiguous()`` is a
    dispatched op even then), else a contiguous copy: for kernels that index it densely."""
    return t if t.is_contiguous() else t.contiguous()
