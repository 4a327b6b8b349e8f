"""The cpu_native kernels' extensions, one per op family, in this folder's ``csrc``: built and
loaded by :mod:`kernel_variants._native.build`, which knows nothing of their file conventions."""

from __future__ import annotations

from pathlib import Path

from kernel_variants._native.build import Extension

_CSRC = Path(__file__).resolve().parent / "csrc"

# The ISA files' target pragmas and ATen CPU_CAPABILITY macros (each a kernel's to include first).
_ISA_HEADERS = ("isa.h", "isa_avx2.h", "isa_avx512.h", "isa_avx512bf16.h")


def kernel(name: str, csrc: Path = _CSRC) -> Extension:
    """A kernel's extension: ``{name}_cpu.cpp`` first (its copies of shared inline functions are
    the baseline-ISA ones the linker keeps), then one file per ISA, and the headers they share."""
    return Extension(name, csrc, sources=tuple(f"{name}_{isa}.cpp" for isa in ("cpu", "avx2", "avx512", "avx512bf16")),
                     headers=(f"{name}_kernel.h", f"{name}_params.h", "cpu_common.h", *_ISA_HEADERS),
                     what=f"C++ kernel of {name}")


CONV = kernel("causal_conv1d")
RMS = kernel("gemma_rms_norm")
SSM = kernel("ssm_scan")
GDN = kernel("gdn")
