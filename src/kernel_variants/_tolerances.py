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


def mismatch(actual: torch.Tensor, expected: torch.Tensor, what: str, *, exact: bool = False) -> str | None:
    """None when ``actual`` matches ``expected`` within the dtype's tolerance, else why not."""
    if actual.shape != expected.shape:
        return f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    if not torch.isfinite(actual).all() and torch.isfinite(expected).all():
        return f"{what}: contains NaN or Inf"
    atol, rtol = (0.0, 0.0) if exact else TOLERANCES[expected.dtype]
    a, e = actual.double().cpu(), expected.double().cpu()
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements differ beyond atol={atol}, rtol={rtol}; "
        f"first at {list(idx)}: got {a[idx].item():.6g}, expected {e[idx].item():.6g}"
    )
