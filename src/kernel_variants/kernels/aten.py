"""``aten``: what a user writes without this project, a depthwise ``F.conv1d``.

The channel-last input is viewed as ``[B, D, L]``, the W-1 history rows are concatenated in
front, and ATen's depthwise convolution (oneDNN on CPU, cuDNN on CUDA) does the taps and bias
in x's dtype; the result is made contiguous channel-last again. State handling is gathered and
scattered with index ops that write through the caller's view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_variants.kernels._slots import Slots, finish_decode, initial
from kernel_variants.ops.causal_conv1d import TORCH_CAPS
from kernel_variants.plugin import ConvCapabilities, Variant, hookimpl


def _depthwise(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """h: [B, D, W-1+L]; weight: [D, W]; returns [B, L, D] contiguous."""
    y = F.conv1d(h, weight.unsqueeze(1), bias, groups=weight.shape[0])
    if silu:
        y = F.silu(y)
    return y.transpose(1, 2).contiguous()


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
        raise ValueError("query_start_loc: aten supports dense [B, L, D] input only")
    batch = x.shape[0]
    keep = weight.shape[1] - 1
    xt = x.transpose(1, 2)  # [B, D, L] view
    if conv_states is None:
        out = _depthwise(F.pad(xt, (keep, 0)), weight, bias, activation is not None)
        return out
    rows = conv_states.shape[1]
    s = Slots(cache_indices, batch, pad_slot_id, x.device)
    slots, live = s.ids, s.live
    xt = s.live_only(x).transpose(1, 2)
    init = initial(has_initial_state, s)
    hist = conv_states[s.safe, rows - keep :].transpose(1, 2)  # [B, D, W-1] (a gathered copy)
    hist = torch.where(init[:, None, None], hist, torch.zeros((), dtype=x.dtype, device=x.device))
    h = torch.cat([hist, xt], dim=2)
    out = _depthwise(h, weight, bias, activation is not None)
    if keep > 0:
        tail = h[:, :, h.shape[2] - keep :].transpose(1, 2)
        if live is not None:
            slots, tail = slots[live], tail[live]
        conv_states[slots, rows - keep :] = tail.detach()  # states never join a graph
    if live is not None:
        out[~live] = 0
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
    """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place; weight: [D, W].
    Returns x's shape. (No num_accepted_tokens: declared in the capabilities.)"""
    x3 = x.unsqueeze(1) if x.ndim == 2 else x
    batch = x3.shape[0]
    keep = weight.shape[1] - 1
    rows = conv_state.shape[1]
    s = Slots(conv_state_indices, batch, pad_slot_id, x.device)
    stream = torch.cat([s.history(conv_state), s.live_only(x3)], dim=1)  # [B, S+L, D]
    h = stream[:, rows - keep :].transpose(1, 2)
    out = _depthwise(h, weight, bias, activation is not None)
    return finish_decode(out, conv_state, s, stream[:, stream.shape[1] - rows :], x)


_CAPS = dict(devices={"cpu", "cuda"}, **TORCH_CAPS)


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(
        id="aten", op="causal_conv1d_fn", version="1", fn=causal_conv1d_fn, priority=10, isolate=False,
        capabilities=ConvCapabilities(varlen=False, **_CAPS),
        description="depthwise F.conv1d (oneDNN / cuDNN) with layout changes around it",
    ))
    register(Variant(
        id="aten", op="causal_conv1d_update", version="1", fn=causal_conv1d_update, priority=10, isolate=False,
        capabilities=ConvCapabilities(num_accepted_tokens=False, **_CAPS),
        description="depthwise F.conv1d over the state window",
    ))
