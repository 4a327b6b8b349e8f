"""Shift-and-multiply-add in plain torch, batched over all sequences at once.

A different profile from the reference: no Python loop over sequences, but each of the W taps
is a full pass over an fp32 copy of the input, so it is bound by memory traffic of about
(W + 3) times the input. Works on any device torch runs on. Dense input only (no varlen).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_variants._dtypes import acc_dtype
from kernel_variants.kernels._slots import Slots, finish_decode, initial
from kernel_variants.ops.causal_conv1d import TORCH_CAPS
from kernel_variants.plugin import ConvCapabilities, Variant, hookimpl


def _taps(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """h: [B, W-1+L, D] in the accumulation dtype; weight: [D, W]; returns [B, L, D]."""
    width = weight.shape[1]
    length = h.shape[1] - (width - 1)
    w = weight.to(h.dtype)
    y = h[:, width - 1 :] * w[:, width - 1]
    for k in range(width - 1):
        y.addcmul_(h[:, k : k + length], w[:, k])
    if bias is not None:
        y += bias.to(h.dtype)
    return F.silu(y, inplace=True) if silu else y


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
) -> torch.Tensor:
    """x: [B, L, D]; weight: [D, W]; bias: [D]; conv_states: [N, S, D] updated in place;
    cache_indices, has_initial_state: [B]. Returns [B, L, D]."""
    if query_start_loc is not None:
        raise ValueError("query_start_loc: torch_shift supports dense [B, L, D] input only")
    batch, _, dim = x.shape
    keep = weight.shape[1] - 1
    acc = acc_dtype(x.dtype)
    hist = x.new_zeros(batch, keep, dim, dtype=acc)
    live = None
    if conv_states is not None:
        s = Slots(cache_indices, batch, pad_slot_id, x.device)
        slots, live = s.ids, s.live
        init = initial(has_initial_state, s)
        rows = conv_states.shape[1]
        hist = torch.where(init[:, None, None], conv_states[s.safe, rows - keep :].to(acc), hist)
        x = s.live_only(x)
    h = torch.cat([hist, x.to(acc)], dim=1)
    out = _taps(h, weight, bias, activation in ("silu", "swish")).to(x.dtype)
    if conv_states is not None:
        tail = h[:, h.shape[1] - keep :].to(conv_states.dtype)
        if live is not None:
            out[~live] = 0
            slots, tail = slots[live], tail[live]
        if keep > 0:
            # index_put_ on the caller's view writes through to its storage, also when the
            # pool is a non-contiguous slice.
            conv_states[slots, rows - keep :] = tail.detach()  # states never join a graph
    return out


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
) -> torch.Tensor:
    """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place; weight: [D, W];
    conv_state_indices, num_accepted_tokens: [B]. Returns x's shape."""
    x3 = x.unsqueeze(1) if x.ndim == 2 else x
    batch, length, dim = x3.shape
    keep = weight.shape[1] - 1
    rows = conv_state.shape[1]
    acc = acc_dtype(x.dtype)
    s = Slots(conv_state_indices, batch, pad_slot_id, x.device)
    state = s.history(conv_state).to(acc)  # [B, S, D]
    xa = s.live_only(x3).to(acc)
    if num_accepted_tokens is None:
        hist = state[:, rows - keep :]
        stream = torch.cat([state, xa], dim=1)
        new_state = stream[:, stream.shape[1] - rows :]
    else:
        shift = num_accepted_tokens.long()[:, None]  # [B, 1]
        pick = (shift - 1 + torch.arange(keep, device=x.device)).clamp(max=rows - 1)
        hist = state.gather(1, pick[:, :, None].expand(batch, keep, dim))
        kept = max(rows - length, 0)
        pick = (shift + torch.arange(kept, device=x.device)).clamp(max=rows - 1)
        stream = torch.cat([state.gather(1, pick[:, :, None].expand(batch, kept, dim)), xa], dim=1)
        new_state = stream[:, stream.shape[1] - rows :]
    out = _taps(torch.cat([hist, xa], dim=1), weight, bias, activation in ("silu", "swish")).to(x.dtype)
    return finish_decode(out, conv_state, s, new_state.to(conv_state.dtype), x)


_CAPS = dict(devices={"cpu", "cuda", "npu"}, **TORCH_CAPS)


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(
        id="torch_shift", op="causal_conv1d_fn", version="1", fn=causal_conv1d_fn, priority=0, isolate=False,
        capabilities=ConvCapabilities(varlen=False, **_CAPS),
        description="batched shift-and-multiply-add in plain torch (dense input only)",
    ))
    register(Variant(
        id="torch_shift", op="causal_conv1d_update", version="1", fn=causal_conv1d_update, priority=0, isolate=False,
        capabilities=ConvCapabilities(num_accepted_tokens=True, **_CAPS),
        description="batched shift-and-multiply-add in plain torch",
    ))
