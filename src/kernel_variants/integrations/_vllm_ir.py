"""kernel_variants as a vLLM IR provider (``vllm/ir/op.py``, vLLM 0.32 and later) of
``vllm.ir.ops.rms_norm`` and ``vllm.ir.ops.fused_add_rms_norm``, under the provider name
``kernel_variants``: vLLM's RMSNorm layers call those ops, and vLLM dispatches each call (or, under
its ``torch.compile``, lowers each graph node) to the first provider in the kernel config's
``ir_op_priority`` list whose ``supports_args`` accepts the call; inside ours the dispatcher
picks the variant per shape, as for every call of ``kv.rms_norm``.

- Registering is harmless: vLLM uses a provider only where ``ir_op_priority`` names it, so the
  package's ``vllm.general_plugins`` entry point registers it in every vLLM process where
  ``vllm.ir`` imports, whatever ``KV_VLLM_PATCH`` says (that variable is the conv patch's).
- ``supports_args`` answers from the registry: the call must pass the op's validation (dtype,
  weight, variance_size) and some registered variant other than the reference, available
  here, must cover its kind (device, dtype, weight kind, variance_size; a table made when the
  provider registers). Otherwise vLLM goes on to its next provider (``native`` on the CPU,
  always last). It reads metadata only, in plain Python, so it answers for the fake tensors
  vLLM's lowering pass traces with, and under Dynamo (which vLLM's compile runs it in).
- Eagerly the implementation calls ``kv.rms_norm`` / ``kv.fused_add_rms_norm``; the add form
  is registered ``inplace=True`` (vLLM allows it for that op) and writes the norm over x and
  the sum over x_residual, as vLLM's own kernels do: vLLM clones both first wherever it needs
  the functional form. Traced (Dynamo, or the lowering pass's fake tensors) it calls this
  library's ``torch.library`` ops, so the compiled graph holds ``kernel_variants::rms_norm``,
  whose kernel dispatches when the graph runs.
"""

import importlib
import itertools
from typing import Any

import torch

import kernel_variants as kv
from kernel_variants._registry.keys import CallKey

PROVIDER = "kernel_variants"
OPS = ("rms_norm", "fused_add_rms_norm")


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (vLLM's lowering pass traces the implementation with them):
    then only the op's graph node, not a kernel, may run."""
    return torch._subclasses.fake_tensor.is_fake(t)


def _custom_op(name: str) -> Any:
    from kernel_variants._runtime import custom_ops

    return custom_ops.op_overload(name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
             variance_size: int | None = None) -> torch.Tensor:
    """vLLM IR's rms_norm by kernel_variants. x: [..., D]; weight: [D] or None. Returns a new
    tensor of x's shape and dtype."""
    if not torch.compiler.is_compiling() and _traced(x):  # Dynamo itself inlines kv.rms_norm's traced form
        return _custom_op("rms_norm")(x, weight, epsilon, variance_size)
    return kv.rms_norm(x, weight, epsilon, variance_size)


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM IR's fused_add_rms_norm by kernel_variants, in place (registered ``inplace=True``):
    x [..., D] becomes the norm, x_residual the sum; returns ``(x, x_residual)``. Traced, the
    functional op's two new tensors."""
    if torch.compiler.is_compiling():
        return kv.fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size)
    if _traced(x):
        return _custom_op("fused_add_rms_norm")(x, x_residual, weight, epsilon, variance_size)
    return kv.fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size, out=(x, x_residual))


_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# (op, device type, x's dtype, weight kind, variance_size given) that some variant other than the
# reference, available here, covers; made when the provider registers (see _coverage).
COVERED: frozenset[tuple[str, str, torch.dtype, str, bool]] = frozenset()


def _coverage() -> frozenset[tuple[str, str, torch.dtype, str, bool]]:
    """Every kind of call (op, device, dtype, weight kind, variance_size) that a variant other
    than the reference, available here, covers. Shape limits are left to the dispatcher (a call
    outside them runs the reference inside the provider: correct, only slower)."""
    from kernel_variants._runtime.dispatcher import dispatcher
    from kernel_variants.ops.rms_norm import NormFeatures

    # The runtime's registry, as kv.op_specs() and kv.variants() read it (the callers' API stands
    # above the integrations: _api.shadowing imports integrations._shadow).
    registry = dispatcher().registry
    covered = set()
    for op in OPS:
        spec = next(s for s in registry.ops() if s.name == op)
        usable = [rv for rv in registry.variants(op) if rv.id != "reference" and rv.unavailable_reason() is None]
        for rv in usable:
            caps = rv.variant.capabilities
            for device, dtype, kind, vs in itertools.product(caps.devices, _DTYPES.items(), ("x", "float32", "none"),
                                                             (False, True)):
                key = CallKey(spec, device, dtype[1], NormFeatures(weight=kind, variance_size=vs), (1, 1))
                if caps.uncovered(key) is None:
                    covered.add((op, device, dtype[0], kind, vs))
    return frozenset(covered)


def _covers(op: str, x: Any, x_residual: Any, weight: Any, variance_size: Any) -> bool:
    """The op's validation and the coverage table, on metadata only, in plain Python that Dynamo
    traces to a constant (vLLM asks while its compile traces the model; pydantic would not trace)."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[-1] < 1 or x.dtype not in _DTYPES:
        return False
    dim = x.shape[-1]
    if x_residual is not None and (not isinstance(x_residual, torch.Tensor) or x_residual.shape != x.shape
                                   or x_residual.dtype != x.dtype or x_residual.device != x.device):
        return False
    if weight is None:
        kind = "none"
    elif (not isinstance(weight, torch.Tensor) or weight.ndim != 1 or weight.shape[0] != dim
          or weight.device != x.device or weight.dtype not in (x.dtype, torch.float32)):
        return False
    else:
        kind = "x" if weight.dtype == x.dtype else "float32"
    if variance_size is not None and (isinstance(variance_size, bool) or not isinstance(variance_size, int)
                                      or not 1 <= variance_size <= dim):
        return False
    return (op, x.device.type, x.dtype, kind, variance_size is not None) in COVERED


def supports_rms_norm(x: Any, weight: Any, epsilon: Any, variance_size: Any = None) -> bool:
    """vLLM's ``supports_args`` for rms_norm: a call kernel_variants validates and covers."""
    return _covers("rms_norm", x, None, weight, variance_size)


def supports_fused_add_rms_norm(x: Any, x_residual: Any, weight: Any, epsilon: Any, variance_size: Any = None) -> bool:
    """vLLM's ``supports_args`` for fused_add_rms_norm, as :func:`supports_rms_norm`."""
    if x_residual is None:
        return False
    return _covers("fused_add_rms_norm", x, x_residual, weight, variance_size)


def register_provider() -> tuple[str, ...]:
    """Register ``kernel_variants`` as a vLLM IR provider of rms_norm and fused_add_rms_norm
    (once per process). Returns the ops it is a provider of now; ``()`` where ``vllm.ir`` does
    not import (no vLLM, or one before vLLM IR) or has neither op."""
    global COVERED
    try:
        ops = importlib.import_module("vllm.ir.ops")
    except ImportError:
        return ()
    COVERED = _coverage()
    impls = {"rms_norm": (rms_norm, supports_rms_norm, False),
             "fused_add_rms_norm": (fused_add_rms_norm, supports_fused_add_rms_norm, True)}
    done = []
    for name, (fn, supports, inplace) in impls.items():
        ir_op = getattr(ops, name, None)
        if ir_op is None:
            continue
        if PROVIDER not in ir_op.impls:
            ir_op.register_impl(PROVIDER, supports_args=supports, inplace=inplace)(fn)
        done.append(name)
    return tuple(done)
