"""The selective-scan ops in plain torch ops, for any device torch runs on:

- ``aten`` for ``selective_state_update``: the batch's slots gathered into one fp32 tensor, the
  T tokens stepped for all sequences at once, the slots scattered back (two copies of the
  touched state, as a batched GPU kernel would not need; a baseline that runs anywhere);
- ``torch_chunked`` for ``ssd_chunk_scan``: the chunked (SSD) form of the scan. Per sequence,
  split into chunks of Q tokens: inside a chunk the output is a masked (C Bᵀ ∘ decay) product
  with ``d x``, the chunk's contribution to the state a ``(decay d x)ᵀ B`` product, and only the
  chunk boundaries are stepped one after another. Most of the work becomes batched matrix
  products (oneDNN/cuBLAS), at the price of Q x Q decay matrices: long sequences gain, short
  ones pay the set-up. The chunk size is the variant's tactic (``chunk64``/``128``/``256``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernel_variants.kernels._adapters import with_fixed
from kernel_variants.ops.ssm import SsmCapabilities
from kernel_variants.ops.ssm._reference import process_dt
from kernel_variants.plugin import Variant, hookimpl

_CAPS = dict(devices={"cpu", "cuda"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True)


def _gate(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """y [..., H, P] fp32 plus the skip connection (D [H]) and times silu(z)."""
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def _finish(y: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return y.to(like.dtype) if out is None else out.copy_(y)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=0.0,
                           dt_max=math.inf, *, state_batch_indices=None, dst_state_batch_indices=None,
                           pad_slot_id=-1, out=None):
    """state [N, H, P, S] (updated in place); x [B, (T,) H, P]; dt [B, (T,) H]; B, C [B, (T,) G, S].
    Returns y of x's shape and dtype (or ``out`` written)."""
    one = x.ndim == 3
    xs, dts, Bs, Cs = (t.unsqueeze(1) if one else t for t in (x, dt, B, C))
    zs = None if z is None else (z.unsqueeze(1) if one else z)
    batch, heads = x.shape[0], x.shape[-2]
    src = (torch.arange(batch, device=x.device) if state_batch_indices is None else state_batch_indices.long())
    dst = src if dst_state_batch_indices is None else dst_state_batch_indices.long()
    live = (src != pad_slot_id) & (dst != pad_slot_id)
    rows = live.nonzero().squeeze(1)  # one host read: which sequences run
    src, dst = src[rows], dst[rows]
    rep = heads // B.shape[-2]
    d = process_dt(dts[rows], dt_bias, dt_softplus, dt_min, dt_max)  # [b, T, H]
    dA = torch.exp(d * A)
    Bh = Bs[rows].float().repeat_interleave(rep, dim=-2)  # [b, T, H, S]
    Ch = Cs[rows].float().repeat_interleave(rep, dim=-2)
    xr = xs[rows].float()
    s = state[src].float()  # [b, H, P, S]
    ys = []
    for t in range(xs.shape[1]):
        s.mul_(dA[:, t, :, None, None]).add_((d[:, t, :, None] * xr[:, t])[..., None] * Bh[:, t, :, None, :])
        ys.append((s * Ch[:, t, :, None, :]).sum(-1))  # the reference's order: an fp32 sum of S terms
    y = torch.zeros(xs.shape, dtype=torch.float32, device=x.device)
    if rows.numel():
        y[rows] = _gate(torch.stack(ys, 1), xr, D, None if zs is None else zs[rows])
        state[dst] = s.to(state.dtype)
    return _finish(y.view(x.shape) if one else y, x, out)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., Q] -> [..., Q, Q]: the sum of a over (s, t] at [t, s] for s <= t, -inf above the
    diagonal (exp of it is the decay from token s to token t, 0 where s is later). Summed
    directly rather than as a difference of two prefix sums, which loses the digits a long
    chunk's decays need."""
    q = a.shape[-1]
    grid = a[..., :, None].expand(*a.shape, q)  # [..., t, s] = a[t]
    strict = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    seg = grid.masked_fill(~strict, 0).cumsum(-2)
    return seg.masked_fill(~strict.logical_or(torch.eye(q, dtype=torch.bool, device=a.device)), -math.inf)


def _sequence(x, d, A, B, C, s0, chunk):
    """One sequence of L tokens: x [L, H, P] fp32, d [L, H] fp32, B/C [L, G, S] fp32, s0 [H, P, S]
    fp32. Returns (y [L, H, P] without D and z, the final state [H, P, S])."""
    length, heads, headdim = x.shape
    groups, dstate = B.shape[1:]
    n = -(-length // chunk)
    pad = n * chunk - length  # a padded token has d = 0: no decay, no input, no effect
    if pad:
        x, d, B, C = (F.pad(t, (0, 0) * (t.ndim - 1) + (0, pad)) for t in (x, d, B, C))
    rep = heads // groups
    x = x.view(n, chunk, groups, rep, headdim)
    dx = x * d.view(n, chunk, groups, rep, 1)
    a = (d * A).view(n, chunk, heads).transpose(1, 2)  # [n, H, Q]
    cs = a.cumsum(-1)
    Bc, Cc = B.view(n, chunk, groups, dstate), C.view(n, chunk, groups, dstate)
    # Inside each chunk: y[t] = sum_{s<=t} (C[t]·B[s]) exp(cs[t]-cs[s]) d[s] x[s].
    decay = torch.exp(_segsum(a)).view(n, groups, rep, chunk, chunk)
    cb = torch.einsum("ctgn,csgn->cgts", Cc, Bc)
    y = torch.einsum("cgrts,csgrp->ctgrp", decay * cb[:, :, None], dx)
    # Each chunk's own contribution to the state at its end, then the boundaries in order.
    after = a.flip(-1).cumsum(-1).flip(-1) - a  # the sum of a over (s, Q-1], again summed directly
    tail = torch.exp(after).view(n, groups, rep, chunk)
    contrib = torch.einsum("cgrs,csgrp,csgn->cgrpn", tail, dx, Bc).reshape(n, heads, headdim, dstate)
    whole = torch.exp(cs[..., -1])  # [n, H]: the decay across each chunk
    starts = []
    s = s0
    for c in range(n):
        starts.append(s)
        s = s * whole[c, :, None, None] + contrib[c]
    start = torch.stack(starts).view(n, groups, rep, headdim, dstate)
    # The state a chunk starts from reaches token t decayed by exp(cs[t]).
    inflow = torch.exp(cs).view(n, groups, rep, chunk)
    y = y + torch.einsum("ctgn,cgrpn,cgrt->ctgrp", Cc, start, inflow)
    return y.reshape(n * chunk, heads, headdim)[:length], s


def _scan(x, dt, A, B, C, cu_seqlens=None, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=0.0,
          dt_max=math.inf, *, ssm_states=None, state_indices=None, has_initial_state=None, pad_slot_id=-1,
          out=None, chunk=128):
    total, heads, headdim = x.shape
    starts = [0, total] if cu_seqlens is None else cu_seqlens.tolist()
    batch = len(starts) - 1
    slots = list(range(batch)) if state_indices is None else state_indices.tolist()
    init = [False] * batch if has_initial_state is None else has_initial_state.tolist()
    d_all = process_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    zero = torch.zeros(heads, headdim, B.shape[-1], dtype=torch.float32, device=x.device)
    for b in range(batch):
        slot, lo, hi = slots[b], starts[b], starts[b + 1]
        if ssm_states is not None and slot == pad_slot_id:
            continue
        s0 = ssm_states[slot].float() if ssm_states is not None and init[b] else zero
        if hi > lo:
            y[lo:hi], s = _sequence(x[lo:hi].float(), d_all[lo:hi], A, B[lo:hi].float(), C[lo:hi].float(), s0,
                                    chunk)
            y[lo:hi] = _gate(y[lo:hi], x[lo:hi], D, None if z is None else z[lo:hi])
        else:
            s = s0
        if ssm_states is not None:
            ssm_states[slot] = s.to(ssm_states.dtype)
    return _finish(y, x, out)


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(id="aten", op="selective_state_update", version="1", fn=selective_state_update,
                     isolate=False, capabilities=SsmCapabilities(**_CAPS),
                     description="torch ops: slots gathered, T tokens stepped for the whole batch, scattered back"))
    tactics = {f"chunk{q}": with_fixed(_scan, f"chunk{q}", chunk=q) for q in (64, 128, 256)}
    register(Variant(id="torch_chunked", op="ssd_chunk_scan", version="1", fn=tactics["chunk128"], tactics=tactics,
                     isolate=False, capabilities=SsmCapabilities(**_CAPS),
                     description="the chunked (SSD) scan in torch ops: batched products inside chunks, "
                                 "chunk boundaries stepped in order; chunk size as tactics"))
