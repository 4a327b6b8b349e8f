"""``cpu_native`` for the state-space-scan ops (Mamba2's selective scan): the C++ kernel in
``cpu_native/csrc/ssm_scan_*`` (AVX2 / AVX-512 / AVX-512-BF16 chosen at run time).

One work item per (sequence, head), run whole by one thread (results do not depend on the thread
count): the head's ``[P, S]`` state is read from its slot once (converted to fp32), kept in L1/L2
across the sequence's tokens, and written back once (rounded to the pool's dtype), in place for
an fp32 pool; a one-token update of a 16-bit pool converts on the fly in one pass. Each token
updates the state with one mul and one FMA per 16 values (vectorised along S, B and C in
registers) and forms ``y`` with one more FMA and a transpose-and-add row sum.

``ssd_chunk_scan`` runs token by token (the variant's ``fn`` and its ``recurrent`` tactic: 3
vector ops per state element per token, near the FMA bound) or in the chunked SSD form (tactics
``chunk<Q>``): per chunk of Q tokens and head, ``y`` from the chunk's start state
(``[Q, S] x [S, P]``) plus the masked ``(C Bᵀ ∘ decay) x`` inside the chunk (``C Bᵀ`` formed once
per (sequence, group) with B and C in fp32), and the state carried over by one ``[S, Q] x [Q, P]``
product: ~2 multiply-adds per state element per token in register-blocked GEMM kernels, the
decays as products of the fp32 ``exp(d A)`` factors. The chunked form's set-up per head (the
state transposed in and out, the decays) does not pay for itself on the shortest sequences:
those under 10 tokens with an initial state (24 in the AVX2 build), or under 3 from zeros, go
token by token inside the chunked tactics too. Measured (1 thread, AMD Zen 5, AVX-512-BF16
build, H=64, P=64, S=128, G=1, bf16, one sequence, alternating rounds), chunk16 / chunk32 over
the recurrent, with an initial state: 1.3x at L=32, 1.3-1.4x at 128, 1.36-1.42x at 512,
1.38-1.41x at 2048, equal at 8 (token by token there); from zeros 1.2x at L=4, 1.5x at 8, 1.46x
at 512. chunk64 1.15-1.36x; chunk128 (not exposed) 1.13-1.27x. The AVX2 build: 1.24-1.33x at
L=32-128 with an initial state.
"""

from __future__ import annotations

import math

import torch

from kernel_variants._native import build
from kernel_variants.kernels._adapters import with_fixed
from kernel_variants.kernels.cpu_native import _kernel_out, _native, _on_dense_slots
from kernel_variants.kernels.cpu_native._build import SSM
from kernel_variants.ops.ssm import SsmCapabilities
from kernel_variants.plugin import Variant, hookimpl

_NATIVE_SSM = _native(SSM)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    *,
    state_batch_indices: torch.Tensor | None = None,
    dst_state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """state: [N, H, P, S] pool, updated in place; x: [B, H, P] or [B, T, H, P]; dt: [B, H] or
    [B, T, H]; A: [H]; B, C: [B, G, S] or [B, T, G, S]; D, dt_bias: [H]; z: x's shape. Returns y
    of x's shape and dtype (``out`` when given)."""
    one = x.dim() == 3  # one token per sequence: the kernel takes [B, T, ...]
    if one:
        x, dt, B, C = x.unsqueeze(1), dt.unsqueeze(1), B.unsqueeze(1), C.unsqueeze(1)
        z = None if z is None else z.unsqueeze(1)
    kout, _ = _kernel_out(out)
    if kout is not None and one:
        kout = kout.unsqueeze(1)
    ext = build.load_extension(SSM)
    res = _on_dense_slots(state, lambda pool: ext.update(
        pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, state_batch_indices,
        dst_state_batch_indices, pad_slot_id, kout))
    if one:
        res = res.squeeze(1)
    if out is None:
        return res
    return out if kout is not None else out.copy_(res)  # out itself, not the kernel's [B, 1, H, P] view


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    *,
    ssm_states: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """x: [T, H, P]; dt: [T, H]; A: [H]; B, C: [T, G, S]; cu_seqlens: [B+1]; D, dt_bias: [H];
    z: x's shape; ssm_states: None or [N, H, P, S] pool (read where has_initial_state, written);
    state_indices, has_initial_state: [B]. Returns y [T, H, P] in x's dtype (``out`` when given).
    ``chunk``: 0 token by token, Q > 0 the chunked form in chunks of Q tokens."""
    kout, _ = _kernel_out(out)
    ext = build.load_extension(SSM)
    res = _on_dense_slots(ssm_states, lambda pool: ext.scan(
        x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, dt_min, dt_max, pool, state_indices,
        has_initial_state, pad_slot_id, kout, chunk))
    return res if out is None or kout is not None else out.copy_(res)


#: The chunk sizes exposed as tactics (``chunk<Q>``).
CHUNKS = (16, 32, 64)


@hookimpl
def kv_register_variants(register) -> None:
    caps = SsmCapabilities(devices={"cpu"}, dtypes={"float32", "bfloat16", "float16"}, takes_out=True)
    common = dict(id="cpu_native", version="1", priority=30, capabilities=caps, **_NATIVE_SSM)
    register(Variant(op="selective_state_update", fn=selective_state_update, **common,
                     description="fused C++ decode step: state read, updated and written in one pass, parallel "
                                 "over (sequence, head)"))
    tactics = {"recurrent": with_fixed(ssd_chunk_scan, "recurrent", chunk=0),
               **{f"chunk{q}": with_fixed(ssd_chunk_scan, f"chunk{q}", chunk=q) for q in CHUNKS}}
    # Where no table says otherwise (a process that never calibrated), chunks of 32: they take the
    # token-by-token path below their own crossover, and measured 1.3-1.45x it from 32 tokens.
    register(Variant(op="ssd_chunk_scan", fn=tactics["chunk32"], tactics=tactics, **common,
                     description="C++ scan, parallel over (sequence, head): token by token (tactic recurrent: "
                                 "the fp32 state kept in L1, vectorised along S) or the chunked SSD form (fn: "
                                 "chunks of 32; tactics chunk<Q>: register-blocked GEMM kernels per chunk, "
                                 "C Bᵀ once per group; short sequences token by token)"))
