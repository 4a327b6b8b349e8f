"""``asc``: sgl-kernel-npu's Ascend C causal_conv1d kernel (PR #592), for both ops.

The kernel is the torch op ``npu::causal_conv1d`` that ``import sgl_kernel_npu`` registers, with
the schema::

    causal_conv1d(Tensor x, Tensor weight, Tensor conv_states, Tensor? bias=None,
                  Tensor? query_start_loc=None, Tensor? cache_indices=None,
                  Tensor? has_initial_state=None, Tensor? num_accepted_tokens=None,
                  int activation_mode=0, int pad_slot_id=-1, int run_mode=0) -> Tensor

``run_mode`` 0 is prefill, 1 is decode. The kernel is recognised by that schema (an op of the
same name with another schema, such as the PTO kernel's, makes this variant unavailable with the
schema it found). Only A2/A3 builds register it: sgl-kernel-npu builds for Ascend950 leave it out
(an A3-only op there), and the probe says so. Read from sgl-kernel-npu 8f13e502 (PR #592) and
f425bdf1 (HEAD). Where it departs from the contract, and what the adapter does:

- weight is ``[W, D]``, contiguous: the adapter passes ``weight.t().contiguous()``.
- indices are taken as int32 (the adapter converts int64 ones); ``activation_mode`` is an int.
- x, weight and conv_states must be contiguous; the history is rows ``0..W-2`` of a slot (the
  contract: the last W-1 rows), and decode rewrites only the first W-1 (or W-1+L-1) rows. A
  contiguous pool of exactly that many rows is passed as is, with ``query_start_loc`` and the
  caller's slot ids (packed prefill included); any other pool (a strided view, extra rows) goes
  through a contiguous buffer of the used slots that is scattered back into the caller's pool
  in place, with the older rows the contract shifts filled in by the adapter. The buffer is
  indexed by compact ids 0..B-1, so pads then travel as a negative marker, never as the
  caller's ``pad_slot_id`` (which may be one of 0..B-1).
- output rows of padded sequences are left uninitialised: the adapter zeroes them.
- empty sequences (varlen) are skipped: their state is not written. The adapter zeroes the
  history of sequences without initial state first, so the contract's zero history results.
- D must be a multiple of 16 (32-byte DataCopy; other D are undefined on A2/A3, nothing
  checks): other D are zero-padded on the way in and sliced on the way out (through the buffer).
- the host caches tiling data per call signature in a static table whose key holds the shape,
  flags and ``pad_slot_id`` but not the dtype (open upstream PR #643): a bf16 call and then an
  fp16 call of the same shape would reuse the bf16 tiling and read fp16 data as bf16. The
  adapter hands the kernel a pad id of its own per dtype (-1 for bf16, -2 for fp16, every pad
  entry rewritten to it; no slot is negative), which puts the dtype into the key.
- that tiling table lives in a static device buffer made on the first call's NPU: a process
  that calls it on a second NPU would read tiling from the first one's memory. The adapter
  remembers the first device and raises on another one (one NPU per process).
- ``num_accepted_tokens`` is honoured for W = 4 only (other widths silently ignore it): declared
  as ``num_accepted_tokens_width=(4, 4)``, so the dispatcher never sends it another width.
- bf16 and fp16 only; W in 2..4.
- no host read on the adapter's side (no ``nonzero()``, no ``.item()``): declared graph_safe.
  The kernel's own host side copies a new call signature's tiling to the device once, so call
  each captured shape once before capturing (as the dispatcher asks anyway).
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants.kernels._adapters import (
    ADAPTER_SOURCES,
    SGL_NPU_DEPENDS,
    FirstDevice,
    OpAdapter,
    OpRef,
    Param,
    mark_written,
    prefill_rows0,
    soc_name,
)
from kernel_variants.kernels._slots import (
    Slots,
    gather_rows,
    int32,
    pad_channels,
    padded_inputs,
    scatter_rows,
    spec_shift,
    trimmed,
)
from kernel_variants.plugin import ConvCapabilities, Variant, hookimpl

SCHEMA = (
    Param("x", "Tensor"),
    Param("weight", "Tensor"),
    Param("conv_states", "Tensor"),
    Param("bias", "Optional[Tensor]", True),
    Param("query_start_loc", "Optional[Tensor]", True),
    Param("cache_indices", "Optional[Tensor]", True),
    Param("has_initial_state", "Optional[Tensor]", True),
    Param("num_accepted_tokens", "Optional[Tensor]", True),
    Param("activation_mode", "int", True),
    Param("pad_slot_id", "int", True),
    Param("run_mode", "int", True),
)
RUN_PREFILL, RUN_UPDATE = 0, 1
SPEC_WIDTH = 4
DIM_MULTIPLE = 16
# The pad id handed to the kernel, per dtype: it is part of the kernel's tiling-cache key, the
# dtype is not (upstream PR #643 open), so a distinct pad id per dtype keeps their tilings apart.
PAD_MARKERS = {torch.bfloat16: -1, torch.float16: -2}


def pad_marker(dtype: torch.dtype) -> int:
    return PAD_MARKERS.get(dtype, -1)

DEFAULT_OP = OpRef("npu::causal_conv1d", modules=("sgl_kernel_npu",), device="npu")


class AscAdapter(OpAdapter):
    """Both ops through one Ascend C op, found by ``ref`` (the real one, or a test double)."""

    SCHEMA = SCHEMA
    WHAT = "the Ascend C kernel's (sgl-kernel-npu PR #592)"

    def __init__(self, ref: OpRef = DEFAULT_OP) -> None:
        super().__init__(ref)
        self.first_device = FirstDevice(f"{ref.qualname} (the Ascend C kernel)")

    def find(self) -> tuple[Any, str | None]:
        op, why = super().find()
        if why is not None and "is not registered" in why:
            soc = soc_name()
            if soc is not None and soc.lower().startswith("ascend950"):
                why = (f"{self.ref.qualname} is not registered: sgl-kernel-npu builds for {soc} leave the Ascend C "
                       "causal_conv1d out (an A2/A3-only op there); npu_conv_update (npu::causal_conv1d_update) "
                       "and npu_triton_update are built for it")
        return op, why

    def causal_conv1d_fn(self, x, weight, bias=None, *, conv_states=None, cache_indices=None,
                         has_initial_state=None, query_start_loc=None, activation=None, pad_slot_id=-1):
        """x: [B, L, D] or [T, D] with query_start_loc; weight: [D, W]; conv_states: [N, S, D]
        updated in place; returns x's shape and dtype."""
        op = self.kernel()
        self.first_device.check(x.device)

        def call(x_in, w_in, states, qsl, ci, init, b_in, silu, pad_id):
            return op(x_in, w_in, states, b_in, qsl, ci, init, None, int(silu), pad_id, RUN_PREFILL)

        return prefill_rows0(call, x, weight, bias, conv_states, cache_indices, has_initial_state,
                             query_start_loc, activation is not None, pad_slot_id, dim_multiple=DIM_MULTIPLE,
                             pad_marker=pad_marker(x.dtype))

    def causal_conv1d_update(self, x, conv_state, weight, bias=None, *, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None, pad_slot_id=-1):
        """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place; weight: [D, W]."""
        op = self.kernel()
        self.first_device.check(x.device)
        x3 = x.unsqueeze(1) if x.ndim == 2 else x
        batch, length, dim = x3.shape
        width = weight.shape[1]
        keep = width - 1
        rows = conv_state.shape[1]
        spec = num_accepted_tokens is not None
        if spec and width != SPEC_WIDTH:
            raise ValueError(f"num_accepted_tokens: the Ascend C kernel honours it for W={SPEC_WIDTH} only, got W={width}")
        # Rows the kernel reads and rewrites, counted from row 0 of a slot.
        span = keep + length - 1 if spec else keep
        slots = Slots(conv_state_indices, batch, pad_slot_id, x.device)
        marker = pad_marker(x.dtype)
        nat = int32(num_accepted_tokens) if spec else None
        padded, x_in, w, b = padded_inputs(x3, weight, bias, DIM_MULTIPLE)
        act = int(activation is not None)
        if rows == span and conv_state.is_contiguous() and padded == dim:
            out = op(x_in, w, conv_state, b, None, slots.marked(marker), None, nat, act, marker, RUN_UPDATE)
            mark_written(conv_state)  # the kernel wrote the caller's pool
        else:
            old = gather_rows(conv_state, slots, slice(0, rows))  # [B, S, D], before anything is written
            buf = pad_channels(old[:, :span] if spec else old[:, rows - keep:], padded).contiguous()
            out = op(x_in, w, buf, b, None, slots.compact_marked(marker), None, nat, act, marker, RUN_UPDATE)
            if not spec:
                # The kernel wrote the last W-1 rows of the new slot; the rows before them shift by L.
                older = torch.cat([old, x3.to(old.dtype)], dim=1)[:, length : length + rows - keep]
                new = torch.cat([older, buf[..., :dim]], dim=1)
            elif rows == span:
                new = buf[..., :dim]
            else:
                # With extra rows the kernel's rewrite of rows 0..span-1 is not the contract's slot.
                new = spec_shift(old, x3, num_accepted_tokens)
            scatter_rows(conv_state, slots, slice(0, rows), new)
        out = trimmed(out, dim, slots.live)
        return out.squeeze(1) if x.ndim == 2 else out


def variants(adapter: AscAdapter, *, vid: str = "asc", devices=frozenset({"npu"}), priority: int = 20) -> list[Variant]:
    """The two variants of ``adapter``; tests build them on a CPU double with ``devices={"cpu"}``."""
    version = "1"  # what the kernel's speed depends on is declared below (depends=...)
    common = dict(devices=devices, dtypes={"bfloat16", "float16"}, width=(2, 4), noncontiguous_states=True,
                  graph_safe=True)
    sources = ADAPTER_SOURCES
    return [
        Variant(id=vid, op="causal_conv1d_fn", version=version, depends=SGL_NPU_DEPENDS, fn=adapter.causal_conv1d_fn, probe=adapter.probe,
                priority=priority, sources=sources, capabilities=ConvCapabilities(varlen=True, **common),
                description="sgl-kernel-npu Ascend C causal_conv1d (PR #592), run_mode=0"),
        Variant(id=vid, op="causal_conv1d_update", version=version, depends=SGL_NPU_DEPENDS, fn=adapter.causal_conv1d_update,
                probe=adapter.probe, priority=priority, sources=sources,
                capabilities=ConvCapabilities(num_accepted_tokens=True, num_accepted_tokens_width=(SPEC_WIDTH, SPEC_WIDTH),
                                          **common),
                description="sgl-kernel-npu Ascend C causal_conv1d (PR #592), run_mode=1"),
    ]


@hookimpl
def kv_register_variants(register) -> None:
    for v in variants(AscAdapter()):
        register(v)
