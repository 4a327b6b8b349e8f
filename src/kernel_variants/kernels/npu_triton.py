"""``npu_triton_update``: sgl_kernel_npu's ``causal_conv1d_update_v2`` (Triton on Ascend), decode.

The kernel is a Python function, ``sgl_kernel_npu.mamba.causal_conv1d:causal_conv1d_update_v2``,
recognised by its signature ``(x, conv_state, weight, bias, activation, conv_state_indices,
num_accepted_tokens, ..., pad_slot_id, ...)``. It addresses every tensor through its strides, so
the caller's pool goes in as a view and the kernel writes the state where it belongs, strided
or not. (SGLang's adoption passed ``conv_states.contiguous()``; for a strided pool that is a copy,
and the state update was lost. The adapter never does that; tests check it.)

Where it departs from the contract, and what the adapter does:

- it writes its output over its ``x``: the adapter passes a copy of x, which becomes the output.
- it reads bias at ``bias_ptr + channel`` (no stride): the adapter passes ``bias.contiguous()``.
- weight ``[W, D]``: passed as the view ``weight.t()``. Slot indices always passed (int32).
- history is rows ``0..W-2`` of what it is given (``n-1..`` with num_accepted_tokens) and it
  rewrites only the first W-1 (W-1+L-1) rows. Without num_accepted_tokens the adapter hands it
  the view of the last W-1 rows of the caller's pool; rows before them (a pool with extra rows)
  are shifted by the adapter. With num_accepted_tokens and exactly W-1+L-1 rows it gets the
  caller's pool itself; with extra rows it runs on a gathered buffer, indexed by compact ids
  with pads as a negative marker (the caller's ``pad_slot_id`` may be one of 0..B-1, which the
  kernel would skip as a pad), and the adapter writes the contract's slot back in place.
- ``pad_slot_id`` is a ``tl.constexpr`` of the kernel: each distinct pad id compiles once more.
- output rows of padded sequences are left as x's values: zeroed by the adapter.
- it rounds x and history through fp16 internally, so it is declared for fp16 and bf16 only
  (bf16 values outside fp16's range would not survive; the conformance cases stay inside).
- W in 2..6. The wrapper reads no tensor value on the host, nor does the adapter: graph_safe.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants.kernels._adapters import (
    FunctionRef,
    LazyKernel,
    mark_written,
    sgl_npu_update_variant,
    signature_mismatch,
)
from kernel_variants.kernels._slots import (
    COMPACT_PAD,
    Slots,
    gather_rows,
    int32,
    scatter_rows,
    spec_shift,
    zero_dead_rows,
)
from kernel_variants.plugin import Variant, hookimpl

LEADING = ("x", "conv_state", "weight", "bias", "activation", "conv_state_indices", "num_accepted_tokens")
ALSO = ("pad_slot_id",)
DEFAULT_FN = FunctionRef("sgl_kernel_npu.mamba.causal_conv1d:causal_conv1d_update_v2", device="npu")


class NpuTritonAdapter(LazyKernel):
    def __init__(self, ref: FunctionRef = DEFAULT_FN) -> None:
        super().__init__()
        self.ref = ref

    def find(self) -> tuple[Any, str | None]:
        fn, why = self.ref.load()
        if why is None:
            why = signature_mismatch(fn, LEADING, ALSO, "sgl_kernel_npu's causal_conv1d_update_v2")
        return fn, why

    def causal_conv1d_update(self, x, conv_state, weight, bias=None, *, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None, pad_slot_id=-1):
        """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place; weight: [D, W]."""
        kernel = self.kernel()
        x3 = x.unsqueeze(1) if x.ndim == 2 else x
        batch, length, _ = x3.shape
        keep = weight.shape[1] - 1
        rows = conv_state.shape[1]
        spec = num_accepted_tokens is not None
        span = keep + length - 1 if spec else keep
        slots = Slots(conv_state_indices, batch, pad_slot_id, x.device)
        nat = int32(num_accepted_tokens) if spec else None
        out = x3.clone(memory_format=torch.contiguous_format)  # the kernel writes its output over x
        w = weight.t()
        bias = bias.contiguous() if bias is not None else None  # read without its stride
        if not spec or rows == span:
            older = None
            if not spec and rows > keep:  # read before the kernel rewrites the last W-1 rows
                old = gather_rows(conv_state, slots, slice(0, rows))
                older = torch.cat([old, x3.to(old.dtype)], dim=1)[:, length : length + rows - keep]
            # The caller's own rows, as a view: the kernel writes through its strides.
            out = kernel(out, conv_state[:, rows - span:], w, bias, activation, slots.kernel, nat,
                         pad_slot_id=pad_slot_id)
            mark_written(conv_state)
            if older is not None:
                scatter_rows(conv_state, slots, slice(0, rows - keep), older)
        else:
            old = gather_rows(conv_state, slots, slice(0, rows))
            buf = old[:, :span].contiguous()
            out = kernel(out, buf, w, bias, activation, slots.compact, nat, pad_slot_id=COMPACT_PAD)
            scatter_rows(conv_state, slots, slice(0, rows), spec_shift(old, x3, num_accepted_tokens))
        zero_dead_rows(out, slots.live, None)
        return out.squeeze(1) if x.ndim == 2 else out


def variants(adapter: NpuTritonAdapter, *, vid: str = "npu_triton_update", devices=frozenset({"npu"}),
             priority: int = 10) -> list[Variant]:
    """The decode variant of ``adapter``."""
    return [sgl_npu_update_variant(adapter, vid=vid, devices=devices, priority=priority, width=(2, 6),
                                   description="sgl_kernel_npu causal_conv1d_update_v2 (Triton on Ascend)")]


@hookimpl
def kv_register_variants(register) -> None:
    for v in variants(NpuTritonAdapter()):
        register(v)
