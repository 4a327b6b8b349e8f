"""``cpu_native``: fused C++ kernels on the CPU, for the conv ops and the Gemma RMSNorm ops.

One pass per (sequence, channel tile): history rows, the W taps, bias, activation and the
state write-back, vectorised with ATen's ``at::vec`` (AVX2 / AVX-512 chosen at run time),
accumulating in fp32, parallel over batch and channel tiles and, when there are few sequences,
over sequence chunks that re-read the W-1 rows before them. It reads and writes the state pool
through its strides, so a non-contiguous view is updated in place.

The extension is compiled at first use (announced on stderr) or by ``kv build``, into a
persistent per-machine cache (``KV_BUILD_DIR``, default ``~/.cache/kernel_variants/build``); a
complete build is imported as it is, with no ninja or compiler needed (``_native.build.load_built``).
Listing and explaining never build; without a compiler the variant is unavailable with that
reason, and a failed build makes it unavailable with the compiler's first error.
"""

from __future__ import annotations

import functools
import math

import torch

from kernel_variants._native import build
from kernel_variants._native.build import Extension
from kernel_variants.kernels.cpu_native._build import CONV, RMS
from kernel_variants.plugin import Capabilities, ConvCapabilities, Variant, hookimpl


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_states: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    activation: str | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [B, L, D] or [T, D] with query_start_loc [B+1]; weight: [D, W]; bias: [D];
    conv_states: [N, S, D] updated in place (any strides). Returns x's shape: ``out`` when given
    (x's shape and dtype, any strides; it may be x itself, then x is overwritten)."""
    if x.stride(-1) != 1:  # the kernel vectorises along D; weight, bias and state take any strides
        x = _dense(x)
    kernel_out, out = _kernel_out(out)
    res = build.load_extension(CONV).fwd(x, weight, bias, conv_states, cache_indices, has_initial_state,
                                      query_start_loc, activation is not None, pad_slot_id, kernel_out)
    return res if out is None or res is out else out.copy_(res)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place (any strides);
    weight: [D, W]; conv_state_indices, num_accepted_tokens: [B]. Returns x's shape: ``out``
    when given (x's shape and dtype, any strides; it may be x itself, updated in place)."""
    if x.stride(-1) != 1:
        x = _dense(x)
    kernel_out, out = _kernel_out(out)
    res = build.load_extension(CONV).update(x, conv_state, weight, bias, activation is not None,
                                         conv_state_indices, num_accepted_tokens, pad_slot_id, kernel_out)
    return res if out is None or res is out else out.copy_(res)


def _kernel_out(out: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(what the kernel writes into, the caller's out). The kernel takes any row strides but a
    unit channel stride; for another ``out`` it writes a new tensor that is then copied over,
    which also keeps an ``out`` that is a strided x from being read after it is written."""
    if out is None or out.stride(-1) == 1 or out.shape[-1] <= 1:
        return out, out
    return None, out


def isa_path() -> str:
    """Which build of the conv kernel runs on this CPU: "avx512-bf16" (bf16 data), "avx512",
    "avx2" or "scalar" (builds the extension if needed)."""
    return build.load_extension(CONV).isa_path()


def _code_path(ext: Extension) -> str:
    """``isa_path()``, for a variant of ``ext`` that is built (kv list --wide, kv info). Both
    extensions pick their build with the one ``kv_cpu::isa_level()`` (csrc/cpu_common.h), which
    the conv extension reports: the RMSNorm one answers through it, without building it."""
    if ext is not CONV and not build.is_built(CONV):
        return "unknown until the conv kernels are built (kv build)"
    return isa_path()


_CAPS = dict(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, width=(2, 4), noncontiguous_states=True,
             takes_out=True, in_place=True)  # the C++ writes into out, out=x included (reads before writes)


def _native(ext: Extension) -> dict:
    """How a variant of ``ext`` probes, builds and says it is built (one build per extension)."""
    # Its speed depends on the compiler that built it and the ISA path it takes, besides torch.
    return dict(probe=functools.partial(build.toolchain_missing, ext), depends=("torch", "compiler", "isa"),
                build=functools.partial(build.build, ext), is_built=functools.partial(build.is_built, ext),
                code_path=functools.partial(_code_path, ext),
                sources=tuple(str(p) for p in build.source_files(ext)))


_NATIVE = _native(CONV)
_NATIVE_RMS = _native(RMS)


def _dense(t: torch.Tensor) -> torch.Tensor:
    # Not .contiguous(): an empty tensor counts as contiguous whatever its strides, and the
    # kernels check the channel stride of empty inputs too.
    return t.clone(memory_format=torch.contiguous_format)


def _on_dense_slots(pool: torch.Tensor | None, call):
    """``call(pool)`` for a state-pool kernel (the scans'), which takes any slot stride but each
    slot (everything past the first dim) dense: with the pool itself, or with a dense copy that
    is then written back."""
    if pool is not None and any(n > 1 and pool.stride(d) != math.prod(pool.shape[d + 1:])
                                for d, n in enumerate(pool.shape) if d > 0):
        dense = _dense(pool)
        res = call(dense)
        pool.copy_(dense)
        return res
    return call(pool)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [T, D] with unit channel stride: a view when one exists (any row stride)."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:  # a size-1 dim's stride says nothing about layout
        t = _dense(t)
    if t.dim() == 2:  # already rows; a view costs ~1 us, more than the kernel at a decode step's size
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims that cannot be flattened without a copy
        return t.reshape(-1, t.shape[-1])


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., D]; weight: [D] (any stride). Returns a new tensor of x's shape and dtype, or
    ``out`` written (x's shape and dtype; it may be x itself)."""
    ext = build.load_extension(RMS)
    if out is not None and out.shape != x.shape:
        raise ValueError(f"out: expected x's shape {list(x.shape)}, got {list(out.shape)}")
    if out is not None and out.is_contiguous():  # the kernel writes rows of D: a contiguous out directly
        ext.gemma_rms_norm(_rows(x), weight, eps, _rows(out))
        return out
    res = ext.gemma_rms_norm(_rows(x), weight, eps).view(x.shape)
    return res if out is None else out.copy_(res)


def add_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float = 1e-6, *,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D]; weight: [D]. Returns (out, x + residual), new tensors of x's shape,
    or the pair ``out`` written (it may be ``(x, residual)``: sglang's in-place fused add)."""
    ext = build.load_extension(RMS)
    if out is not None and any(o.shape != x.shape for o in out):
        raise ValueError(f"out: expected two tensors of x's shape {list(x.shape)}, got "
                         f"{[list(o.shape) for o in out]}")
    if out is not None and all(o.is_contiguous() for o in out):
        ext.add_gemma_rms_norm(_rows(x), weight, _rows(residual), eps, _rows(out[0]), _rows(out[1]))
        return out[0], out[1]
    o, s = ext.add_gemma_rms_norm(_rows(x), weight, _rows(residual), eps)
    if out is None:
        return o.view(x.shape), s.view(x.shape)
    # Both results are complete before either copy, so an out that is an input is safe.
    return out[0].copy_(o.view(x.shape)), out[1].copy_(s.view(x.shape))


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(
        id="cpu_native", op="causal_conv1d_fn", version="1", fn=causal_conv1d_fn, priority=30, **_NATIVE,
        capabilities=ConvCapabilities(varlen=True, **_CAPS),
        description="fused, vectorised, parallel C++ kernel (at::vec), sequence-chunked for small batches",
    ))
    register(Variant(
        id="cpu_native", op="causal_conv1d_update", version="1", fn=causal_conv1d_update, priority=30, **_NATIVE,
        capabilities=ConvCapabilities(num_accepted_tokens=True, **_CAPS),
        description="fused C++ decode step with in-place state shift",
    ))
    # The C++ writes into out, (x, residual) included: each element is read before it is written.
    rms = Capabilities(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True, in_place=True)
    register(Variant(
        id="cpu_native", op="gemma_rms_norm", version="1", fn=gemma_rms_norm, priority=30, **_NATIVE_RMS,
        capabilities=rms, description="fused C++ row kernel (at::vec), fp32 sum of squares, parallel over rows",
    ))
    register(Variant(
        id="cpu_native", op="add_gemma_rms_norm", version="1", fn=add_gemma_rms_norm, priority=30, **_NATIVE_RMS,
        capabilities=rms, description="fused C++ residual add (rounded to x's dtype) and Gemma RMSNorm",
    ))
