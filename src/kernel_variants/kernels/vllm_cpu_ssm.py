"""``vllm_cpu``: vLLM-CPU's own C++ selective-scan kernels (``torch.ops._C``), as variants of the
state-space-scan ops, called the way vLLM's Mamba2 layer calls them on the CPU platform.

- ``selective_state_update_cpu`` (``selective_state_update``): vLLM hands it per-head values as
  stride-0 views (A ``[H, P, S]``, dt ``[B, H, P]``, dt_bias and D ``[H, P]``), and so do we.
- ``mamba_chunk_scan_fwd_cpu`` (``ssd_chunk_scan``): dt processed in fp32 first (bias, softplus,
  clamp, as vLLM's ``_mamba_chunk_scan_combined_fwd_cpu``), D 1-D fp32, final states
  ``[B, H, P, S]`` fp32 in (initial) and out (final), int32 ``cu_seqlens``.

What each kernel does, as measured on vLLM-CPU 0.32.0 (an AMD EPYC, Zen 5), and what is done
around it so that the results are the contract's:

- The decode kernel reads and writes every slot it is given, both ``state_batch_indices`` and
  ``dst_state_batch_indices`` (the contract reads one and writes the other), skips an index equal
  to the pad id it is handed but leaves that sequence's output row as it was (zeroed here), and
  its 4-D (several tokens per sequence) form gives wrong results. One token into the slot it
  reads runs in place on the pool; anything else (several tokens, a destination slot other than
  the source) runs on an fp32 copy of the live sequences' slots, a token at a time, written back
  once, rounded to the pool's dtype, into the destination slots.
- With a bfloat16 pool and a dstate not a multiple of 8 the decode kernel kills the process
  (seen with 9, 12, 17, 20): declared (``dstate_multiple_of``), so the dispatcher never sends
  such a call; qualification runs in a child process in any case.
- It has no dt clamp (``dt_min``/``dt_max``): declared (``dt_limit=False``).
- The prefill kernel keeps its states in a dense fp32 ``[B, H, P, S]`` tensor of its own: the
  live sequences' initial states are gathered into it (zeros without one), and their final
  states scattered back into the pool, in place; a padded sequence's output rows are zero.

Availability mirrors vLLM-CPU's own choice of library (``platforms/cpu.py: import_kernels``):
on x86-64 ``_C`` with AVX-512-BF16, ``_C_AVX512`` with AVX-512, ``_C_AVX2`` otherwise; ``_C``
elsewhere. Unlike the conv kernels, these need no AVX-512-BF16. The probe never imports vLLM
and runs no instruction to tell the CPU (torch's cpuinfo flags); where vLLM has loaded its
library already, its ops are used as they are.
"""

from __future__ import annotations

import math
import platform
from pathlib import Path
from typing import Any

import torch

from kernel_variants.kernels import vllm_cpu
from kernel_variants.kernels._adapters import LazyKernel, Param, mark_written
from kernel_variants.kernels._slots import int32
from kernel_variants.ops.ssm import SsmCapabilities
from kernel_variants.plugin import Variant, hookimpl

#: bf16 pools need a dstate that is a multiple of this (vLLM-CPU 0.32's decode kernel dies otherwise).
BF16_DSTATE_STEP = 8

_T, _OT, _B, _I = "Tensor", "Optional[Tensor]", "bool", "int"
SCHEMAS: dict[str, tuple[Param, ...]] = {
    "selective_state_update_cpu": tuple(Param(n, t) for n, t in (
        ("state", _T), ("x", _T), ("dt", _T), ("A", _T), ("B", _T), ("C", _T), ("D", _OT), ("z", _OT),
        ("dt_bias", _OT), ("dt_softplus", _B), ("state_batch_indices", _OT), ("dst_state_batch_indices", _OT),
        ("null_block_id", _I), ("out", _T), ("num_accepted_tokens", _OT), ("cu_seqlens", _OT))),
    "mamba_chunk_scan_fwd_cpu": tuple(Param(n, t) for n, t in (
        ("out", _T), ("final_states", _T), ("x", _T), ("dt", _T), ("A", _T), ("B", _T), ("C", _T),
        ("D", _OT), ("z", _OT), ("cu_seqlens", _T))),
}


def library_name() -> str:
    """The ``_C`` build vLLM-CPU would load on this CPU (as its ``import_kernels`` chooses)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def _library() -> tuple[Path | None, str | None]:
    """That library's file, found without importing vLLM."""
    name = library_name()
    return vllm_cpu._library(name, f"{name} library for this CPU")


class _Ops(LazyKernel):
    """The two kernels, loaded (and their schemas checked) on first need."""

    def find(self) -> tuple[Any, str | None]:
        return vllm_cpu.checked_ops("selective_state_update_cpu", SCHEMAS, _library)  # vLLM itself may have loaded the library


OPS = _Ops()


def probe() -> str | None:
    return OPS.probe()


def _rows(t: torch.Tensor, inner: int) -> torch.Tensor:
    """``t`` ``[..., a, b]`` with its last two dims dense (rows may be strided, as vLLM's views
    are: the kernels take those), else a dense copy."""
    return t if t.stride(-1) == 1 and t.stride(-2) == inner else t.contiguous()


def _per_head(v: torch.Tensor | None, headdim: int) -> torch.Tensor | None:
    """``[H]`` as vLLM hands it to the decode kernel: ``[H, P]``, a stride-0 view."""
    return None if v is None else v[:, None].expand(v.shape[0], headdim)


def selective_state_update(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False, dt_min: float = 0.0, dt_max: float = math.inf, *,
    state_batch_indices: torch.Tensor | None = None, dst_state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = -1, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """state [N, H, P, S] (updated in place); x [B, H, P] or [B, T, H, P]. No dt clamp."""
    ssu = OPS.kernel()["selective_state_update_cpu"]
    heads, headdim = x.shape[-2:]
    dstate, batch = state.shape[-1], x.shape[0]
    A3 = A[:, None, None].expand(heads, headdim, dstate)
    D2, bias2 = _per_head(D, headdim), _per_head(dt_bias, headdim)
    src = int32(state_batch_indices) if state_batch_indices is not None else torch.arange(batch, dtype=torch.int32)
    dst = src if dst_state_batch_indices is None else int32(dst_state_batch_indices)
    y = out if out is not None and out.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)

    def step(pool, xt, dtt, Bt, Ct, zt, yt, slots, pad):
        xt = _rows(xt, headdim)
        dtt = dtt if dtt.stride(-1) == 1 else dtt.contiguous()
        ssu(pool, xt, dtt.unsqueeze(-1).expand(*dtt.shape, headdim), A3, _rows(Bt, dstate),
            _rows(Ct, dstate), D2, None if zt is None else _rows(zt, headdim), bias2, dt_softplus, slots, slots,
            pad, yt, None, None)

    if x.ndim == 3 and (dst is src or torch.equal(src, dst)):
        # One token into the slot it reads: in place on the pool. The kernel skips the pad id's
        # sequences but leaves their rows of y as they were.
        step(state, x, dt, B, C, z, y, src, pad_slot_id)
        y.masked_fill_((src == pad_slot_id).view(batch, 1, 1), 0)
    else:
        # On an fp32 copy of the live slots, a token at a time; written back once, to dst.
        live = ((src != pad_slot_id) & (dst != pad_slot_id)).nonzero().flatten()
        y.zero_()
        if live.numel():
            work = state.index_select(0, src.long().index_select(0, live)).float()
            seq = (lambda t: t.unsqueeze(1)) if x.ndim == 3 else (lambda t: t)
            xs, dts, Bs, Cs = (seq(t).index_select(0, live) for t in (x, dt, B, C))
            zs = None if z is None else seq(z).index_select(0, live)
            ys = torch.empty(xs.shape, dtype=x.dtype)
            for t in range(xs.shape[1]):
                step(work, xs[:, t], dts[:, t], Bs[:, t], Cs[:, t], None if zs is None else zs[:, t], ys[:, t],
                     None, -1)
            y.index_copy_(0, live, ys.view(live.numel(), *x.shape[1:]))
            state.index_copy_(0, dst.long().index_select(0, live), work.to(state.dtype))
    mark_written(state, y)
    if out is not None and y is not out:
        return out.copy_(y)
    return y


def _process_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, lo: float, hi: float) -> torch.Tensor:
    """dt as vLLM's CPU prefill hands it to its kernel: fp32, bias added, softplus, clamped."""
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if softplus:
        d = torch.nn.functional.softplus(d)
    if lo > 0.0 or hi < math.inf:
        d = d.clamp(min=lo, max=hi)
    return d.contiguous()


def ssd_chunk_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None, dt_softplus: bool = False, dt_min: float = 0.0, dt_max: float = math.inf,
    *, ssm_states: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None, pad_slot_id: int = -1, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H, P]; cu_seqlens [B+1]; ssm_states [N, H, P, S] (final states written in place)."""
    scan = OPS.kernel()["mamba_chunk_scan_fwd_cpu"]
    total, heads, headdim = x.shape
    dstate = B.shape[-1]
    cu = int32(cu_seqlens) if cu_seqlens is not None else torch.tensor([0, total], dtype=torch.int32)
    batch = cu.shape[0] - 1
    states = torch.zeros(batch, heads, headdim, dstate, dtype=torch.float32)
    live = slots = None
    if ssm_states is not None:
        slots = state_indices.long() if state_indices is not None else torch.arange(batch)
        keep = slots != pad_slot_id
        live = keep.nonzero().flatten()
        if has_initial_state is not None:
            start = (keep & has_initial_state.to(torch.bool)).nonzero().flatten()
            states.index_copy_(0, start, ssm_states.index_select(0, slots.index_select(0, start)).float())
    y = out if out is not None and out.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)
    if total:
        scan(y, states, _rows(x, headdim), _process_dt(dt, dt_bias, dt_softplus, dt_min, dt_max), A,
             _rows(B, dstate), _rows(C, dstate), None if D is None else D.float().contiguous(),
             None if z is None else _rows(z, headdim), cu)
    if ssm_states is not None:
        assert live is not None and slots is not None
        if live.numel() < batch:  # padded sequences: zero output rows (the kernel ran them from zeros)
            bounds = cu.tolist()
            for b in (slots == pad_slot_id).nonzero().flatten().tolist():
                y[bounds[b]:bounds[b + 1]] = 0
        ssm_states.index_copy_(0, slots.index_select(0, live), states.index_select(0, live).to(ssm_states.dtype))
        mark_written(ssm_states)
    mark_written(y)
    if out is not None and y is not out:
        return out.copy_(y)
    return y


_DTYPES = {"float32", "bfloat16", "float16"}


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(
        id="vllm_cpu", op="selective_state_update", version="1", fn=selective_state_update, probe=probe,
        priority=20, depends=("torch", "vllm-cpu"),
        capabilities=SsmCapabilities(devices={"cpu"}, dtypes=_DTYPES, takes_out=True,
                                     states=frozenset({"float32", "bfloat16", "float16"}),
                                     dstate_multiple_of={"bfloat16": BF16_DSTATE_STEP}, dt_limit=False),
        description="vLLM-CPU's decode kernel (torch.ops._C.selective_state_update_cpu), in place on the pool for "
                    "one token; several tokens or another destination slot on an fp32 copy of the live slots",
    ))
    register(Variant(
        id="vllm_cpu", op="ssd_chunk_scan", version="1", fn=ssd_chunk_scan, probe=probe, priority=20,
        depends=("torch", "vllm-cpu"),
        capabilities=SsmCapabilities(devices={"cpu"}, dtypes=_DTYPES, takes_out=True),
        description="vLLM-CPU's prefill scan (torch.ops._C.mamba_chunk_scan_fwd_cpu), dt processed in fp32 first, "
                    "initial and final states gathered and scattered around it",
    ))
