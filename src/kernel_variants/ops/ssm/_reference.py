"""The references: the definition in fp32, one token at a time (docs/contract.md, "Selective
scan"). Slow on purpose: the oracle every other variant of the two ops is checked against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def process_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_min: float,
               dt_max: float) -> torch.Tensor:
    """dt [..., H] -> the step size in fp32: plus dt_bias, softplus (torch's: linear above 20),
    clamped to [dt_min, dt_max] only when either limit is set (as vLLM does)."""
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)
    if dt_min > 0.0 or dt_max < math.inf:
        d = d.clamp(min=dt_min, max=dt_max)
    return d


def _token(s: torch.Tensor, x: torch.Tensor, d: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """One token, in place on the fp32 state s [H, P, S]: x, z [H, P]; d [H]; B, C [H, S] (each
    head's group). Returns y [H, P] in fp32."""
    x = x.float()
    s.mul_(torch.exp(d * A)[:, None, None]).add_((d[:, None] * x)[:, :, None] * B.float()[:, None, :])
    y = (s * C.float()[:, None, :]).sum(-1)
    if D is not None:
        y = y + D.float()[:, None] * x
    if z is not None:
        y = y * F.silu(z.float())
    return y


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, S] -> [..., H, S]: each head's group (head h reads group h // (H // G))."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=0.0,
                           dt_max=math.inf, *, state_batch_indices=None, dst_state_batch_indices=None,
                           pad_slot_id=-1, out=None):
    """state [N, H, P, S] (updated in place); x [B, H, P] or [B, T, H, P]; dt [B, (T,) H];
    B, C [B, (T,) G, S]. Returns y of x's shape and dtype (or ``out`` written)."""
    one = x.ndim == 3
    xs, dts, Bs, Cs = (t.unsqueeze(1) if one else t for t in (x, dt, B, C))
    zs = None if z is None else (z.unsqueeze(1) if one else z)
    heads = x.shape[-2]
    d_all = process_dt(dts, dt_bias, dt_softplus, dt_min, dt_max)
    y = torch.zeros(xs.shape, dtype=torch.float32, device=x.device)
    src = range(x.shape[0]) if state_batch_indices is None else state_batch_indices.tolist()
    dst = src if dst_state_batch_indices is None else dst_state_batch_indices.tolist()
    for b, (i, j) in enumerate(zip(src, dst, strict=True)):
        if i == pad_slot_id or j == pad_slot_id:
            continue
        s = state[i].to(torch.float32, copy=True)  # the slot is written once, after the last token
        for t in range(xs.shape[1]):
            y[b, t] = _token(s, xs[b, t], d_all[b, t], A, _heads(Bs[b, t], heads), _heads(Cs[b, t], heads),
                             D, None if zs is None else zs[b, t])
        state[j] = s.to(state.dtype)
    y = y.view(x.shape) if one else y
    return y.to(x.dtype) if out is None else out.copy_(y)


def ssd_chunk_scan(x, dt, A, B, C, cu_seqlens=None, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=0.0,
                   dt_max=math.inf, *, ssm_states=None, state_indices=None, has_initial_state=None, pad_slot_id=-1,
                   out=None):
    """x [T, H, P]; dt [T, H]; B, C [T, G, S]; cu_seqlens [B+1]; ssm_states [N, H, P, S] (final
    states written in place). Returns y [T, H, P] in x's dtype (or ``out`` written)."""
    total, heads, headdim = x.shape
    starts = [0, total] if cu_seqlens is None else cu_seqlens.tolist()
    batch = len(starts) - 1
    d_all = process_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    Bh, Ch = _heads(B, heads), _heads(C, heads)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    slots = list(range(batch)) if state_indices is None else state_indices.tolist()
    init = [False] * batch if has_initial_state is None else has_initial_state.tolist()
    for b in range(batch):
        slot = slots[b]
        if ssm_states is not None and slot == pad_slot_id:
            continue
        if ssm_states is not None and init[b]:
            s = ssm_states[slot].to(torch.float32, copy=True)
        else:
            s = torch.zeros(heads, headdim, B.shape[-1], dtype=torch.float32, device=x.device)
        for t in range(starts[b], starts[b + 1]):
            y[t] = _token(s, x[t], d_all[t], A, Bh[t], Ch[t], D, None if z is None else z[t])
        if ssm_states is not None:
            ssm_states[slot] = s.to(ssm_states.dtype)
    return y.to(x.dtype) if out is None else out.copy_(y)
