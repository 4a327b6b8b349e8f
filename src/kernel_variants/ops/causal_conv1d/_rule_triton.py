"""The conv device rule as one Triton launch (see :mod:`._device_rule` for what it computes).

One program walks the ``B`` entries in blocks of ``BLOCK``: query_start_loc first (a running
maximum carried from block to block, written out, then a barrier so that every thread reads
the repaired bounds of its neighbour), then each sequence's slot, count and pad, then the
duplicate live slots by comparing each block with every block before it (``O(B^2)`` compares,
any B). The four counts end in the counter with one atomic add each.

Loaded by :func:`._device_rule.triton_module` once per interpreter mode, as a module object of
its own: ``triton.jit`` fixes the mode when it decorates, and the kernel's reductions need
combine functions that are module globals (the interpreter re-executes the kernel's source
without its closure). For the same reason the kernel calls only triton.language builtins, never
its jitted helpers (``tl.sum``, ``tl.max``, ``tl.zeros``): those were decorated in the mode of
triton's first import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The counter's entries, as in kernel_variants._runtime.device_errors.KINDS (a kernel reads only
# constexpr globals).
_SLOT, _DUPLICATE, _ACCEPTED, _QUERY_START = (tl.constexpr(k) for k in range(4))


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


# The sizes are not specialised on (== 1, multiples of 16): one compile per block size and
# dtypes, done by the first eager calls, never inside a graph capture of another batch size.
# The inputs are read through their strides (a slot table's column 0 has the table's row
# stride); the outputs are new and dense.
@triton.jit(do_not_specialize=["B", "N", "pad", "length", "total", "slots_stride", "acc_stride", "qsl_stride"])
def _rule(slots_ptr, acc_ptr, qsl_ptr, counter_ptr, slots_out_ptr, acc_out_ptr, qsl_out_ptr,
          B, N, pad, length, total, slots_stride, acc_stride, qsl_stride,
          HAS_SLOTS: tl.constexpr, HAS_ACC: tl.constexpr, HAS_QSL: tl.constexpr, PAD_GIVEN: tl.constexpr,
          REWRITE: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    if HAS_QSL:
        carry = tl.full([], 0, tl.int64)
        for k0 in range(0, B + 1, BLOCK):
            k = k0 + lane
            ok = k <= B
            v = tl.load(qsl_ptr + k * qsl_stride, mask=ok, other=0).to(tl.int64)
            v = tl.minimum(tl.maximum(v, 0), total)
            v = tl.where(k == B, total, tl.where(k == 0, 0, v))  # the end last, as the composite sets it
            v = tl.where(ok, v, 0)  # every bound is >= 0: 0 never raises a maximum
            prefix = tl.reduce(tl.where(lane[None, :] <= lane[:, None], v[None, :], 0), 1, _max)
            tl.store(qsl_out_ptr + k, tl.maximum(prefix, carry).to(qsl_out_ptr.dtype.element_ty), mask=ok)
            carry = tl.maximum(carry, tl.reduce(v, 0, _max))
        tl.debug_barrier()
    n_slot = tl.full([], 0, tl.int64)
    n_acc = tl.full([], 0, tl.int64)
    n_qsl = tl.full([], 0, tl.int64)
    for b0 in range(0, B, BLOCK):
        b = b0 + lane
        ok = b < B
        drop = b < 0
        if HAS_QSL:
            moved = ((tl.load(qsl_out_ptr + b, mask=ok, other=0) != tl.load(qsl_ptr + b * qsl_stride, mask=ok, other=0))
                     | (tl.load(qsl_out_ptr + b + 1, mask=ok, other=0)
                        != tl.load(qsl_ptr + (b + 1) * qsl_stride, mask=ok, other=0)))
            bad_q = ok & moved
            n_qsl += tl.reduce(bad_q.to(tl.int64), 0, _add)
            drop = drop | bad_q
        if HAS_ACC:
            a = tl.load(acc_ptr + b * acc_stride, mask=ok, other=1).to(tl.int64)
            bad_a = ok & ((a < 1) | (a > length))
            n_acc += tl.reduce(bad_a.to(tl.int64), 0, _add)
            tl.store(acc_out_ptr + b, tl.where(bad_a, 1, a).to(acc_out_ptr.dtype.element_ty), mask=ok)
            drop = drop | bad_a
        if HAS_SLOTS:
            s = tl.load(slots_ptr + b * slots_stride, mask=ok, other=0).to(tl.int64)
            inside = (s >= 0) & (s < N)
            # Without PAD_GIVEN the caller's pad id does not fit the dtype: no entry is that pad.
            bad_s = ok & ~inside & (s != pad) if PAD_GIVEN else ok & ~inside
            n_slot += tl.reduce(bad_s.to(tl.int64), 0, _add)
            base = tl.where(inside, s, pad) if REWRITE else s
        else:
            base = b.to(tl.int64)
        tl.store(slots_out_ptr + b, tl.where(drop, pad, base).to(slots_out_ptr.dtype.element_ty), mask=ok)
    if HAS_SLOTS:
        # A live entry is a duplicate when an earlier entry holds the same slot: per slot used
        # k times, k - 1 duplicates.
        n_dup = tl.full([], 0, tl.int64)
        for i0 in range(0, B, BLOCK):
            i = i0 + lane
            si = tl.load(slots_ptr + i * slots_stride, mask=i < B, other=0).to(tl.int64)
            fi = tl.where((si >= 0) & (si < N), si, pad)
            live = (i < B) & (fi != pad)
            seen = i < 0
            for j0 in range(0, i0 + BLOCK, BLOCK):
                j = j0 + lane
                sj = tl.load(slots_ptr + j * slots_stride, mask=j < B, other=0).to(tl.int64)
                fj = tl.where((sj >= 0) & (sj < N), sj, pad)
                same = (fj[None, :] == fi[:, None]) & (j[None, :] < i[:, None])
                seen = seen | (tl.reduce(same.to(tl.int32), 1, _max) > 0)
            n_dup += tl.reduce((live & seen).to(tl.int64), 0, _add)
        tl.atomic_add(counter_ptr + _SLOT, n_slot)
        tl.atomic_add(counter_ptr + _DUPLICATE, n_dup)
    if HAS_ACC:
        tl.atomic_add(counter_ptr + _ACCEPTED, n_acc)
    if HAS_QSL:
        tl.atomic_add(counter_ptr + _QUERY_START, n_qsl)


def config(batch: int) -> tuple[int, int]:
    """(entries per block, warps): the batch's power of two (its B+1 bounds included), 16 to 64,
    with warps enough that the BLOCK x BLOCK tile of the duplicate compares fits in registers
    (sm_90: 64 entries on 8 warps, 127 registers, no spill)."""
    block = min(64, max(16, 1 << batch.bit_length()))
    return block, max(4, block // 8)


def _stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None and t.ndim == 1 else 1


def launch(slots: torch.Tensor | None, accepted: torch.Tensor | None, query_start_loc: torch.Tensor | None,
           counter: torch.Tensor, batch: int, n_slots: int, pad: int, pad_given: bool, length: int, total: int,
           rewrite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule in one launch on ``counter``'s device and current stream; the arguments and
    results of :func:`._device_rule.composite`."""
    device = counter.device
    slots_out = torch.empty(batch, dtype=slots.dtype if slots is not None else torch.int32, device=device)
    acc_out = torch.empty(batch if accepted is not None else 0,
                          dtype=accepted.dtype if accepted is not None else torch.int32, device=device)
    qsl_out = torch.empty(batch + 1 if query_start_loc is not None else 0,
                          dtype=query_start_loc.dtype if query_start_loc is not None else torch.int32, device=device)
    block, warps = config(batch)
    # An absent input is never read (its constexpr flag is off); any pointer stands in for it.
    _rule[(1,)](slots if slots is not None else slots_out, accepted if accepted is not None else acc_out,
                query_start_loc if query_start_loc is not None else qsl_out, counter, slots_out, acc_out, qsl_out,
                batch, n_slots, pad, length, total, _stride(slots), _stride(accepted), _stride(query_start_loc),
                HAS_SLOTS=slots is not None, HAS_ACC=accepted is not None, HAS_QSL=query_start_loc is not None,
                PAD_GIVEN=pad_given, REWRITE=rewrite, BLOCK=block, num_warps=warps)
    return slots_out, acc_out, qsl_out
