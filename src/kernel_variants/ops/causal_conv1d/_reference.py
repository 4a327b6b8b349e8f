"""The conv ops' reference: the contract written as plain torch, one sequence at a time.

It is the oracle every other variant is checked against, so it favours being obviously right
over being fast: each sequence is handled on its own, in fp32 (fp64 for fp64 inputs), and state
tensors are written only after every output is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_variants._dtypes import acc_dtype


def _in_pool(slots: list[int], n_slots: int, pad: int | None, name: str) -> None:
    """Every slot (but the pad) inside the pool, checked before anything is written: an index
    out of range must not half-write the pool, nor a negative one write another slot."""
    for b, s in enumerate(slots):
        if s != pad and not 0 <= s < n_slots:
            raise ValueError(f"{name}: expected slot indices in [0, {n_slots}), got {s} at position {b}")


def _conv(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """h: [W-1+L, D] history then tokens; weight: [D, W]; returns [L, D] in h's dtype."""
    width = weight.shape[1]
    length = h.shape[0] - (width - 1)
    w = weight.to(h.dtype)
    y = torch.zeros(length, h.shape[1], dtype=h.dtype, device=h.device)
    for k in range(width):
        y += w[:, k] * h[k : k + length]
    if bias is not None:
        y += bias.to(h.dtype)
    return F.silu(y) if silu else y


def _attached(out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``out`` as it is, joined (with a zero gradient) to the inputs that require grad where no
    sequence wrote it from them (every one a pad): a call that needs a gradient never gets a
    detached output, whose backward would raise. A select, so NaN in an input stays out."""
    needing = [t for t in inputs if t is not None and t.requires_grad]
    if out.grad_fn is not None or not needing or not torch.is_grad_enabled():
        return out
    anchor = sum(t.sum().to(out.dtype) for t in needing)
    return torch.where(torch.zeros((), dtype=torch.bool, device=out.device), anchor, out)


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
    """Prefill. x: [B, L, D], or [T, D] with query_start_loc [B+1]; weight: [D, W]; bias: [D];
    conv_states: [N, S, D] (updated in place); cache_indices, has_initial_state: [B].
    Returns [B, L, D] or [T, D] in x's dtype (written into ``out``, x's shape, when given)."""
    width = weight.shape[1]
    keep = width - 1
    acc = acc_dtype(x.dtype)
    silu = activation in ("silu", "swish")
    if query_start_loc is None:
        bounds = [(b, None, None) for b in range(x.shape[0])]
    else:
        starts = query_start_loc.tolist()
        bounds = [(b, starts[b], starts[b + 1]) for b in range(len(starts) - 1)]
    slots = cache_indices.tolist() if cache_indices is not None else list(range(len(bounds)))
    if conv_states is not None:
        _in_pool(slots, conv_states.shape[0], pad_slot_id if cache_indices is not None else None, "cache_indices")
    init = has_initial_state.tolist() if has_initial_state is not None else [False] * len(bounds)
    given = out
    out = torch.zeros_like(x) if out is None else out.zero_()
    writes: list[tuple[int, torch.Tensor]] = []
    for b, start, end in bounds:
        slot = slots[b]
        if cache_indices is not None and slot == pad_slot_id:
            continue
        xb = x[b] if start is None else x[start:end]
        if conv_states is not None and init[b]:
            hist = conv_states[slot, conv_states.shape[1] - keep :].to(acc)
        else:
            hist = torch.zeros(keep, x.shape[-1], dtype=acc, device=x.device)
        h = torch.cat([hist, xb.to(acc)])
        y = _conv(h, weight, bias, silu)
        if start is None:
            out[b] = y.to(x.dtype)
        else:
            out[start:end] = y.to(x.dtype)
        if conv_states is not None and keep > 0:
            writes.append((slot, h[h.shape[0] - keep :].detach()))  # states never join a graph
    for slot, rows in writes:
        conv_states[slot, conv_states.shape[1] - keep :] = rows.to(conv_states.dtype)
    return out if given is not None else _attached(out, x, weight, bias)


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
    """Decode / speculative verify. x: [B, D] or [B, L, D]; conv_state: [N, S, D] (updated in
    place); weight: [D, W]; bias: [D]; conv_state_indices, num_accepted_tokens: [B].
    Returns x's shape and dtype, written into ``out`` when given (which may be x itself: each
    sequence's rows are read before its output rows are written)."""
    width = weight.shape[1]
    keep = width - 1
    acc = acc_dtype(x.dtype)
    silu = activation in ("silu", "swish")
    x3 = x.unsqueeze(1) if x.ndim == 2 else x
    batch, length, _ = x3.shape
    rows = conv_state.shape[1]
    slots = conv_state_indices.tolist() if conv_state_indices is not None else list(range(batch))
    _in_pool(slots, conv_state.shape[0], pad_slot_id if conv_state_indices is not None else None,
             "conv_state_indices")
    accepted = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    given = out
    out = torch.empty_like(x3) if given is None else (given.unsqueeze(1) if x.ndim == 2 else given)
    writes: list[tuple[int, torch.Tensor]] = []
    for b in range(batch):
        slot = slots[b]
        if conv_state_indices is not None and slot == pad_slot_id:
            out[b] = 0
            continue
        state = conv_state[slot].to(acc)
        xb = x3[b].to(acc, copy=True)  # a copy: out may be x, and out[b] is written below
        if accepted is None:
            hist = state[rows - keep :]
            stream = torch.cat([state, xb])
        else:
            n = accepted[b]
            hist = state[n - 1 : n - 1 + keep]
            stream = torch.cat([state[n : n + max(rows - length, 0)], xb])
        new_state = stream[stream.shape[0] - rows :]
        out[b] = _conv(torch.cat([hist, xb]), weight, bias, silu).to(x.dtype)
        writes.append((slot, new_state.detach()))  # states never join a graph
    for slot, new_state in writes:
        conv_state[slot] = new_state.to(conv_state.dtype)
    if given is not None:
        return given
    return _attached(out.squeeze(1) if x.ndim == 2 else out, x, weight, bias)
