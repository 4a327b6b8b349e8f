"""``pto``: the PTO-ISA causal_conv1d kernel of sgl-kernel-npu PR #572, for prefill.

sgl_kernel_npu builds of PR #572 register it as ``npu::causal_conv1d`` with the schema::

    causal_conv1d(Tensor x, Tensor weight, Tensor conv_states, Tensor query_start_loc,
                  Tensor cache_indices, Tensor has_initial_state, Tensor? bias=None,
                  bool activation_mode=False, int pad_slot_id=-1) -> Tensor

PR #592 later registered the Ascend C kernel under the same name with another schema, so only
one of them can be ``npu::causal_conv1d`` in a process. ``KV_PTO_OP=namespace::name`` points
this variant at a PTO build registered under another name, so that it loads beside ``asc``.
The kernel is recognised by its schema; any other schema makes the variant unavailable, with
the schema found in the reason.

Where it departs from the contract, and what the adapter does:

- weight ``[W, D]`` contiguous (passed as ``weight.t().contiguous()``); query_start_loc,
  cache_indices and has_initial_state are required tensors (the adapter builds them for dense
  input: offsets, slot b, all False), int32 / bool; ``activation_mode`` is a bool.
- D must be a multiple of 16: other D are zero-padded on the way in and sliced on the way out.
- history in rows ``0..W-2`` of a contiguous pool: a contiguous pool of exactly W-1 rows is
  passed as is, any other through a contiguous buffer of the used slots, scattered back in
  place into the caller's pool.
- output rows of padded sequences are left unwritten: zeroed by the adapter. Empty sequences are
  skipped by the kernel; the buffer path gives them the contract's zero history.
- bf16 and fp16 only; W in 2..64. No decode op.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.registry import Variant, hookimpl

from ._adapters import LazyKernel, OpRef, Param, dist_version, prefill_rows0, schema_mismatch

SCHEMA = (
    Param("x", "Tensor"),
    Param("weight", "Tensor"),
    Param("conv_states", "Tensor"),
    Param("query_start_loc", "Tensor"),
    Param("cache_indices", "Tensor"),
    Param("has_initial_state", "Tensor"),
    Param("bias", "Optional[Tensor]", True),
    Param("activation_mode", "bool", True),
    Param("pad_slot_id", "int", True),
)
DIM_MULTIPLE = 16
ENV_OP = "KV_PTO_OP"


def default_ref(env=None) -> OpRef:
    """``npu::causal_conv1d``, or the op named by ``KV_PTO_OP``."""
    env = os.environ if env is None else env
    name = env.get(ENV_OP, "").strip() or "npu::causal_conv1d"
    return OpRef(name, modules=("sgl_kernel_npu",), device="npu")


class PtoAdapter(LazyKernel):
    def __init__(self, ref: OpRef) -> None:
        super().__init__()
        self.ref = ref

    def find(self) -> tuple[Any, str | None]:
        op, why = self.ref.load()
        if why is None:
            why = schema_mismatch(op._schema, SCHEMA, "the PTO-ISA kernel's (sgl-kernel-npu PR #572)")
            if why is not None and self.ref.qualname == "npu::causal_conv1d":
                why += f"; set {ENV_OP} to the name of a PTO build registered under another namespace"
        return op, why

    def causal_conv1d_fn(self, x, weight, bias=None, *, conv_states=None, cache_indices=None,
                         has_initial_state=None, query_start_loc=None, activation=None, pad_slot_id=-1):
        """x: [B, L, D] or [T, D] with query_start_loc; weight: [D, W]; conv_states: [N, S, D]
        updated in place; returns x's shape and dtype."""
        op = self.kernel()

        def call(x_in, w_in, states, qsl, ci, init, b_in, silu):
            if qsl is None:  # dense input: the kernel still takes the offsets
                batch, length = x_in.shape[0], x_in.shape[1]
                qsl = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=x_in.device)
            return op(x_in, w_in, states, qsl, ci, init, b_in, silu, pad_slot_id)

        return prefill_rows0(call, x, weight, bias, conv_states, cache_indices, has_initial_state,
                             query_start_loc, activation is not None, pad_slot_id, dim_multiple=DIM_MULTIPLE)


def variants(adapter: PtoAdapter, *, vid: str = "pto", devices=frozenset({"npu"}), priority: int = 10) -> list[Variant]:
    version = f"1+{dist_version('sgl-kernel-npu')}"  # a new kernel package makes old timings stale
    return [
        Variant(id=vid, op="causal_conv1d_fn", version=version, fn=adapter.causal_conv1d_fn, probe=adapter.probe,
                priority=priority, sources=(str(Path(__file__).with_name("_adapters.py")),),
                capabilities=ConvCapabilities(devices=devices, dtypes={"bfloat16", "float16"}, width=(2, 64),
                                          varlen=True, noncontiguous_states=True),
                description=f"sgl-kernel-npu PTO-ISA causal_conv1d (PR #572) as {adapter.ref.qualname}"),
    ]


@hookimpl
def kv_register_variants(register) -> None:
    for v in variants(PtoAdapter(default_ref())):
        register(v)
