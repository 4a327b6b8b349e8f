"""``dao``: the CUDA kernels of the ``causal-conv1d`` package (Dao-AILab), for both ops.

Bound through ``causal_conv1d.causal_conv1d_fn`` and ``causal_conv1d.causal_conv1d_update``,
recognised by their signatures (``initial_states``/``return_final_states``/``final_states_out``
and ``conv_state_indices``). Its layouts are channel-first: x ``[B, D, L]``, states
``[B or N, D, W-1 or S]``. The adapter reaches them through transposed views of our channel-last
tensors, never copies that would lose a write:

- prefill: x goes in as ``x.transpose(1, 2)`` (the kernel's channel-last mode, which needs D a
  multiple of 8: other D are zero-padded on the way in). The kernel has no slot indices, so the
  initial states are gathered from the used slots (zeroed without initial state) and the final
  states it writes into a transposed buffer are scattered back in place into the caller's pool.
  Padded sequences get zero output. No varlen (``seq_idx`` excludes initial states).
- decode: the caller's pool goes in as the view ``conv_state.transpose(1, 2)`` (the kernel takes
  any strides), with int32 slot indices (pad entries as -1, which the kernel skips and zeroes);
  its state update is the contract's (the last S rows of slot ++ x), so it lands in place. No
  num_accepted_tokens.
- bias: the C++ side requires ``bias.stride(-1) == 1`` (both ops; the Python wrapper of the
  prefill makes it contiguous, the decode one does not): the adapter passes it contiguous.
- fp32, fp16, bf16; W in 2..4; CUDA only.
- graph_safe: decode only (the slot ids go through ``torch.where``, nothing is read back);
  prefill is not declared, as the package's prefill wrapper has not been checked for host reads.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants.kernels._adapters import (
    ADAPTER_SOURCES,
    FunctionRef,
    LazyKernel,
    mark_written,
    signature_mismatch,
)
from kernel_variants.kernels._slots import (
    Slots,
    gather_rows,
    pad_channels,
    round_up,
    scatter_rows,
    zero_dead_rows,
)
from kernel_variants.plugin import ConvCapabilities, Variant, hookimpl

# What the kernel's speed depends on besides its source: its rows go stale when one changes.
DEPENDS = ("causal-conv1d", "torch")

FN_PARAMS = ("x", "weight", "bias")
FN_ALSO = ("initial_states", "return_final_states", "final_states_out", "activation")
UPDATE_PARAMS = ("x", "conv_state", "weight", "bias", "activation")
UPDATE_ALSO = ("conv_state_indices",)
CHANNEL_LAST_MULTIPLE = 8


class DaoAdapter(LazyKernel):
    def __init__(self, module: str = "causal_conv1d", *, needs_cuda: bool = True) -> None:
        super().__init__()
        self.fn_ref = FunctionRef(f"{module}:causal_conv1d_fn")
        self.update_ref = FunctionRef(f"{module}:causal_conv1d_update")
        self.needs_cuda = needs_cuda

    def find(self) -> tuple[Any, str | None]:
        fn, why = self.fn_ref.load()
        if why is not None:
            return None, why
        update, why = self.update_ref.load()
        if why is not None:
            return None, why
        why = (signature_mismatch(fn, FN_PARAMS, FN_ALSO, "causal-conv1d's causal_conv1d_fn")
               or signature_mismatch(update, UPDATE_PARAMS, UPDATE_ALSO, "causal-conv1d's causal_conv1d_update"))
        if why is None and self.needs_cuda and not torch.cuda.is_available():
            why = "no CUDA device (causal-conv1d's kernels run on CUDA only)"
        return (fn, update), why

    def causal_conv1d_fn(self, x, weight, bias=None, *, conv_states=None, cache_indices=None,
                         has_initial_state=None, query_start_loc=None, activation=None, pad_slot_id=-1):
        """x: [B, L, D] (dense only); weight: [D, W]; conv_states: [N, S, D] updated in place."""
        if query_start_loc is not None:
            raise ValueError("query_start_loc: the causal-conv1d adapter takes dense [B, L, D] input only")
        fn, _ = self.kernel()
        batch, _, dim = x.shape
        keep = weight.shape[1] - 1
        padded = round_up(dim, CHANNEL_LAST_MULTIPLE)
        xt = pad_channels(x.contiguous(), padded).transpose(1, 2)  # [B, D, L], channel-last memory
        w = pad_channels(weight.t(), padded).t().contiguous() if padded != dim else weight.contiguous()
        b = pad_channels(bias.contiguous(), padded) if bias is not None else None
        if conv_states is None:
            out = fn(xt, w, b, activation=activation)
            return out.transpose(1, 2)[..., :dim].contiguous()
        slots = Slots(cache_indices, batch, pad_slot_id, x.device)
        rows = conv_states.shape[1]
        hist = gather_rows(conv_states, slots, slice(rows - keep, rows))  # [B, W-1, D]
        if has_initial_state is None:
            hist.zero_()
        else:
            hist.masked_fill_(~has_initial_state.view(-1, 1, 1), 0)
        initial = pad_channels(hist, padded).contiguous().transpose(1, 2)  # [B, D, W-1], stride(1) == 1
        final = x.new_empty(batch, keep, padded).transpose(1, 2)
        out, final = fn(xt, w, b, initial_states=initial, return_final_states=True, final_states_out=final,
                        activation=activation)
        scatter_rows(conv_states, slots, slice(rows - keep, rows), final.transpose(1, 2)[..., :dim])
        out = out.transpose(1, 2)[..., :dim].contiguous()
        return zero_dead_rows(out, slots.live, None)

    def causal_conv1d_update(self, x, conv_state, weight, bias=None, *, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None, pad_slot_id=-1):
        """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place (through a view)."""
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens: not supported by causal-conv1d's causal_conv1d_update")
        _, update = self.kernel()
        x3 = x.unsqueeze(1) if x.ndim == 2 else x
        slots = Slots(conv_state_indices, x3.shape[0], pad_slot_id, x.device)
        # The kernel skips negative slots (and zeroes their output); pad entries become -1.
        idx = torch.where(slots.live, slots.kernel, -1).to(torch.int32) if slots.live is not None else slots.kernel
        bias = bias.contiguous() if bias is not None else None  # the C++ side checks bias.stride(-1) == 1
        out = update(x3.transpose(1, 2), conv_state.transpose(1, 2), weight, bias, activation=activation,
                     conv_state_indices=idx)
        mark_written(conv_state)  # the CUDA kernel wrote it through a pointer
        out = out.transpose(1, 2)
        return out.squeeze(1) if x.ndim == 2 else out


def variants(adapter: DaoAdapter, *, vid: str = "dao", devices=frozenset({"cuda"}), priority: int = 20) -> list[Variant]:
    version = "1"  # what the kernel's speed depends on is declared below (depends=...)
    common = dict(devices=devices, dtypes={"float32", "bfloat16", "float16"}, width=(2, 4), noncontiguous_states=True)
    sources = ADAPTER_SOURCES
    return [
        Variant(id=vid, op="causal_conv1d_fn", version=version, depends=DEPENDS, fn=adapter.causal_conv1d_fn, probe=adapter.probe,
                priority=priority, sources=sources, capabilities=ConvCapabilities(varlen=False, **common),
                description="causal-conv1d (Dao-AILab) CUDA prefill, channel-last through views"),
        Variant(id=vid, op="causal_conv1d_update", version=version, depends=DEPENDS, fn=adapter.causal_conv1d_update,
                probe=adapter.probe, priority=priority, sources=sources,
                capabilities=ConvCapabilities(graph_safe=True, **common),
                description="causal-conv1d (Dao-AILab) CUDA decode on the caller's pool through a view"),
    ]


@hookimpl
def kv_register_variants(register) -> None:
    for v in variants(DaoAdapter()):
        register(v)
