"""Validation, reference, cases and sweeps of the Gemma RMSNorm ops (sgl-kernel-npu's
``gemma_rms_norm`` and ``add_gemma_rms_norm``).

``s = x`` (or ``x + residual``, summed in x's dtype: that sum is ``residual_sum``);
``out = s * rsqrt(mean(s^2 over the last dim) + eps) * (1 + weight)``, computed in fp32 and
returned in x's dtype. Inputs are never written.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from kernel_variants._dtypes import acc_dtype, dtype_name
from kernel_variants._registry.case import Case, Sweep
from kernel_variants._registry.keys import Features, KeyParts
from kernel_variants._registry.models import Capabilities
from kernel_variants._validate import like_x, shape_str, tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FN, ADD = "gemma_rms_norm", "add_gemma_rms_norm"


# The package's specs by op name, filled in by the package once built (the specs hold this
# module's functions, so it cannot import them).
SPECS: dict[str, Any] = {}


class RmsFeatures(Features):
    """Nothing but the shape and dtype changes which variant is fastest: no flags."""


def check_x(x: object) -> torch.Tensor:
    tensor("x", x)
    assert isinstance(x, torch.Tensor)
    if x.dtype not in DTYPES:
        raise TypeError(f"x: expected dtype float32, bfloat16 or float16, got {dtype_name(x.dtype)}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x: expected shape [..., D] with D >= 1, got {shape_str(x)}")
    return x


def _weight(weight: object, x: torch.Tensor) -> None:
    tensor("weight", weight)
    assert isinstance(weight, torch.Tensor)
    if weight.ndim != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: expected shape [D={x.shape[-1]}], got {shape_str(weight)}")
    like_x("weight", weight, x)


def check_eps(eps: object, name: str = "eps") -> None:
    """``eps`` (called ``name`` in the op's signature) must be a finite float >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, int | float):
        raise TypeError(f"{name}: expected a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{name}: expected a finite number >= 0, got {eps!r}")


def _key(x: torch.Tensor) -> KeyParts:
    dim = x.shape[-1]
    return x.device.type, dtype_name(x.dtype), RmsFeatures(), (x.numel() // dim, dim), frozenset()


def check_fn(x: object, weight: object, eps: object, *, values: bool) -> KeyParts:
    """Validate a ``gemma_rms_norm`` call; return its key parts (T, D)."""
    x = check_x(x)
    _weight(weight, x)
    check_eps(eps)
    return _key(x)


def check_add(x: object, weight: object, residual: object, eps: object, *, values: bool) -> KeyParts:
    """Validate an ``add_gemma_rms_norm`` call; return its key parts (T, D)."""
    x = check_x(x)
    _weight(weight, x)
    tensor("residual", residual)
    assert isinstance(residual, torch.Tensor)
    if residual.shape != x.shape:
        raise ValueError(f"residual: expected shape {shape_str(x)} (x's), got {shape_str(residual)}")
    like_x("residual", residual, x)
    check_eps(eps)
    return _key(x)


def _normalize(s: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """s: [..., D] in x's dtype; the normalisation in fp32 (fp64 for fp64, for gradcheck),
    returned in s's dtype: a new tensor, or written into ``out`` (the rounding to s's dtype is
    then the copy's, the same round-to-nearest-even)."""
    acc = acc_dtype(s.dtype)
    f = s.to(acc)
    rms = torch.rsqrt(f.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = f * rms * (1.0 + weight.to(acc))
    return y.to(s.dtype) if out is None else out.copy_(y)


def reference_fn(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., D]; weight: [D]. Returns a new tensor of x's shape and dtype, or ``out`` (x's
    shape and dtype; it may be x) written."""
    return _normalize(x, weight, eps, out)


def reference_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float = 1e-6, *,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D]; weight: [D]. Returns (out, residual_sum), both of x's shape and
    dtype: new tensors, or the pair ``out`` written (it may be ``(x, residual)``: in place)."""
    s = x + residual  # in x's dtype, rounded: that is the residual stream the caller continues with
    if out is None:
        return _normalize(s, weight, eps), s
    _normalize(s, weight, eps, out[0])  # s is a new tensor: out[0] may be x
    return out[0], out[1].copy_(s)


def tensors(shape: tuple[int, ...], *, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
            batched: bool = False, strided: bool = False, offset: bool = False, weight_dtype: torch.dtype | None = None,
            weight_base: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, weight, residual)`` for a call on (T, D): x and residual ``[T, D]`` (``[2, T/2, D]``
    when ``batched``), weight ``[D]`` drawn around ``weight_base`` (0 for Gemma's ``1 + weight``, 1
    for a plain scale) in ``weight_dtype`` (default x's). ``strided`` makes x and residual views
    with a row stride of 2D and the weight a stride-2 view (NaN between); ``offset`` starts every
    tensor three elements into an allocation of NaN (a slice of a larger buffer, as engines pass
    them)."""
    tokens, dim = shape
    # Drawn on the device itself (a host-made prefill would cost host time and a copy per case).
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0, base: float = 0.0, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        drawn = torch.randn(*size, generator=gen, device=gen.device) * scale + base
        return drawn.to(dtype=as_dtype, device=device)

    def rows(t: torch.Tensor) -> torch.Tensor:
        if strided:
            t = torch.cat([t, torch.full_like(t, float("nan"))], dim=-1)[..., :dim]  # NaN between rows
        if batched and tokens % 2 == 0:
            t = t.reshape(2, tokens // 2, *t.shape[1:]) if not strided else t.unflatten(0, (2, tokens // 2))
        return t

    def inside(t: torch.Tensor) -> torch.Tensor:
        if not offset:
            return t
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
        whole = torch.full((span + 6,), float("nan"), dtype=t.dtype, device=t.device)
        return whole.as_strided(t.shape, t.stride(), 3).copy_(t)

    x = inside(rows(randn(tokens, dim, scale=3.0)))
    weight = randn(dim, scale=0.5, base=weight_base, as_dtype=weight_dtype or dtype)
    if strided:
        weight = torch.stack([weight, torch.full_like(weight, float("nan"))], dim=1)[:, 0]
    return x, inside(weight), inside(rows(randn(tokens, dim)))


def make_case(op: str, shape: tuple[int, ...], *, dtype: torch.dtype, device: str | torch.device = "cpu",
              seed: int = 0, batched: bool = False, strided: bool = False, offset: bool = False,
              eps: float = 1e-6) -> Case:
    """A call on (T, D) (:func:`tensors`): a Gemma-like weight near 0 (the scale is 1 + weight),
    and for the add op a residual."""
    x, weight, residual = tensors(shape, dtype=dtype, device=device, seed=seed, batched=batched, strided=strided,
                                  offset=offset)
    if op == FN:
        return Case(SPECS[op], (x, weight), {"eps": eps})
    return Case(SPECS[op], (x, weight, residual), {"eps": eps})


def spec_case(op: str):
    def case(shape: tuple[int, ...], **options: Any) -> Case:
        return make_case(op, shape, **options)

    return case


CASES: dict[str, dict[str, Any]] = {
    "T=1": dict(shape=(1, 64)),
    "odd-D": dict(shape=(7, 33)),
    "D=1000": dict(shape=(5, 1000)),
    "batched": dict(shape=(6, 96), batched=True),
    "strided": dict(shape=(4, 48), strided=True),
    "strided-batched": dict(shape=(4, 40), strided=True, batched=True),
    "T=0": dict(shape=(0, 16)),
    "eps=0.1": dict(shape=(3, 24), eps=0.1),
    "wide": dict(shape=(2, 8200)),
    "offset": dict(shape=(5, 40), offset=True),
    "offset-strided-batched": dict(shape=(4, 24), offset=True, strided=True, batched=True),
}


def conformance(caps: Capabilities) -> Iterator[tuple[str, dict[str, Any]]]:
    yield from CASES.items()


def sweeps(op: str, prefix: str | None = None) -> dict[str, Sweep]:
    """Decode-like T 1..256 and prefill T up to 16k, D 1024..8192; and a few small shapes.
    Named ``<prefix>rms`` and ``<prefix>rms-smoke`` (default prefix: none for gemma_rms_norm,
    ``add-`` for add_gemma_rms_norm)."""
    if prefix is None:
        prefix = "" if op == FN else "add-"
    dims = (1024, 2048, 4096, 8192)
    decode = tuple((t, d) for t in (1, 8, 64, 256) for d in dims)
    prefill = tuple((t, d) for t in (1024, 4096, 16384) for d in dims)
    return {
        f"{prefix}rms": Sweep(f"{prefix}rms", op, decode + prefill,
                              description="decode-like T 1..256 and prefill T 1k..16k, D 1024..8192"),
        f"{prefix}rms-smoke": Sweep(f"{prefix}rms-smoke", op, ((1, 256), (16, 1024), (128, 2048)),
                                    description="a few small shapes, seconds to calibrate"),
    }
