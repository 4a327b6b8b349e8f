"""A CPU double of the ``torch_npu`` module, for its three RMSNorm kernels.

Each function has torch_npu's schema (Ascend/op-plugin ``op_plugin_functions.yaml``)::

    npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
    npu_gemma_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
    npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)

and returns what the real one does: ``y`` in x's dtype and shape, ``rstd`` in fp32 with x's
leading dims and 1 for each of gamma's (``[N, 1]`` for ``[N, D]`` and ``[D]``), and for the add
form ``x1 + x2`` last, in x1's dtype. The arithmetic follows the Ascend C kernels (hicann/ops-nn
``norm/rms_norm``, ``norm/add_rms_norm``, ``norm/gemma_rms_norm``): fp32 throughout for
RmsNorm/GemmaRmsNorm (GemmaRmsNorm adds 1 to gamma in fp32); AddRmsNorm rounds the sum to x's
dtype, normalises that, rounds the normalised row to x's dtype and then multiplies by gamma
(in fp16 for fp16, in fp32 then rounded for bf16).

The documented input constraints raise ``RuntimeError`` as the real kernels' checks do:
dtypes (fp32/fp16/bf16; gamma of x's dtype, except fp32 gamma for fp16/bf16 x in npu_rms_norm on
A2/A3; no bf16 on 310P), gamma = x's trailing dims, ranks (npu_rms_norm 2-8, others 1-8), no
empty tensors in npu_add_rms_norm and npu_gemma_rms_norm, contiguous tensors only in
npu_gemma_rms_norm, rows of at least 32 bytes for npu_rms_norm on 310P, and no GemmaRmsNorm
kernel outside A2/A3. ``npu.get_soc_version()`` reports the family's SoC version
(``soc_version``: 202 a 310P, 220 an A2, 250 an A3, 260 an A5).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SOC = {"310p": 202, "a2": 220, "a3": 250, "a5": 260}


def _family(soc: int) -> str:
    if 200 <= soc <= 205:
        return "310p"
    if 220 <= soc <= 225:
        return "a2"
    if 250 <= soc <= 255:
        return "a3"
    return "a5" if soc == 260 else "unknown"


def _fail(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def _rstd(xf: torch.Tensor, norm_dims: int, epsilon: float) -> torch.Tensor:
    dims = tuple(range(xf.dim() - norm_dims, xf.dim()))
    return torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)


class TorchNpuDouble:
    """The fake module (``.module``) and what was called on it (``.calls``)."""

    def __init__(self, soc_version: int = SOC["a2"], *, npu_available: bool = True,
                 without: tuple[str, ...] = ()) -> None:
        self.soc_version = soc_version
        self.npu_available = npu_available
        self.calls: list[tuple[str, tuple]] = []
        module = types.ModuleType("torch_npu")
        module.__version__ = "0.0+cpu.double"
        npu = types.ModuleType("torch_npu.npu")
        npu.is_available = lambda: self.npu_available
        npu.get_soc_version = lambda: self.soc_version
        module.npu = npu
        double = self

        # Plain functions with torch_npu's parameter names (``self`` included), bound to this double.
        def npu_rms_norm(self, gamma, epsilon=1e-06):
            return double.rms_norm(self, gamma, epsilon)

        def npu_gemma_rms_norm(self, gamma, epsilon=1e-06):
            return double.gemma_rms_norm(self, gamma, epsilon)

        def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
            return double.add_rms_norm(x1, x2, gamma, epsilon)

        for fn in (npu_rms_norm, npu_gemma_rms_norm, npu_add_rms_norm):
            if fn.__name__ not in without:
                fn.__module__ = "torch_npu"
                setattr(module, fn.__name__, fn)
        self.module = module

    @property
    def family(self) -> str:
        return _family(self.soc_version)

    # ---- checks shared by the kernels ----------------------------------------------------------

    def _check(self, op: str, x: torch.Tensor, gamma: torch.Tensor, epsilon, *, min_dim: int,
               mixed_gamma: bool = False, empty: bool = True) -> None:
        _fail(isinstance(x, torch.Tensor) and isinstance(gamma, torch.Tensor), f"{op}: expected tensors")
        _fail(isinstance(epsilon, (int, float)) and not isinstance(epsilon, bool),
              f"{op}: epsilon must be a float, got {type(epsilon).__name__}")
        _fail(x.dtype in FLOATS, f"{op}: x dtype {x.dtype} not supported (float32, float16, bfloat16)")
        if self.family == "310p":
            _fail(x.dtype != torch.bfloat16, f"{op}: bfloat16 is not supported on Atlas inference products")
        _fail(min_dim <= x.dim() <= 8, f"{op}: x must have {min_dim}-8 dims, got {x.dim()}")
        _fail(1 <= gamma.dim() <= x.dim(), "The gamma shape should not be bigger than self shape.")
        _fail(tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim():]),
              f"{op}: gamma shape {list(gamma.shape)} must equal x's trailing dims of {list(x.shape)}")
        _fail(gamma.numel() > 0, f"{op}: gamma must not be empty")
        same = gamma.dtype == x.dtype
        mixed = (mixed_gamma and self.family != "310p" and gamma.dtype == torch.float32
                 and x.dtype in (torch.float16, torch.bfloat16))
        _fail(same or mixed, f"{op}: gamma dtype {gamma.dtype} does not match x dtype {x.dtype}")
        if not empty:
            _fail(x.numel() > 0, f"{op}: empty tensors are not supported")

    # ---- the kernels ---------------------------------------------------------------------------

    def rms_norm(self, x, gamma, epsilon):
        self.calls.append(("npu_rms_norm", (x, gamma, epsilon)))
        self._check("npu_rms_norm", x, gamma, epsilon, min_dim=2, mixed_gamma=True)
        if self.family == "310p":
            _fail(x.shape[-1] * x.element_size() >= 32, "npu_rms_norm: the last axis must be at least 32 bytes")
        xf = x.float()
        rstd = _rstd(xf, gamma.dim(), float(epsilon))
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def gemma_rms_norm(self, x, gamma, epsilon):
        self.calls.append(("npu_gemma_rms_norm", (x, gamma, epsilon)))
        _fail(self.family in ("a2", "a3"),
              f"npu_gemma_rms_norm: GemmaRmsNorm has no kernel for SoC version {self.soc_version}")
        self._check("npu_gemma_rms_norm", x, gamma, epsilon, min_dim=1, empty=False)
        _fail(x.is_contiguous() and gamma.is_contiguous(), "npu_gemma_rms_norm: non-contiguous tensors are not supported")
        xf = x.float()
        rstd = _rstd(xf, gamma.dim(), float(epsilon))
        return (xf * rstd * (gamma.float() + 1.0)).to(x.dtype), rstd

    def add_rms_norm(self, x1, x2, gamma, epsilon):
        self.calls.append(("npu_add_rms_norm", (x1, x2, gamma, epsilon)))
        self._check("npu_add_rms_norm", x1, gamma, epsilon, min_dim=1, empty=False)
        _fail(isinstance(x2, torch.Tensor) and x2.shape == x1.shape and x2.dtype == x1.dtype,
              "npu_add_rms_norm: x2 must have x1's shape and dtype")
        x = x1 + x2  # rounded to x1's dtype, as the kernel's xOut
        xf = x.float()
        rstd = _rstd(xf, gamma.dim(), float(epsilon))
        normed = xf * rstd
        if x1.dtype == torch.float32:
            y = normed * gamma
        elif x1.dtype == torch.float16:
            y = normed.to(torch.float16) * gamma  # fp16 product, as the kernel's half Mul
        else:
            y = (normed.to(torch.bfloat16).float() * gamma.float()).to(torch.bfloat16)
        return y, rstd, x


@contextlib.contextmanager
def installed(double: TorchNpuDouble | None = None, **kwargs) -> Iterator[TorchNpuDouble]:
    """Put ``double`` (or ``TorchNpuDouble(**kwargs)``) at ``sys.modules["torch_npu"]`` for the
    duration; whatever was there before is restored."""
    double = double if double is not None else TorchNpuDouble(**kwargs)
    missing = object()
    before = sys.modules.get("torch_npu", missing)
    sys.modules["torch_npu"] = double.module
    try:
        yield double
    finally:
        if before is missing:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = before
