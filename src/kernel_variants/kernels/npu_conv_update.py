"""``npu_conv_update``: sgl-kernel-npu's Ascend C decode kernel ``npu::causal_conv1d_update``.

sglang's Ascend GDN backend calls it in target verify (``ascend_gdn_backend.py``: x
``[B, draft, D]``, weight ``[W, D]``, num_accepted_tokens all ``draft``). ``import sgl_kernel_npu``
registers it on every SoC (A2, A3 and Ascend950, unlike ``npu::causal_conv1d``), with the schema
(sgl-kernel-npu f425bdf1; the kernel of PR #407, its host fixed by PR #428)::

    causal_conv1d_update(Tensor x, Tensor weight, Tensor(a!) conv_state,
                         Tensor conv_state_indices, Tensor? bias=None,
                         Tensor? num_accepted_tokens=None, Tensor? query_start_loc=None,
                         bool activation_mode=False, int pad_slot_id=-1) -> Tensor

What it does, read from its host and kernel sources (S = conv_state rows, L = x.shape[1]):

- x ``[B, L, D]`` (3-D only), weight ``[W, D]``, conv_state ``[N, S, D]``, all contiguous, bf16
  or fp16; int32 indices (an empty tensor means slot b); output ``[B, L, D]``, rows of pad
  entries left uninitialised.
- the host first "pre-shifts" every indexed slot: rows ``0..S-L-1`` := rows ``L..S-1``. Pad
  entries are clamped to slot 0 for that, so slot 0 is shifted too when the batch has a pad
  (a slot belonging to no sequence of the call is written).
- the kernel then reads the history at rows ``o..o+W-2`` with ``o = n-1`` (``n`` from
  num_accepted_tokens, else ``o = 0``), slides it by one row per token and writes each token at
  row ``o+W-2``; tokens past ``n`` append at rows ``o+W-1..``.
- so the output is the contract's only when the pre-shift leaves rows ``o..o+W-2`` alone,
  ``S - L <= n - 1``: sglang's verify layout (``S = W-1+L-1``, ``n = L``) for ``L >= W-1``.
  On the plain decode layout (``S = W-1``, ``L = 1``, no num_accepted_tokens) it reads the
  window ``[h1, h2, h2]`` instead of ``[h0, h1, h2]`` for W = 4: a wrong output, no error.
- the tiling is cached per call signature in a static buffer on the first call's device (one
  NPU per process), as for the Ascend C ``causal_conv1d``; D above 4096 is tiled on the host.

What the adapter does: it never hands the kernel the caller's pool. It gathers each sequence's
history (the last W-1 rows of its slot, or rows ``n-1..n+W-3`` with num_accepted_tokens) into
the *last* W-1 rows of a contiguous buffer of ``W-1+L`` rows per sequence: the pre-shift then
moves exactly the history to rows ``0..W-2``, where the kernel reads it, and the kernel runs
without num_accepted_tokens on compact ids 0..B-1 (no pad entry, no pad id to collide). Its
outputs are the kernel's; the new slots (pure data movement: the last S rows of slot ++ x, or
``slot[n : n+S-L] ++ x``) are written back into the caller's pool in place by the adapter,
live sequences only, pads zeroed in the output. D is zero-padded to a multiple of 16 (the
kernel's 32-byte copies). W in 2..4 (what upstream tests; W = 1 would write row -1). No host
read on the adapter's side: graph_safe.
"""

from __future__ import annotations

import torch

from kernel_variants.kernels._adapters import (
    FirstDevice,
    OpAdapter,
    OpRef,
    Param,
    sgl_npu_update_variant,
)
from kernel_variants.kernels._slots import (
    COMPACT_PAD,
    Slots,
    gather_rows,
    pad_channels,
    padded_inputs,
    scatter_rows,
    spec_shift,
    trimmed,
)
from kernel_variants.plugin import Variant, hookimpl

SCHEMA = (
    Param("x", "Tensor"),
    Param("weight", "Tensor"),
    Param("conv_state", "Tensor"),
    Param("conv_state_indices", "Tensor"),
    Param("bias", "Optional[Tensor]", True),
    Param("num_accepted_tokens", "Optional[Tensor]", True),
    Param("query_start_loc", "Optional[Tensor]", True),
    Param("activation_mode", "bool", True),
    Param("pad_slot_id", "int", True),
)
DIM_MULTIPLE = 16

DEFAULT_OP = OpRef("npu::causal_conv1d_update", modules=("sgl_kernel_npu",), device="npu")


class NpuConvUpdateAdapter(OpAdapter):
    """Decode through ``npu::causal_conv1d_update`` (or a test double of its schema)."""

    SCHEMA = SCHEMA
    WHAT = "sgl-kernel-npu's causal_conv1d_update"

    def __init__(self, ref: OpRef = DEFAULT_OP) -> None:
        super().__init__(ref)
        self.first_device = FirstDevice(f"{ref.qualname} (the Ascend C decode kernel)")

    def causal_conv1d_update(self, x, conv_state, weight, bias=None, *, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None, pad_slot_id=-1):
        """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place; weight: [D, W]."""
        op = self.kernel()
        self.first_device.check(x.device)
        x3 = x.unsqueeze(1) if x.ndim == 2 else x
        batch, length, dim = x3.shape
        keep = weight.shape[1] - 1
        rows = conv_state.shape[1]
        slots = Slots(conv_state_indices, batch, pad_slot_id, x.device)
        old = gather_rows(conv_state, slots, slice(0, rows))  # [B, S, D], read before anything is written
        if num_accepted_tokens is None:
            hist = old[:, rows - keep:]
            new = torch.cat([old, x3.to(old.dtype)], dim=1)[:, length:]
        else:
            # Rows n-1 .. n+W-3 of each slot; pads carry garbage counts, clamped (their rows are never used).
            first = (num_accepted_tokens.long() - 1).clamp(0, rows - keep)
            pick = (first[:, None] + torch.arange(keep, device=x.device))[:, :, None].expand(batch, keep, dim)
            hist = old.gather(1, pick)
            new = spec_shift(old, x3, num_accepted_tokens)
        # The host's pre-shift copies rows L..L+W-2 to rows 0..W-2 of a W-1+L-row buffer: the history goes there.
        padded, x_in, w, b = padded_inputs(x3, weight, bias, DIM_MULTIPLE)
        buf = pad_channels(torch.cat([hist.new_zeros(batch, length, dim), hist], dim=1), padded).contiguous()
        compact = torch.arange(batch, dtype=torch.int32, device=x.device)
        out = op(x_in, w, buf, compact, b, None, None, activation is not None, COMPACT_PAD)
        scatter_rows(conv_state, slots, slice(0, rows), new)
        out = trimmed(out, dim, slots.live)
        return out.squeeze(1) if x.ndim == 2 else out


def variants(adapter: NpuConvUpdateAdapter, *, vid: str = "npu_conv_update", devices=frozenset({"npu"}),
             priority: int = 10) -> list[Variant]:
    """The decode variant of ``adapter``."""
    return [sgl_npu_update_variant(adapter, vid=vid, devices=devices, priority=priority, width=(2, 4),
                                   description="sgl-kernel-npu Ascend C npu::causal_conv1d_update, history re-laid "
                                               "for its pre-shift")]


@hookimpl
def kv_register_variants(register) -> None:
    for v in variants(NpuConvUpdateAdapter()):
        register(v)
