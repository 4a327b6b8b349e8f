"""``triton``: this project's own Triton kernels for both ops, channel-last, for CUDA.

Prefill is two launches. The first is token-major: a program covers ``BLOCK_T`` consecutive
tokens of the packed (or dense) input by ``BLOCK_D`` channels and walks its tokens in order,
loading each input row once and keeping the last W-1 rows in registers (a sliding window), so
that no tap reloads a tile; each token finds its sequence (dense: ``t // L``; varlen: a
per-token sequence id from ``searchsorted`` on ``query_start_loc``, no host sync), and a tap
that falls before the sequence's first token reads the history rows of its slot instead. The
second launch writes the new history (last W-1 rows of history ++ tokens), one program per
sequence and channel block, after every read of the old history has happened. Decode is one
launch, one program per sequence and channel block: it reads the history and the rows the new
slot is built from, then (after a barrier) writes the slot and the output.

Every tensor is addressed through its strides, so the state lands in the caller's pool also when
it is a non-contiguous view. Arithmetic in fp32, results cast to x's dtype. A slot id outside
``[0, N)`` (or, in decode, a ``num_accepted_tokens`` outside ``1..L``), which reaches a kernel
only off the CPU (where the dispatcher counts such values on the device instead of reading
them) or with ``KV_CHECK_VALUES=0``, is treated as a pad, as vLLM's kernels mask
``coord < num_cache_lines``: zero output, nothing read or written, never memory outside the
pool. The variants declare it (``slot_bounds_safe``), so the dispatcher hands them the caller's
indices as they are instead of rewriting them first. Launches run under ``x``'s device (``torch.cuda.device``), so a tensor on another GPU
than the current one is never handed to a kernel compiled and launched for the current one.
Nothing reads a tensor's values on the host: the variants are declared graph_safe.

Block sizes are chosen per shape by the calibrator: besides ``triton`` (a heuristic choice),
each configuration in ``FN_CONFIGS`` / ``UPDATE_CONFIGS`` is registered as its own variant id
(``triton_d64_t32``...). The kernels are built on first use, so ``import kernel_variants``
works without triton; they run on CUDA, or on the CPU under the Triton interpreter when
``TRITON_INTERPRET=1`` is set before they are first used (the variants then also declare the
CPU, at a priority below every native CPU variant, since the interpreter is very slow).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kernel_variants._registry import Variant, hookimpl
from kernel_variants.kernels._adapters import dist_version, mark_written
from kernel_variants.ops.causal_conv1d import ConvCapabilities

# What the kernel's speed depends on besides its source: its rows go stale when one changes.
DEPENDS = ("triton", "torch")

MAX_WIDTH = 8
MIN_TRITON = (3, 4)


def installed_triton() -> str:
    """The installed triton, from package metadata (nothing imported)."""
    return dist_version("triton", "pytorch-triton", "pytorch-triton-rocm")


def interpreting() -> bool:
    """Whether Triton will interpret kernels (``TRITON_INTERPRET``), read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def probe() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed (pip install triton)"
    installed = installed_triton()
    found = re.match(r"triton-(\d+)\.(\d+)", installed.replace("pytorch-", ""))
    if found and (int(found[1]), int(found[2])) < MIN_TRITON:
        return (f"{installed} is older than triton {MIN_TRITON[0]}.{MIN_TRITON[1]} (the kernels take "
                "triton.language from a closure, which triton.jit resolves since 3.4)")
    if interpreting():
        return None
    if not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run on CPU under the interpreter)"
    return None


@functools.cache
def kernels(interpret: bool) -> SimpleNamespace:
    """The jitted kernels. ``triton.jit`` decides at decoration time whether to interpret, so
    they are built per mode, on first use. They call only triton.language builtins, never its
    jitted helpers (``tl.zeros``, ``tl.sigmoid``...): those were decorated when triton was
    imported, in the mode of that moment, and fail under the interpreter if that was compiled."""
    del interpret  # only the cache key: triton reads TRITON_INTERPRET itself, now
    import triton
    import triton.language as tl

    @triton.jit
    def fn_conv(x_ptr, w_ptr, b_ptr, st_ptr, ci_ptr, init_ptr, qsl_ptr, seq_ptr, out_ptr,
                T, D, L, S, N, pad_slot_id,
                sx_t, sx_d, sw_d, sw_k, ss_n, ss_s, ss_d, so_t, so_d,
                W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_HIST: tl.constexpr,
                HAS_CI: tl.constexpr, VARLEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t0 = tl.program_id(0) * BLOCK_T
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        xd = d * sx_d
        # Weights by lag: lag m multiplies token t-m, the weight column W-1-m. Up to MAX_WIDTH = 8.
        wb = w_ptr + d * sw_d
        w0 = tl.load(wb + (W - 1) * sw_k, mask=d_ok, other=0.0).to(tl.float32)
        if W > 1:
            w1 = tl.load(wb + (W - 2) * sw_k, mask=d_ok, other=0.0).to(tl.float32)
        if W > 2:
            w2 = tl.load(wb + (W - 3) * sw_k, mask=d_ok, other=0.0).to(tl.float32)
        if W > 3:
            w3 = tl.load(wb + (W - 4) * sw_k, mask=d_ok, other=0.0).to(tl.float32)
        if W > 4:
            w4 = tl.load(wb + (W - 5) * sw_k, mask=d_ok, other=0.0).to(tl.float32)
        if W > 5:
            w5 = tl.load(wb + (W - 6) * sw_k, mask=d_ok, other=0.0).to(tl.float32)
        if W > 6:
            w6 = tl.load(wb + (W - 7) * sw_k, mask=d_ok, other=0.0).to(tl.float32)
        if W > 7:
            w7 = tl.load(wb + (W - 8) * sw_k, mask=d_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        # The register window c_m: rows t0-m, m = 1..W-1. A row of another sequence is never used:
        # a tap reads the window only while it stays inside the token's own sequence.
        xb = x_ptr + t0.to(tl.int64) * sx_t + xd
        if W > 1:
            c1 = tl.load(xb - sx_t, mask=d_ok & (t0 + d * 0 >= 1), other=0.0).to(tl.float32)
        if W > 2:
            c2 = tl.load(xb - 2 * sx_t, mask=d_ok & (t0 + d * 0 >= 2), other=0.0).to(tl.float32)
        if W > 3:
            c3 = tl.load(xb - 3 * sx_t, mask=d_ok & (t0 + d * 0 >= 3), other=0.0).to(tl.float32)
        if W > 4:
            c4 = tl.load(xb - 4 * sx_t, mask=d_ok & (t0 + d * 0 >= 4), other=0.0).to(tl.float32)
        if W > 5:
            c5 = tl.load(xb - 5 * sx_t, mask=d_ok & (t0 + d * 0 >= 5), other=0.0).to(tl.float32)
        if W > 6:
            c6 = tl.load(xb - 6 * sx_t, mask=d_ok & (t0 + d * 0 >= 6), other=0.0).to(tl.float32)
        if W > 7:
            c7 = tl.load(xb - 7 * sx_t, mask=d_ok & (t0 + d * 0 >= 7), other=0.0).to(tl.float32)
        steps = tl.minimum(T - t0, BLOCK_T)
        for i in range(0, steps):
            t = t0 + i
            if VARLEN:
                b = tl.load(seq_ptr + t)
                start = tl.load(qsl_ptr + b).to(tl.int64)
            else:
                b = t // L
                start = (b * L).to(tl.int64)
            pos = t - start
            if HAS_CI:
                slot = tl.load(ci_ptr + b).to(tl.int64)
                live = (slot != pad_slot_id) & (slot >= 0) & (slot < N)  # outside the pool: a pad
                slot = tl.where(live, slot, 0)
            else:
                slot = b.to(tl.int64)
                live = t >= 0
            hist_ok = live
            if HAS_HIST:
                hist_ok = live & (tl.load(init_ptr + b) != 0)
            # Lag m reads the window c_m while the token t-m is in the sequence (pos >= m), else
            # history row S-m+pos of the slot. Vectors over the channels: scalar & vector masks
            # trip the interpreter.
            posv = pos + d * 0
            histv = d_ok & ((d * 0 + hist_ok.to(tl.int32)) != 0)
            hp = st_ptr + slot * ss_n + (S + posv) * ss_s + d * ss_d
            xr = tl.load(x_ptr + t.to(tl.int64) * sx_t + xd, mask=d_ok, other=0.0).to(tl.float32)
            acc = xr * w0
            if W > 1:
                v = tl.where(posv >= 1, c1, 0.0)
                if HAS_HIST:
                    v += tl.load(hp - 1 * ss_s, mask=histv & (posv < 1), other=0.0).to(tl.float32)
                acc += v * w1
            if W > 2:
                v = tl.where(posv >= 2, c2, 0.0)
                if HAS_HIST:
                    v += tl.load(hp - 2 * ss_s, mask=histv & (posv < 2), other=0.0).to(tl.float32)
                acc += v * w2
            if W > 3:
                v = tl.where(posv >= 3, c3, 0.0)
                if HAS_HIST:
                    v += tl.load(hp - 3 * ss_s, mask=histv & (posv < 3), other=0.0).to(tl.float32)
                acc += v * w3
            if W > 4:
                v = tl.where(posv >= 4, c4, 0.0)
                if HAS_HIST:
                    v += tl.load(hp - 4 * ss_s, mask=histv & (posv < 4), other=0.0).to(tl.float32)
                acc += v * w4
            if W > 5:
                v = tl.where(posv >= 5, c5, 0.0)
                if HAS_HIST:
                    v += tl.load(hp - 5 * ss_s, mask=histv & (posv < 5), other=0.0).to(tl.float32)
                acc += v * w5
            if W > 6:
                v = tl.where(posv >= 6, c6, 0.0)
                if HAS_HIST:
                    v += tl.load(hp - 6 * ss_s, mask=histv & (posv < 6), other=0.0).to(tl.float32)
                acc += v * w6
            if W > 7:
                v = tl.where(posv >= 7, c7, 0.0)
                if HAS_HIST:
                    v += tl.load(hp - 7 * ss_s, mask=histv & (posv < 7), other=0.0).to(tl.float32)
                acc += v * w7
            if HAS_BIAS:
                acc += bias
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            acc = tl.where(live, acc, 0.0)
            tl.store(out_ptr + t.to(tl.int64) * so_t + d * so_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)
            # Slide the window by one token.
            if W > 7:
                c7 = c6
            if W > 6:
                c6 = c5
            if W > 5:
                c5 = c4
            if W > 4:
                c4 = c3
            if W > 3:
                c3 = c2
            if W > 2:
                c2 = c1
            if W > 1:
                c1 = xr

    @triton.jit
    def fn_state(x_ptr, st_ptr, ci_ptr, init_ptr, qsl_ptr, D, L, S, N, pad_slot_id,
                 sx_t, sx_d, ss_n, ss_s, ss_d,
                 W: tl.constexpr, HAS_HIST: tl.constexpr, HAS_CI: tl.constexpr, VARLEN: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        if VARLEN:
            start = tl.load(qsl_ptr + b).to(tl.int64)
            length = tl.load(qsl_ptr + b + 1).to(tl.int64) - start
        else:
            start = b.to(tl.int64) * L
            length = L
        if HAS_CI:
            slot = tl.load(ci_ptr + b).to(tl.int64)
            live = (slot != pad_slot_id) & (slot >= 0) & (slot < N)  # outside the pool: a pad
        else:
            slot = b.to(tl.int64)
            live = True
        if live:
            r = tl.arange(0, BLOCK_R)
            r_ok = r < W - 1
            j = length + r  # position in history ++ tokens of the row that becomes history row r
            in_x = j >= W - 1
            xrow = tl.where(in_x, start + j - (W - 1), 0)
            new = tl.load(x_ptr + xrow[:, None] * sx_t + d[None, :] * sx_d,
                          mask=(r_ok & in_x)[:, None] & d_ok[None, :], other=0.0)
            if HAS_HIST:
                init = tl.load(init_ptr + b + r * 0) != 0  # a vector: scalar & vector masks trip the interpreter
                hrow = tl.where(in_x, 0, S - (W - 1) + j)
                old = tl.load(st_ptr + slot * ss_n + hrow[:, None] * ss_s + d[None, :] * ss_d,
                              mask=(r_ok & (j < W - 1) & init)[:, None] & d_ok[None, :], other=0.0)
                new = tl.where(in_x[:, None], new, old)
            tl.debug_barrier()  # every read of the old history before any write
            tl.store(st_ptr + slot * ss_n + (S - (W - 1) + r)[:, None] * ss_s + d[None, :] * ss_d,
                     new.to(st_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])

    @triton.jit
    def update(x_ptr, w_ptr, b_ptr, st_ptr, ci_ptr, nat_ptr, out_ptr,
               D, L, S, N, KEPT, OFFSET, pad_slot_id,
               sx_b, sx_t, sx_d, sw_d, sw_k, ss_n, ss_s, ss_d, so_b, so_t, so_d,
               W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_CI: tl.constexpr,
               SPEC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        i = tl.arange(0, BLOCK_L)
        i_ok = i < L
        x_base = x_ptr + b.to(tl.int64) * sx_b
        o_ptrs = out_ptr + b.to(tl.int64) * so_b + i[:, None] * so_t + d[None, :] * so_d
        o_mask = i_ok[:, None] & d_ok[None, :]
        if HAS_CI:
            slot = tl.load(ci_ptr + b).to(tl.int64)
            live = (slot != pad_slot_id) & (slot >= 0) & (slot < N)  # outside the pool: a pad
        else:
            slot = b.to(tl.int64)
            live = slot >= 0
        if SPEC:
            shift = tl.load(nat_ptr + b).to(tl.int64)
            live = live & (shift >= 1) & (shift <= L)  # any other count would address rows outside the slot
            hist0 = shift - 1
        else:
            shift = 0
            hist0 = S - (W - 1)
        if live:
            s_base = st_ptr + slot * ss_n
            acc = tl.full((BLOCK_L, BLOCK_D), 0.0, tl.float32)
            for k in tl.static_range(W):
                j = i + k
                in_x = j >= W - 1
                xv = tl.load(x_base + tl.where(in_x, j - (W - 1), 0)[:, None] * sx_t + d[None, :] * sx_d,
                             mask=(i_ok & in_x)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                hv = tl.load(s_base + tl.where(in_x, 0, hist0 + j)[:, None] * ss_s + d[None, :] * ss_d,
                             mask=(i_ok & (j < W - 1))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                wk = tl.load(w_ptr + d * sw_d + k * sw_k, mask=d_ok, other=0.0).to(tl.float32)
                acc += (xv + hv) * wk[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            # New slot row r is row OFFSET + r of (old[shift : shift + KEPT] ++ x).
            r = tl.arange(0, BLOCK_S)
            r_ok = r < S
            u = OFFSET + r
            from_old = u < KEPT
            ov = tl.load(s_base + tl.where(from_old, shift + u, 0)[:, None] * ss_s + d[None, :] * ss_d,
                         mask=(r_ok & from_old)[:, None] & d_ok[None, :], other=0.0)
            nv = tl.load(x_base + tl.where(from_old, 0, u - KEPT)[:, None] * sx_t + d[None, :] * sx_d,
                         mask=(r_ok & (u >= KEPT))[:, None] & d_ok[None, :], other=0.0)
            new = tl.where(from_old[:, None], ov, nv.to(ov.dtype))
            tl.debug_barrier()  # every read of the old slot before any write
            tl.store(s_base + r[:, None] * ss_s + d[None, :] * ss_d, new, mask=r_ok[:, None] & d_ok[None, :])
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            tl.store(o_ptrs, tl.full((BLOCK_L, BLOCK_D), 0, out_ptr.dtype.element_ty), mask=o_mask)

    return SimpleNamespace(fn_conv=fn_conv, fn_state=fn_state, update=update, cdiv=triton.cdiv,
                           next_power_of_2=triton.next_power_of_2)


@dataclass(frozen=True)
class FnBlocks:
    d: int  # channels per program
    t: int  # tokens per program

    @property
    def id(self) -> str:
        return f"triton_d{self.d}_t{self.t}"


@dataclass(frozen=True)
class UpdateBlocks:
    d: int

    @property
    def id(self) -> str:
        return f"triton_d{self.d}"


FN_CONFIGS = (FnBlocks(32, 64), FnBlocks(64, 32), FnBlocks(128, 16), FnBlocks(256, 8))
UPDATE_CONFIGS = (UpdateBlocks(32), UpdateBlocks(64), UpdateBlocks(128), UpdateBlocks(256))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fn_heuristic(tokens: int, dim: int) -> FnBlocks:
    """Fill the GPU with programs first, then widen the channel block."""
    d = min(128, max(16, _pow2(dim)))
    t = 32 if tokens >= 4096 else 16
    return FnBlocks(d, t)


def update_heuristic(batch: int, dim: int) -> UpdateBlocks:
    return UpdateBlocks(min(256 if batch <= 16 else 128, max(16, _pow2(dim))))


def device_guard(t: torch.Tensor):
    """Launch under ``t``'s device: Triton compiles for and launches on the current device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def causal_conv1d_fn(x, weight, bias=None, *, conv_states=None, cache_indices=None, has_initial_state=None,
                     query_start_loc=None, activation=None, pad_slot_id=-1, blocks: FnBlocks | None = None,
                     out=None):
    """x: [B, L, D], or [T, D] with query_start_loc; weight: [D, W]; conv_states: [N, S, D]
    updated in place; returns x's shape and dtype (contiguous), or writes ``out`` (contiguous,
    x's shape and dtype, not x) and returns it."""
    k = kernels(interpreting())
    width = weight.shape[1]
    varlen = query_start_loc is not None
    x2 = x if varlen else x.reshape(-1, x.shape[-1])  # a view for the usual contiguous x
    tokens, dim = x2.shape
    length = 1 if varlen else x.shape[1]
    batch = query_start_loc.shape[0] - 1 if varlen else x.shape[0]
    blocks = blocks or fn_heuristic(tokens, dim)
    given = out
    out = torch.empty((tokens, dim), dtype=x.dtype, device=x.device) if given is None else given.view(tokens, dim)
    has_states = conv_states is not None
    has_hist = has_states and has_initial_state is not None
    dummy = out  # stands in for absent pointers; never dereferenced
    st = conv_states if has_states else dummy
    ci = cache_indices.contiguous() if cache_indices is not None else dummy
    init = has_initial_state.contiguous().view(torch.uint8) if has_hist else dummy
    qsl = query_start_loc.contiguous() if varlen else dummy
    seq = dummy
    if varlen:
        seq = torch.searchsorted(qsl, torch.arange(tokens, device=x.device, dtype=qsl.dtype), right=True) - 1
    rows = conv_states.shape[1] if has_states else width - 1
    n_slots = conv_states.shape[0] if has_states else 0
    ss = conv_states.stride() if has_states else (0, 0, 0)
    with device_guard(x):
        if tokens > 0:
            grid = (k.cdiv(tokens, blocks.t), k.cdiv(dim, blocks.d))
            k.fn_conv[grid](
                x2, weight, bias.contiguous() if bias is not None else dummy, st, ci, init, qsl, seq, out,
                tokens, dim, length, rows, n_slots, pad_slot_id,
                x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), *ss, out.stride(0), out.stride(1),
                W=width, HAS_BIAS=bias is not None, SILU=activation is not None, HAS_HIST=has_hist,
                HAS_CI=cache_indices is not None, VARLEN=varlen, BLOCK_T=blocks.t, BLOCK_D=blocks.d)
        if has_states and width > 1:
            grid = (batch, k.cdiv(dim, blocks.d))
            k.fn_state[grid](
                x2, st, ci, init, qsl, dim, length, rows, n_slots, pad_slot_id, x2.stride(0), x2.stride(1), *ss,
                W=width, HAS_HIST=has_hist, HAS_CI=cache_indices is not None, VARLEN=varlen,
                BLOCK_R=_pow2(width - 1), BLOCK_D=blocks.d)
    mark_written(given, conv_states)
    if given is not None:
        return given
    return out if varlen else out.view(x.shape)


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None, conv_state_indices=None,
                         num_accepted_tokens=None, pad_slot_id=-1, blocks: UpdateBlocks | None = None, out=None):
    """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place; weight: [D, W]. Returns
    x's shape and dtype, or writes ``out`` (x's shape and dtype, not x; any strides)."""
    k = kernels(interpreting())
    x3 = x.unsqueeze(1) if x.ndim == 2 else x
    batch, length, dim = x3.shape
    width = weight.shape[1]
    rows = conv_state.shape[1]
    spec = num_accepted_tokens is not None
    blocks = blocks or update_heuristic(batch, dim)
    given = out
    if given is None:
        out = torch.empty((batch, length, dim), dtype=x.dtype, device=x.device)
    else:
        out = given.unsqueeze(1) if x.ndim == 2 else given
    kept = max(rows - length, 0) if spec else rows  # rows of the old slot in the stream old ++ x
    offset = kept + length - rows  # first stream row of the new slot
    dummy = out
    grid = (batch, k.cdiv(dim, blocks.d))
    with device_guard(x):
        k.update[grid](
            x3, weight, bias.contiguous() if bias is not None else dummy, conv_state,
            conv_state_indices.contiguous() if conv_state_indices is not None else dummy,
            num_accepted_tokens.contiguous() if spec else dummy, out,
            dim, length, rows, conv_state.shape[0], kept, offset, pad_slot_id,
            *x3.stride(), weight.stride(0), weight.stride(1), *conv_state.stride(), *out.stride(),
            W=width, HAS_BIAS=bias is not None, SILU=activation is not None, HAS_CI=conv_state_indices is not None,
            SPEC=spec, BLOCK_L=_pow2(length), BLOCK_S=_pow2(rows), BLOCK_D=blocks.d)
    mark_written(given, conv_state)
    if given is not None:
        return given
    return out.squeeze(1) if x.ndim == 2 else out


def _caps(**extra) -> ConvCapabilities:
    devices = {"cuda", "cpu"} if interpreting() else {"cuda"}
    return ConvCapabilities(devices=devices, dtypes={"float32", "bfloat16", "float16"}, width=(1, MAX_WIDTH),
                            noncontiguous_states=True, graph_safe=True, slot_bounds_safe=True, takes_out=True, **extra)


def _bind(fn, blocks):
    def run(*args, **kwargs):
        return fn(*args, blocks=blocks, **kwargs)

    run.__qualname__ = f"{fn.__qualname__}[{blocks.id}]"
    return run


def variants() -> list[Variant]:
    # Under the interpreter the kernels claim the CPU too, where they are far slower than any
    # native variant: ranked below them, they run there only when forced or measured.
    base = -50 if interpreting() else 15
    version = "1"
    fn_caps, update_caps = _caps(varlen=True), _caps(num_accepted_tokens=True)
    out = [
        Variant(id="triton", op="causal_conv1d_fn", version=version, depends=DEPENDS, fn=causal_conv1d_fn, probe=probe, priority=base,
                capabilities=fn_caps, description="Triton prefill, block sizes by a heuristic"),
        Variant(id="triton", op="causal_conv1d_update", version=version, depends=DEPENDS, fn=causal_conv1d_update, probe=probe,
                priority=base, capabilities=update_caps, description="Triton decode, block sizes by a heuristic"),
    ]
    out += [Variant(id=c.id, op="causal_conv1d_fn", version=version, depends=DEPENDS, fn=_bind(causal_conv1d_fn, c), probe=probe,
                    priority=base - 5, capabilities=fn_caps, description=f"Triton prefill, BLOCK_D={c.d} BLOCK_T={c.t}")
            for c in FN_CONFIGS]
    out += [Variant(id=c.id, op="causal_conv1d_update", version=version, depends=DEPENDS, fn=_bind(causal_conv1d_update, c), probe=probe,
                    priority=base - 5, capabilities=update_caps, description=f"Triton decode, BLOCK_D={c.d}")
            for c in UPDATE_CONFIGS]
    return out


@hookimpl
def kv_register_variants(register) -> None:
    for v in variants():
        register(v)
