"""The one tolerance table: how far a variant's output may be from the reference's, by dtype.

Half-precision outputs are rounded from fp32 accumulations; two correct kernels may sum the W
taps in different orders and land one rounding step apart, hence bf16's looser bound. State
write-back is a copy of input rows and must match exactly.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {  # dtype -> (atol, rtol)
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 1.6e-2),
}


def mismatch(actual: torch.Tensor, expected: torch.Tensor, what: str, *, exact: bool = False,
             tolerance: tuple[float, float] | None = None) -> str | None:
    """None when ``actual`` matches ``expected`` within the dtype's tolerance (``tolerance``:
    this (atol, rtol) instead), else why not."""
    if actual.shape != expected.shape:
        return f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    if not torch.isfinite(actual).all() and torch.isfinite(expected).all():
        return f"{what}: contains NaN or Inf"
    atol, rtol = (0.0, 0.0) if exact else tolerance if tolerance is not None else TOLERANCES[expected.dtype]
    a, e = actual.double().cpu(), expected.double().cpu()
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    err = (a - e).abs()[bad].nan_to_num(nan=float("inf")).max().item()  # NaN where a number was due: unbounded
    return (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements differ beyond atol={atol}, rtol={rtol} "
        f"(max error {err:.3g}); first at {list(idx)}: got {a[idx].item():.6g}, expected {e[idx].item():.6g}"
    )


# Gradients (a variant declaring ``autograd``), relative to each gradient's largest magnitude: a
# gradient sums what every output an input reaches contributes (a bias's, over every token),
# each term rounded in the dtype by autograd, so two correct backward passes in half precision
# land further apart than their outputs do. Measured between the built-in autograd variants and
# the reference on the edge cases of every class the conformance list reaches (widths 1-5, with
# and without bias and SiLU, states, speculative) and of both RMSNorm ops, by
# tools/gradient_spread.py: at worst bf16 3.1%, fp16 0.42%, fp32 3.5e-6 (a bias gradient); the
# bounds leave about 3x. A wrong derivative is off by the gradient's own size.
GRADIENT_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-8,
    torch.float32: 1e-4,
    torch.float16: 1.5e-2,
    torch.bfloat16: 0.1,
}


def gradient_mismatch(actual: torch.Tensor, expected: torch.Tensor, what: str) -> str | None:
    """None when the gradient ``actual`` is within the dtype's gradient tolerance of
    ``expected`` (relative to ``expected``'s largest magnitude, at least 1), else why not."""
    rel = GRADIENT_TOLERANCES.get(expected.dtype, 0.0)
    scale = max(float(expected.detach().abs().max()), 1.0) if expected.numel() else 1.0
    why = mismatch(actual, expected, what, tolerance=(rel * scale, 0.0))
    return None if why is None else f"{why} ({rel:g} of its largest magnitude, {scale:.3g})"
