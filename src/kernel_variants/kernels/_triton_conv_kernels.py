"""The jitted bodies of the ``triton`` conv variants (see :mod:`.triton_conv` for how they are
launched and why they are written the way they are)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

MAX_WIDTH = 8


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
    def update(x_ptr, w_ptr, b_ptr, st_ptr, ci_ptr, nat_ptr, out_ptr, cnt_ptr,
               D, L, S, N, KEPT, OFFSET, pad_slot_id,
               sx_b, sx_t, sx_d, sw_d, sw_k, ss_n, ss_s, ss_d, so_b, so_t, so_d,
               W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_CI: tl.constexpr,
               SPEC: tl.constexpr, COUNT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
        b = tl.program_id(0)
        if COUNT:
            # The device rule's counts, made here rather than in a launch of their own: the first
            # channel block of sequence b counts b's bad values (kinds as device_errors.KINDS).
            first = tl.program_id(1) == 0
            if HAS_CI:
                sb = tl.load(ci_ptr + b).to(tl.int64)
                in_pool = (sb >= 0) & (sb < N)
                tl.atomic_add(cnt_ptr + 0, 1, mask=first & ~in_pool & (sb != pad_slot_id))
                # A live slot that an earlier sequence also holds: per slot used k times, k - 1.
                dup = b < 0
                for j0 in range(0, b, BLOCK_B):
                    j = j0 + tl.arange(0, BLOCK_B)
                    sj = tl.load(ci_ptr + j, mask=j < b, other=-1).to(tl.int64)
                    same = ((j < b) & (sj == sb)).to(tl.int32)
                    dup = dup | (tl.reduce(same, 0, tl.standard._sum_combine) > 0)  # triton's own combiner
                tl.atomic_add(cnt_ptr + 1, 1, mask=first & in_pool & (sb != pad_slot_id) & dup)
            if SPEC:
                nb = tl.load(nat_ptr + b).to(tl.int64)
                tl.atomic_add(cnt_ptr + 2, 1, mask=first & ((nb < 1) | (nb > L)))
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

    return SimpleNamespace(fn_conv=fn_conv, fn_state=fn_state, update=update,
                           next_power_of_2=triton.next_power_of_2)
