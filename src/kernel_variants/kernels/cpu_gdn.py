"""``cpu_native`` for the gated delta rule ops (Qwen3-Next's GDN linear attention): the C++ kernel
in ``cpu_native/csrc/gdn_*`` (AVX2 / AVX-512 / AVX-512-BF16 chosen at run time).

One work item per (sequence, v head), run whole by one thread (results do not depend on the
thread count). The head's ``[K, V]`` fp32 state is vectorised along V and cut into column tiles
that stay in L1 while a block of up to 64 tokens runs through them; it is read from its slot once
and written back once (rounded once to a bf16 pool; an fp32 slot is worked on in place for a
sequence of one block). Each pass over a tile updates the state and forms the outputs and the
next step's ``Sᵀk``: three FMAs per element and token, the decay kept as a running scale (folded
into the state when it leaves [1e-18, 1e18] and at the end of each block). On AVX-512, whose
512-bit stores take two cycles, tokens go in pairs (one store per element per two tokens, a
rank-2 update); a one-token decode step streams the slot in tiles of 8 vectors.

The decode op fuses the gating (``softplus`` with its beta and threshold, ``sigmoid``); the
prefill op takes ``g`` and ``beta`` as given. The chunked (WY) form is not registered: in fp32 it
costs the recurrence's three multiply-adds per state element and token plus the chunk's own
products (K Kᵀ, Q Kᵀ, the triangular solve). Built and measured once (2026-12-07, Intel Xeon
family 6 model 167, 1 thread, Hv=32, K=V=128, one sequence, fp32 state): with register-blocked
products, the K Kᵀ / Q Kᵀ of a q/k head shared by its v heads, denormals flushed and the next
chunk's rows prefetched, chunks of 24-64 ran at 1.02-1.10x the recurrent kernel's time from 512
tokens on AVX-512 (29.3 vs 28.6 µs per token at best) and 1.2-1.35x on AVX2: no shape it would win
(and that was before the pair passes were unrolled, 4-10% more for the recurrent kernel).
"""

from __future__ import annotations

import torch

from kernel_variants._native import build
from kernel_variants.kernels.cpu_native import _kernel_out, _native, _on_dense_slots
from kernel_variants.kernels.cpu_native._build import GDN
from kernel_variants.ops.gdn import GdnCapabilities
from kernel_variants.plugin import Variant, hookimpl

_NATIVE_GDN = _native(GDN)


def _finish(res: torch.Tensor, out: torch.Tensor | None, kout: torch.Tensor | None) -> torch.Tensor:
    return res if out is None or kout is not None else out.copy_(res)


def gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k: [T, Hk, K]; v: [T, Hv, V]; a, b: [T, Hv]; A_log, dt_bias: [Hv]; state: [N, Hv, K, V]
    pool, updated in place at state_indices [B]; cu_seqlens: [B+1] (None: T sequences of one
    token). Returns o [T, Hv, V] in v's dtype (``out`` when given)."""
    kout, _ = _kernel_out(out)
    ext = build.load_extension(GDN)
    res = _on_dense_slots(state, lambda pool: ext.update(
        q, k, v, a, b, A_log, dt_bias, pool, state_indices, cu_seqlens, use_qk_l2norm, scale, softplus_beta,
        softplus_threshold, pad_slot_id, kout))
    return _finish(res, out, kout)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    ssm_states: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k: [T, Hk, K]; v: [T, Hv, V]; g, beta: [T, Hv]; cu_seqlens: [B+1] (None: one sequence);
    ssm_states: None or [N, Hv, K, V] pool (read where has_initial_state [B], written at
    state_indices [B]). Returns o [T, Hv, V] in v's dtype (``out`` when given)."""
    kout, _ = _kernel_out(out)
    ext = build.load_extension(GDN)
    res = _on_dense_slots(ssm_states, lambda pool: ext.scan(
        q, k, v, g, beta, cu_seqlens, pool, state_indices, has_initial_state, use_qk_l2norm, scale, pad_slot_id,
        kout))
    return _finish(res, out, kout)


@hookimpl
def kv_register_variants(register) -> None:
    caps = GdnCapabilities(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True)
    common = dict(id="cpu_native", version="1", priority=30, capabilities=caps, **_NATIVE_GDN)
    register(Variant(op="gated_delta_rule_update", fn=gated_delta_rule_update, **common,
                     description="fused C++ decode step (gating fused): each head's state read, updated and "
                                 "written once, parallel over (sequence, head)"))
    register(Variant(op="chunk_gated_delta_rule", fn=chunk_gated_delta_rule, **common,
                     description="C++ recurrent scan: each head's fp32 state in L1-resident column tiles across "
                                 "the sequence, three FMAs per element and token, parallel over (sequence, head)"))
