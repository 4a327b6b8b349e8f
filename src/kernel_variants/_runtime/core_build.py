"""The call core's extension (the ops' per-call path in C++, ``csrc``), defined with the runtime
that loads it (``callcore``) and built by ``kv build`` through ``kernel_variants._native``."""

from __future__ import annotations

from pathlib import Path

from kernel_variants._native.build import Extension

#: Plain CPython C-API on ATen's tensor metadata, no kernel in it: one job per source file,
#: their shared declarations in one header, compiled as one unit (call_core.cpp includes them).
CORE = Extension("call_core", Path(__file__).resolve().parent / "csrc", sources=("call_core.cpp",),
                 headers=("call_core.h", "module.cpp", "key.cpp", "checks.cpp", "bound.cpp", "unalias.cpp",
                          "layout.cpp", "graph.cpp"), what="C++ call core")
