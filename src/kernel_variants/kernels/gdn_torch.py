"""The gated delta rule ops in plain torch ops, for any device torch runs on:

- ``aten`` for ``gated_delta_rule_update``: the batch's slots gathered into one fp32 tensor,
  the tokens stepped for every sequence at once (sequences of equal length; a varlen call steps
  them apart), the slots scattered back;
- ``torch_chunked`` for ``chunk_gated_delta_rule``: the chunked form. Inside a chunk of Q
  tokens the writes ``u`` solve a unit lower-triangular system,
  ``(I + diag(beta) L) u = beta (v - exp(G) K S0)`` with ``L[t, j] = exp(G_t - G_j) k_t·k_j``
  (j < t) and G the chunk's running sum of g, so ``u = W - Kc S0`` where W and Kc come from
  batched triangular solves over every chunk at once; then per chunk, in order, the output
  ``exp(G) Q S0 + (Q Kᵀ ∘ decay) u`` and the state at the chunk's end. Matrix products instead
  of a token loop: long sequences gain, short ones pay the set-up. Chunk size as the tactic.
"""

from __future__ import annotations

import torch

from kernel_variants.kernels._adapters import with_fixed
from kernel_variants.ops.gdn import GdnCapabilities
from kernel_variants.ops.gdn._reference import EPS, gdn_gating
from kernel_variants.plugin import Variant, hookimpl

_CAPS = dict(devices={"cpu", "cuda"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True)


def _prepared(q: torch.Tensor, k: torch.Tensor, hv: int, l2norm: bool, scale: float | None):
    """q, k [T, Hk, K] -> fp32 [T, Hv, K] (each v head's), normalised, q scaled."""
    rep = hv // q.shape[1]
    q, k = q.float().repeat_interleave(rep, dim=1), k.float().repeat_interleave(rep, dim=1)
    if l2norm:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + EPS)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + EPS)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def _steps(S, q, k, v, g, beta):
    """Token by token for a batch of sequences: S [b, Hv, K, V] in place; q, k [b, L, Hv, K];
    v [b, L, Hv, V]; g, beta [b, L, Hv]. Returns o [b, L, Hv, V] fp32."""
    out = []
    for t in range(v.shape[1]):
        S.mul_(torch.exp(g[:, t])[..., None, None])
        u = beta[:, t, :, None] * (v[:, t] - (S * k[:, t, :, :, None]).sum(-2))
        S.add_(k[:, t, :, :, None] * u[:, :, None, :])
        out.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, 1)


def gated_delta_rule_update(q, k, v, a, b, A_log, dt_bias, state, state_indices=None, cu_seqlens=None, *,
                            use_qk_l2norm=True, scale=None, softplus_beta=1.0, softplus_threshold=20.0,
                            pad_slot_id=-1, out=None):
    """q, k [T, Hk, K]; v [T, Hv, V]; a, b [T, Hv]; state [N, Hv, K, V] (updated in place).
    Returns o [T, Hv, V] in v's dtype (or ``out`` written)."""
    total, hv = v.shape[:2]
    starts = list(range(total + 1)) if cu_seqlens is None else cu_seqlens.tolist()
    batch = len(starts) - 1
    slots = list(range(batch)) if state_indices is None else state_indices.tolist()
    qf, kf = _prepared(q, k, hv, use_qk_l2norm, scale)
    g, beta = gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    groups: dict[int, list[int]] = {}  # sequences by length: each group stepped as one batch
    for i in range(batch):
        if slots[i] != pad_slot_id and starts[i + 1] > starts[i]:
            groups.setdefault(starts[i + 1] - starts[i], []).append(i)
    for length, members in groups.items():
        rows = torch.tensor([t for i in members for t in range(starts[i], starts[i] + length)], device=v.device)
        idx = torch.tensor([slots[i] for i in members], device=v.device)
        S = state[idx].float()
        n = len(members)

        def take(x, n=n, length=length, rows=rows):
            return x[rows].view(n, length, *x.shape[1:])

        o[rows] = _steps(S, take(qf), take(kf), take(v.float()), take(g), take(beta)).flatten(0, 1)
        state[idx] = S.to(state.dtype)
    return o.to(v.dtype) if out is None else out.copy_(o)


def _sequence(q, k, v, g, beta, S, chunk):
    """One sequence of L tokens, chunked: q, k [L, Hv, K], v [L, Hv, V], g, beta [L, Hv] (fp32),
    S [Hv, K, V] fp32. Returns (o [L, Hv, V], the final state)."""
    length, hv = k.shape[:2]
    n = -(-length // chunk)
    pad = n * chunk - length  # a padded token has g = 0 and beta = 0: no decay, no write, no effect

    def chunks(x):
        x = torch.nn.functional.pad(x, (0, 0) * (x.ndim - 1) + (0, pad)) if pad else x
        return x.view(n, chunk, *x.shape[1:]).transpose(1, 2)  # [n, Hv, Q, ...]

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]  # [n, Hv, Q]
    grid = g[..., :, None].expand(*g.shape, chunk)  # [.., t, j] = g[t]
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril(-1)
    seg = grid.masked_fill(~strict, 0).cumsum(-2)  # sum of g over (j, t], summed directly
    incl = strict | torch.eye(chunk, dtype=torch.bool, device=g.device)
    decay = torch.exp(seg).masked_fill(~incl, 0)  # exp(G_t - G_j) for j <= t
    G = g.cumsum(-1)
    eG = torch.exp(G)  # [n, Hv, Q]
    after = torch.nn.functional.pad(g.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))  # sum of g over (j, Q)
    lower = (k @ k.transpose(-1, -2)) * decay.masked_fill(~strict, 0) * beta[..., None]
    system = lower + torch.eye(chunk, device=g.device)
    W = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    Kc = torch.linalg.solve_triangular(system, (beta * eG)[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    qe = q * eG[..., None]
    ke = k * torch.exp(after)[..., None]
    whole = torch.exp(G[..., -1])  # [n, Hv]
    outs = []
    for c in range(n):
        u = W[c] - Kc[c] @ S
        outs.append(qe[c] @ S + scores[c] @ u)
        S = S * whole[c][:, None, None] + ke[c].transpose(-1, -2) @ u
    o = torch.stack(outs).transpose(1, 2).reshape(n * chunk, hv, v.shape[-1])
    return o[:length], S


def _chunked_scan(q, k, v, g, beta, cu_seqlens=None, *, ssm_states=None, state_indices=None, has_initial_state=None,
                  use_qk_l2norm=True, scale=None, pad_slot_id=-1, out=None, chunk=64):
    total, hv, vd = v.shape
    starts = [0, total] if cu_seqlens is None else cu_seqlens.tolist()
    batch = len(starts) - 1
    slots = list(range(batch)) if state_indices is None else state_indices.tolist()
    init = [False] * batch if has_initial_state is None else has_initial_state.tolist()
    qf, kf = _prepared(q, k, hv, use_qk_l2norm, scale)
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    zero = torch.zeros(hv, k.shape[-1], vd, dtype=torch.float32, device=v.device)
    for i in range(batch):
        lo, hi, slot = starts[i], starts[i + 1], slots[i]
        if ssm_states is not None and slot == pad_slot_id:
            continue
        S = ssm_states[slot].float() if ssm_states is not None and init[i] else zero
        if hi > lo:
            o[lo:hi], S = _sequence(qf[lo:hi], kf[lo:hi], v[lo:hi].float(), g[lo:hi].float(), beta[lo:hi].float(),
                                    S, chunk)
        if ssm_states is not None:
            ssm_states[slot] = S.to(ssm_states.dtype)
    return o.to(v.dtype) if out is None else out.copy_(o)


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(id="aten", op="gated_delta_rule_update", version="1", fn=gated_delta_rule_update,
                     isolate=False, capabilities=GdnCapabilities(**_CAPS),
                     description="torch ops: slots gathered, equal-length sequences stepped as one batch, scattered back"))
    tactics = {f"chunk{c}": with_fixed(_chunked_scan, f"chunk{c}", chunk=c) for c in (32, 64, 128)}
    register(Variant(id="torch_chunked", op="chunk_gated_delta_rule", version="1", fn=tactics["chunk64"],
                     tactics=tactics, isolate=False, capabilities=GdnCapabilities(**_CAPS),
                     description="the chunked gated delta rule in torch ops: triangular solves over all chunks, "
                                 "chunk boundaries stepped in order; chunk size as tactics"))
