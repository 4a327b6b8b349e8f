"""Validation, reference, cases and sweeps of the plain RMSNorm ops, with the semantics of vLLM
IR's ``rms_norm`` and ``fused_add_rms_norm`` (``vllm/ir/ops/layernorm.py``, vLLM 0.32):

- ``s = x`` in fp32, or ``s = x.float() + x_residual.float()`` (and ``residual = s`` rounded to
  x's dtype, which the add form returns second);
- ``n = s * rsqrt(mean(s[..., :variance_size]^2) + epsilon)`` (the whole row when
  ``variance_size`` is None);
- with a weight, ``n = n.to(weight.dtype) * weight``; the result is ``n`` in x's dtype.

The building blocks (x's and epsilon's checks, the tensors of a case, the edge cases) are the
Gemma family's: the two families are one norm with a different scale.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch

from kernel_variants._dtypes import acc_dtype, dtype_name
from kernel_variants._registry.case import Case, Sweep
from kernel_variants._registry.keys import CallKey, Features, KeyParts
from kernel_variants._registry.models import Capabilities
from kernel_variants._validate import like_x, shape_str, tensor
from kernel_variants.ops.gemma_rms_norm import _spec as gemma

FN, ADD = "rms_norm", "fused_add_rms_norm"
WeightKind = Literal["x", "float32", "none"]

# The package's specs by op name, filled in by the package once built (as in the Gemma family).
SPECS: dict[str, Any] = {}


class NormFeatures(Features):
    """What besides the shape decides which variants can run a call: the weight (x's dtype,
    float32 under a half-precision x, as vLLM's GemmaRMSNorm passes ``weight.float() + 1``, or
    none) and whether ``variance_size`` narrows the mean."""

    weight: WeightKind = "x"
    variance_size: bool = False


class NormCapabilities(Capabilities):
    """What a plain RMSNorm variant can run: which weights (``weights``), and whether it takes a
    ``variance_size`` (off unless declared: most kernels average the whole row)."""

    weights: frozenset[WeightKind] = frozenset({"x", "float32", "none"})
    variance_size: bool = False

    def uncovered(self, key: CallKey) -> str | None:
        why = super().uncovered(key)
        if why is not None:
            return why
        f = key.features
        if f.weight not in self.weights:
            return f"weight {f.weight} not in {sorted(self.weights)}"
        if f.variance_size and not self.variance_size:
            return "variance_size not supported"
        return None


def weight_kind(x: torch.Tensor, weight: torch.Tensor | None) -> WeightKind:
    """The feature ``weight`` of a call whose weight passed :func:`check_weight`."""
    if weight is None:
        return "none"
    return "x" if weight.dtype == x.dtype else "float32"


def check_weight(weight: object, x: torch.Tensor) -> None:
    """weight: None, or ``[D]`` on x's device in x's dtype or float32."""
    if weight is None:
        return
    tensor("weight", weight)
    assert isinstance(weight, torch.Tensor)
    if weight.ndim != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: expected None or shape [D={x.shape[-1]}], got {shape_str(weight)}")
    if weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"weight: expected x's dtype {dtype_name(x.dtype)} or float32, got {dtype_name(weight.dtype)}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected x's device {x.device}, got {weight.device}")


def check_variance_size(variance_size: object, x: torch.Tensor) -> None:
    """variance_size: None, or an int in [1, D]."""
    if variance_size is None:
        return
    if isinstance(variance_size, bool) or not isinstance(variance_size, int):
        raise TypeError(f"variance_size: expected None or an int, got {type(variance_size).__name__}")
    if not 1 <= variance_size <= x.shape[-1]:
        raise ValueError(f"variance_size: expected None or 1 <= variance_size <= D={x.shape[-1]}, got {variance_size}")


def _key(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None) -> KeyParts:
    dim = x.shape[-1]
    features = NormFeatures(weight=weight_kind(x, weight), variance_size=variance_size is not None)
    return x.device.type, dtype_name(x.dtype), features, (x.numel() // dim, dim), frozenset()


def check_fn(x: object, weight: object, epsilon: object, variance_size: object, *, values: bool) -> KeyParts:
    """Validate an ``rms_norm`` call; return its key parts (T, D)."""
    x = gemma.check_x(x)
    check_weight(weight, x)
    gemma.check_eps(epsilon, "epsilon")
    check_variance_size(variance_size, x)
    return _key(x, weight, variance_size)  # type: ignore[arg-type]


def check_add(x: object, x_residual: object, weight: object, epsilon: object, variance_size: object, *,
              values: bool) -> KeyParts:
    """Validate a ``fused_add_rms_norm`` call; return its key parts (T, D)."""
    x = gemma.check_x(x)
    tensor("x_residual", x_residual)
    assert isinstance(x_residual, torch.Tensor)
    if x_residual.shape != x.shape:
        raise ValueError(f"x_residual: expected shape {shape_str(x)} (x's), got {shape_str(x_residual)}")
    like_x("x_residual", x_residual, x)
    check_weight(weight, x)
    gemma.check_eps(epsilon, "epsilon")
    check_variance_size(variance_size, x)
    return _key(x, weight, variance_size)  # type: ignore[arg-type]


def _normalize(s: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None,
               dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """s: [..., D] in the accumulation dtype (fp32; fp64 for fp64, for gradcheck). Returns the
    norm in ``dtype``: a new tensor, or written into ``out``."""
    part = s if variance_size is None else s[..., :variance_size]
    y = s * torch.rsqrt(part.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if weight is not None:
        y = y.to(weight.dtype) * weight  # vLLM rounds the norm to the weight's dtype first
    return y.to(dtype) if out is None else out.copy_(y)


def reference_fn(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., D]; weight: [D] or None. Returns a new tensor of x's shape and dtype, or ``out``
    (x's shape and dtype; it may be x) written."""
    return _normalize(x.to(acc_dtype(x.dtype)), weight, epsilon, variance_size, x.dtype, out)


def reference_add(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                  variance_size: int | None = None, *,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, x_residual: [..., D]; weight: [D] or None. Returns (norm, residual), both of x's shape
    and dtype: new tensors, or the pair ``out`` written (it may be ``(x, x_residual)``: in place)."""
    acc = acc_dtype(x.dtype)
    s = x.to(acc) + x_residual.to(acc)  # the norm is of the fp32 sum, not of its rounding
    residual = s.to(x.dtype)
    if out is None:
        return _normalize(s, weight, epsilon, variance_size, x.dtype, None), residual
    # s and residual are new tensors: out may be (x, x_residual).
    _normalize(s, weight, epsilon, variance_size, x.dtype, out[0])
    return out[0], out[1].copy_(residual)


def make_case(op: str, shape: tuple[int, ...], *, dtype: torch.dtype, device: str | torch.device = "cpu",
              seed: int = 0, batched: bool = False, strided: bool = False, offset: bool = False,
              eps: float = 1e-6, weight: WeightKind = "x", variance_size: bool = False) -> Case:
    """A call on (T, D) (the Gemma family's tensors, the weight drawn around 1): ``weight`` says
    which (x's dtype, float32, or None); ``variance_size`` averages the squares over the first
    half of the row (at least one channel)."""
    dim = shape[1]
    x, w, residual = gemma.tensors(shape, dtype=dtype, device=device, seed=seed, batched=batched, strided=strided,
                                   offset=offset, weight_base=1.0,
                                   weight_dtype=torch.float32 if weight == "float32" else None)
    given = None if weight == "none" else w
    size = max(1, dim // 2) if variance_size else None
    if op == FN:
        return Case(SPECS[op], (x, given, eps, size), {})
    return Case(SPECS[op], (x, residual, given, eps, size), {})


def spec_case(op: str):
    def case(shape: tuple[int, ...], **options: Any) -> Case:
        return make_case(op, shape, **options)

    return case


# The Gemma family's layouts and sizes, and what only this family has: no weight, an fp32 weight
# under a half-precision x, a mean over part of the row (alone and with the other traps).
CASES: dict[str, dict[str, Any]] = {
    **gemma.CASES,
    "no-weight": dict(shape=(5, 48), weight="none"),
    "fp32-weight": dict(shape=(6, 40), weight="float32"),
    "variance_size": dict(shape=(4, 72), variance_size=True),
    "variance_size-odd-D": dict(shape=(3, 33), variance_size=True),
    "variance_size-no-weight-strided": dict(shape=(4, 64), variance_size=True, weight="none", strided=True),
    "fp32-weight-offset-batched": dict(shape=(4, 24), weight="float32", offset=True, batched=True),
    "variance_size-wide": dict(shape=(2, 8200), variance_size=True, weight="float32"),
}


def conformance(caps: Capabilities) -> Iterator[tuple[str, dict[str, Any]]]:
    yield from CASES.items()


def sweeps(op: str) -> dict[str, Sweep]:
    """The Gemma family's shapes, named ``norm-rms``/``fused-add-rms`` (and ``-smoke``)."""
    return gemma.sweeps(op, prefix="norm-" if op == FN else "fused-add-")
