"""Gemma RMSNorm in Triton (the semantics of sgl-kernel-npu's ``gemma_rms_norm`` /
``add_gemma_rms_norm``), for CUDA, or for the CPU under the Triton interpreter; the same kernel
with a scale offset of 0, an optional weight and a ``variance_size`` serves the plain RMSNorm
ops (vLLM IR's ``rms_norm`` / ``fused_add_rms_norm``).

``out = s * rsqrt(mean(s^2 over the last dim) + eps) * (1 + weight)``, in fp32, cast to x's
dtype; ``s`` is ``x``, or with a residual ``x + residual`` rounded to x's dtype first (exactly
torch's ``x + residual``), which is also returned.

One program normalises ``BLOCK_R`` rows of ``BLOCK_D`` channels. When the row fits one block
(``D <= max_block_d``, default ``MAX_BLOCK_D``) it is read once and kept in registers, and
short rows are packed several to a program (``BLOCK_R * BLOCK_D`` about ``ROW_TILE``
elements) so that a program still moves a useful amount of memory. Longer rows are walked in
chunks of ``max_block_d`` channels twice: the sum of squares, then the normalisation (the
second pass re-reads x and, with a residual, recomputes the rounded sum rather than reading
back what the first pass stored).

Like the kernels in ``triton_conv``, these are built on first use per interpreter mode, take
``triton.language`` from a closure, address rows through an explicit row stride (the last dim
must have stride 1: a view is made contiguous only when that or flattening fails) and call no
jitted helper of triton.language (the row reduction is ``tl.reduce`` with triton's own sum
combiner, which the interpreter also recognises, instead of ``tl.sum``, which is a jitted
helper and fails under the interpreter when triton was imported before ``TRITON_INTERPRET``).

A bf16 ``x + residual`` is rounded to bf16 by integer arithmetic on the fp32 bits (to nearest,
ties to even, NaN kept) rather than by ``.to(tl.bfloat16)``: on a GPU both are the same, but the
interpreter's fp32 -> bf16 cast truncates, and the sum must equal torch's bit for bit. (The
interpreter still truncates the bf16 *output* cast, within tolerance, and flushes bf16
subnormal inputs to zero when converting them to fp32; neither happens on a GPU.)
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from kernel_variants.kernels._adapters import mark_written
from kernel_variants.kernels._triton import DEPENDS, cdiv, device_guard, interpreting, pow2, probe
from kernel_variants.ops.rms_norm import NormCapabilities
from kernel_variants.plugin import Capabilities, Variant, hookimpl

MAX_BLOCK_D = 8192  # widest row kept in registers in one pass; longer rows go in chunks of this
ROW_TILE = 2048  # elements per program that short rows are packed up to
MAX_ROWS = 16  # at most this many rows per program
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def kernels(interpret: bool) -> SimpleNamespace:
    """The jitted kernel, built per interpreter mode (``triton.jit`` reads ``TRITON_INTERPRET``
    when it decorates)."""
    del interpret  # only the cache key
    import triton
    import triton.language as tl

    @triton.jit
    def gemma_rms(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, T, D, V, eps, offset, sx, sr, sw, so, ss,
                  HAS_RES: tl.constexpr, HAS_W: tl.constexpr, RNE_BF16: tl.constexpr, CHUNKED: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # The scale is offset + w (Gemma: 1 + w; plain RMSNorm: w, or 1 without HAS_W); the mean
        # of squares is over the first V channels (V = D, or vLLM's variance_size).
        # RNE_BF16: x + residual is rounded to bf16 by hand (to nearest, ties to even, NaN kept):
        # the interpreter's fp32 -> bf16 cast truncates, and the sum must equal torch's x + residual.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < T
        x_row = x_ptr + rows[:, None] * sx
        r_row = r_ptr + rows[:, None] * sr
        o_row = out_ptr + rows[:, None] * so
        s_row = sum_ptr + rows[:, None] * ss
        cols = tl.arange(0, BLOCK_D)
        if CHUNKED:
            acc = tl.full((BLOCK_R, BLOCK_D), 0.0, tl.float32)
            for off in range(0, D, BLOCK_D):
                c = off + cols
                m = r_ok[:, None] & (c < D)[None, :]
                s = tl.load(x_row + c[None, :], mask=m, other=0.0)
                if HAS_RES:
                    r = tl.load(r_row + c[None, :], mask=m, other=0.0)
                    s = s.to(tl.float32) + r.to(tl.float32)
                    if RNE_BF16:
                        b = s.to(tl.uint32, bitcast=True)
                        rne = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
                        s = tl.where(s == s, rne, s)
                    s = s.to(x_ptr.dtype.element_ty)
                    tl.store(s_row + c[None, :], s, mask=m)
                s = s.to(tl.float32)
                acc += tl.where((c < V)[None, :], s * s, 0.0)
            rstd = tl.rsqrt(tl.reduce(acc, 1, tl.standard._sum_combine) / V + eps)
            for off in range(0, D, BLOCK_D):
                c = off + cols
                c_ok = c < D
                m = r_ok[:, None] & c_ok[None, :]
                s = tl.load(x_row + c[None, :], mask=m, other=0.0)
                if HAS_RES:
                    r = tl.load(r_row + c[None, :], mask=m, other=0.0)
                    s = s.to(tl.float32) + r.to(tl.float32)
                    if RNE_BF16:
                        b = s.to(tl.uint32, bitcast=True)
                        rne = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
                        s = tl.where(s == s, rne, s)
                    s = s.to(x_ptr.dtype.element_ty)
                s = s.to(tl.float32)
                y = s * rstd[:, None]
                if HAS_W:
                    w = tl.load(w_ptr + c * sw, mask=c_ok, other=0.0).to(tl.float32)
                    y = y * (offset + w[None, :])
                tl.store(o_row + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
        else:
            c_ok = cols < D
            m = r_ok[:, None] & c_ok[None, :]
            s = tl.load(x_row + cols[None, :], mask=m, other=0.0)
            if HAS_RES:
                r = tl.load(r_row + cols[None, :], mask=m, other=0.0)
                s = s.to(tl.float32) + r.to(tl.float32)
                if RNE_BF16:
                    b = s.to(tl.uint32, bitcast=True)
                    rne = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
                    s = tl.where(s == s, rne, s)
                s = s.to(x_ptr.dtype.element_ty)
                tl.store(s_row + cols[None, :], s, mask=m)
            s = s.to(tl.float32)
            sq = tl.where((cols < V)[None, :], s * s, 0.0)
            rstd = tl.rsqrt(tl.reduce(sq, 1, tl.standard._sum_combine) / V + eps)
            y = s * rstd[:, None]
            if HAS_W:
                w = tl.load(w_ptr + cols * sw, mask=c_ok, other=0.0).to(tl.float32)
                y = y * (offset + w[None, :])
            tl.store(o_row + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)

    return SimpleNamespace(gemma_rms=gemma_rms)


def blocks(tokens: int, dim: int, max_block_d: int = MAX_BLOCK_D) -> tuple[int, int, bool, int]:
    """``(BLOCK_R, BLOCK_D, chunked, num_warps)`` for ``tokens`` rows of ``dim`` channels."""
    if max_block_d < 1 or max_block_d & (max_block_d - 1):
        raise ValueError(f"max_block_d must be a power of two, got {max_block_d}")
    block_d = pow2(dim)
    chunked = block_d > max_block_d
    if chunked:
        block_d = max_block_d
    block_r = max(1, min(MAX_ROWS, ROW_TILE // block_d, pow2(tokens)))
    tile = block_r * block_d
    num_warps = 4 if tile <= 2048 else 8 if tile <= 4096 else 16
    return block_r, block_d, chunked, num_warps


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The [T, D] view of ``t`` with a unit last-dim stride; a contiguous copy only when needed."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims not flattenable as a view
        return t.contiguous().view(-1, t.shape[-1])


def _check(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None = None) -> None:
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if weight is not None:  # None: the plain op without a scale
        if weight.shape != (x.shape[-1],):
            raise ValueError(f"weight must be [{x.shape[-1]}], got {list(weight.shape)}")
        if not weight.is_floating_point():
            raise TypeError(f"weight must be floating point, got {weight.dtype}")
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if residual is not None and (residual.shape, residual.dtype, residual.device) != (x.shape, x.dtype, x.device):
        raise ValueError(f"residual must match x ({list(x.shape)} {x.dtype} on {x.device}), got "
                         f"{list(residual.shape)} {residual.dtype} on {residual.device}")


def _launch(x, weight, residual, eps, max_block_d, out=None, summed=None, *, offset=1.0, variance_size=None):
    # A given out/summed is contiguous (the dispatcher hands only dense ones): row stride D.
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if residual is not None and summed is None:
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() > 0:
        x2 = _rows(x)
        r2 = _rows(residual) if residual is not None else x2
        tokens, dim = x2.shape
        block_r, block_d, chunked, num_warps = blocks(tokens, dim, max_block_d or MAX_BLOCK_D)
        s_ptr = summed if summed is not None else out  # never written without a residual
        k = kernels(interpreting())
        with device_guard(x):
            k.gemma_rms[(cdiv(tokens, block_r),)](
                x2, r2, x2 if weight is None else weight, out, s_ptr, tokens, dim, variance_size or dim, float(eps),
                float(offset), x2.stride(0), r2.stride(0), 0 if weight is None else weight.stride(0), dim, dim,
                HAS_RES=residual is not None, HAS_W=weight is not None, RNE_BF16=residual is not None and x.dtype == torch.bfloat16,
                CHUNKED=chunked, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    mark_written(out, summed)
    return out, summed


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                   max_block_d: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma RMSNorm over the last dim.

    x: [..., D] (T = product of the leading dims; any row stride), float32/bfloat16/float16.
    weight: [D], floating point (usually x's dtype), any stride; applied as ``1 + weight``.
    Returns a new contiguous tensor of x's shape and dtype:
    ``x * rsqrt(mean(x^2, -1) + eps) * (1 + weight)``, computed in fp32.
    max_block_d: a power of two; rows wider than it are normalised in chunks of it (default
    ``MAX_BLOCK_D``). out: a contiguous tensor of x's shape and dtype (not x) to write instead.
    """
    _check(x, weight)
    return _launch(x, weight, None, eps, max_block_d, out)[0]


def add_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float = 1e-6, *,
                       max_block_d: int | None = None,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add, then Gemma RMSNorm over the last dim. Nothing is written in place.

    x, residual: [..., D], same shape and dtype (float32/bfloat16/float16), any row strides.
    weight: [D], floating point, any stride.
    Returns ``(out, residual_sum)``, both new contiguous tensors of x's shape and dtype:
    ``residual_sum = x + residual`` (rounded to x's dtype, bit-equal to torch's ``x + residual``)
    and ``out = gemma_rms_norm(residual_sum, weight, eps)``. out: a pair of contiguous tensors
    of x's shape and dtype (neither an input) to write instead.
    """
    _check(x, weight, residual)
    given = (None, None) if out is None else out
    return _launch(x, weight, residual, eps, max_block_d, *given)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None, *,
             max_block_d: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain RMSNorm (vLLM IR's ``rms_norm``): the Gemma kernel with offset 0, weight optional.

    x: [..., D] (any row stride), float32/bfloat16/float16. weight: [D] (x's dtype or fp32, any
    stride) or None. variance_size: None, or the first channels the mean of squares is over.
    Returns a new contiguous tensor of x's shape and dtype (or ``out``, as in gemma_rms_norm).
    """
    _check(x, weight)
    return _launch(x, weight, None, epsilon, max_block_d, out, offset=0.0, variance_size=variance_size)[0]


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None, *, max_block_d: int | None = None,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then plain RMSNorm (vLLM IR's ``fused_add_rms_norm``); nothing is written in
    place. x, x_residual: [..., D], same shape and dtype. Returns ``(normed, x + x_residual)``
    (the sum rounded to x's dtype, bit-equal to torch's, and normalised as rounded: within the
    dtype's tolerance of vLLM's norm of the fp32 sum), new or the pair ``out``.
    """
    _check(x, weight, x_residual)
    given = (None, None) if out is None else out
    return _launch(x, weight, x_residual, epsilon, max_block_d, *given, offset=0.0, variance_size=variance_size)


@hookimpl
def kv_register_variants(register) -> None:
    # Under the interpreter the kernel claims the CPU too, where it is far slower than any native
    # variant: ranked below them, it runs there only when forced or measured.
    devices = {"cuda", "cpu"} if interpreting() else {"cuda"}
    caps = Capabilities(devices=devices, dtypes={"float32", "bfloat16", "float16"}, takes_out=True)
    common = dict(id="triton", version="1", depends=DEPENDS, probe=probe, capabilities=caps,
                  priority=-50 if interpreting() else 15)
    register(Variant(op="gemma_rms_norm", fn=gemma_rms_norm, description="Triton, one pass per row", **common))
    register(Variant(op="add_gemma_rms_norm", fn=add_gemma_rms_norm,
                     description="Triton, the residual add fused in", **common))
    # The same kernel with offset 0 (and without a weight where there is none).
    plain = {**common, "capabilities": NormCapabilities(**caps.model_dump(), variance_size=True)}
    register(Variant(op="rms_norm", fn=rms_norm, description="Triton, one pass per row (offset 0)", **plain))
    register(Variant(op="fused_add_rms_norm", fn=fused_add_rms_norm,
                     description="Triton, the residual add fused in (offset 0)", **plain))
