"""The references: the gated delta rule in fp32, one token at a time (docs/contract.md, "Gated
delta rule"), and the gating as vLLM computes it."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

EPS = 1e-6  # the L2 normalisation's: q / sqrt(sum(q^2) + EPS), as fla's l2norm


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
               softplus_beta: float = 1.0, softplus_threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log, dt_bias [Hv]; a, b [T, Hv]. Returns (g, beta), each [T, Hv] fp32: the log decay
    ``-exp(A_log) * softplus(a + dt_bias)`` and the write strength ``sigmoid(b)``."""
    return (-torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), softplus_beta, softplus_threshold),
            torch.sigmoid(b.float()))


def _token(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           l2norm: bool, scale: float) -> torch.Tensor:
    """One token, in place on the fp32 state S [Hv, K, V]: q, k [Hv, K] (each v head's q/k
    head), v [Hv, V], g, beta [Hv]. Returns o [Hv, V] in fp32."""
    q, k, v = q.float(), k.float(), v.float()
    if l2norm:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + EPS)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + EPS)
    S.mul_(torch.exp(g)[:, None, None])
    u = beta[:, None] * (v - (S * k[:, :, None]).sum(1))
    S.add_(k[:, :, None] * u[:, None, :])
    return (S * (q * scale)[:, :, None]).sum(1)


def _run(q, k, v, g, beta, starts, slots, init, pool, pad_slot_id, l2norm, scale, out):
    _total, hv, vd = v.shape
    rep = hv // q.shape[1]
    qh, kh = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for b_, (lo, hi) in enumerate(itertools.pairwise(starts)):
        slot = slots[b_]
        if pool is not None and slot == pad_slot_id:
            continue
        if pool is not None and init[b_]:
            S = pool[slot].to(torch.float32, copy=True)
        else:
            S = torch.zeros(hv, q.shape[-1], vd, dtype=torch.float32, device=v.device)
        for t in range(lo, hi):
            o[t] = _token(S, qh[t], kh[t], v[t], g[t], beta[t], l2norm, scale)
        if pool is not None:
            pool[slot] = S.to(pool.dtype)
    return o.to(v.dtype) if out is None else out.copy_(o)


def gated_delta_rule_update(q, k, v, a, b, A_log, dt_bias, state, state_indices=None, cu_seqlens=None, *,
                            use_qk_l2norm=True, scale=None, softplus_beta=1.0, softplus_threshold=20.0,
                            pad_slot_id=-1, out=None):
    """q, k [T, Hk, K]; v [T, Hv, V]; a, b [T, Hv]; state [N, Hv, K, V] (updated in place).
    Returns o [T, Hv, V] in v's dtype (or ``out`` written)."""
    total = v.shape[0]
    starts = list(range(total + 1)) if cu_seqlens is None else cu_seqlens.tolist()
    batch = len(starts) - 1
    slots = list(range(batch)) if state_indices is None else state_indices.tolist()
    g, beta = gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    return _run(q, k, v, g, beta, starts, slots, [True] * batch, state, pad_slot_id, use_qk_l2norm, scale, out)


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, *, ssm_states=None, state_indices=None,
                           has_initial_state=None, use_qk_l2norm=True, scale=None, pad_slot_id=-1, out=None):
    """q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; ssm_states [N, Hv, K, V] (final states
    written). Returns o [T, Hv, V] in v's dtype (or ``out`` written)."""
    starts = [0, v.shape[0]] if cu_seqlens is None else cu_seqlens.tolist()
    batch = len(starts) - 1
    slots = list(range(batch)) if state_indices is None else state_indices.tolist()
    init = [False] * batch if has_initial_state is None else has_initial_state.tolist()
    return _run(q, k, v, g.float(), beta.float(), starts, slots, init, ssm_states, pad_slot_id, use_qk_l2norm, scale,
                out)
