"""``pto``: the PTO-ISA causal_conv1d kernel of sgl-kernel-npu PR #572, for prefill.

sgl_kernel_npu builds of PR #572 (d5630dff) register it as ``npu::causal_conv1d`` with the schema::

    causal_conv1d(Tensor x, Tensor weight, Tensor conv_states, Tensor query_start_loc,
                  Tensor cache_indices, Tensor has_initial_state, Tensor? bias=None,
                  bool activation_mode=False, int pad_slot_id=-1) -> Tensor

That schema is older than the PTO kernel: PR #420 (b07071fb) registered an earlier Ascend C
kernel under it, and PR #572 replaced that kernel keeping name and schema. PR #592 (8f13e502)
then registered the newer Ascend C kernel (``asc``) under the same name with another schema, so
the PTO kernel was ``npu::causal_conv1d`` on the main branch between d5630dff and 8f13e502 only;
every released wheel with this schema (tags up to 2026.7.0, among them 2026.6.1-2026.7.0) carries
the PR #420 kernel: W = 4 only, D a multiple of 16, and a state writeback that races at large
batch (fixed by PR #572). The package version does not tell them apart (every wheel since
2026.6.1 says 2026.6.1), so the probe asks the kernel itself: it calls the op once with W = 65,
which both host sides refuse before any launch, each with its own message ("Only filter widths
2..64" from PTO, "Only width == 4" from PR #420). The PR #420 kernel, or a message that is
neither, makes this variant unavailable with that reason: never a guess.

``KV_PTO_OP=namespace::name`` points this variant at a PTO build registered under another
name, so that it loads beside ``asc``. The kernel is recognised by its schema and that probe;
anything else makes the variant unavailable, with what was found in the reason.

Where it departs from the contract, and what the adapter does:

- weight ``[W, D]`` contiguous (passed as ``weight.t().contiguous()``); query_start_loc,
  cache_indices and has_initial_state are required tensors (the adapter builds them for dense
  input: offsets, slot b, all False), int32 / bool; ``activation_mode`` is a bool.
- D must be a multiple of 16: other D are zero-padded on the way in and sliced on the way out.
- history in rows ``0..W-2`` of a contiguous pool: a contiguous pool of exactly W-1 rows is
  passed as is, with ``query_start_loc`` and the caller's slot ids (packed input included);
  any other pool goes through a contiguous buffer of the used slots, indexed by compact ids
  with pads as a negative marker (never the caller's ``pad_slot_id``, which may be one of
  0..B-1), scattered back in place into the caller's pool.
- output rows of padded sequences are left unwritten: zeroed by the adapter. Empty sequences are
  skipped by the kernel; the adapter zeroes the history of sequences without initial state
  first, which gives them the contract's zero history.
- bf16 and fp16 only; W in 2..64. No decode op. No host read on the adapter's side: graph_safe.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kernel_variants.kernels._adapters import (
    ADAPTER_SOURCES,
    SGL_NPU_DEPENDS,
    OpAdapter,
    OpRef,
    Param,
    dist_version,
    prefill_rows0,
    schema_mismatch,
)
from kernel_variants.plugin import ConvCapabilities, Variant, hookimpl

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
PROBE_WIDTH = 65  # refused by the PTO host (2..64) and the PR #420 host (4 only), before any launch
PTO_WIDTH_MESSAGE = "Only filter widths 2..64"
OLDER_WIDTH_MESSAGE = "Only width == 4"


def default_ref(env=None) -> OpRef:
    """``npu::causal_conv1d``, or the op named by ``KV_PTO_OP``."""
    env = os.environ if env is None else env
    name = env.get(ENV_OP, "").strip() or "npu::causal_conv1d"
    return OpRef(name, modules=("sgl_kernel_npu",), device="npu")


class PtoAdapter(OpAdapter):
    SCHEMA = SCHEMA
    WHAT = "the PTO-ISA kernel's (sgl-kernel-npu PR #572)"

    def find(self) -> tuple[Any, str | None]:
        op, why = self.ref.load()
        if why is None:
            why = schema_mismatch(op._schema, self.SCHEMA, self.WHAT)
            if why is not None and self.ref.qualname == "npu::causal_conv1d":
                why += f"; set {ENV_OP} to the name of a PTO build registered under another namespace"
        if why is None:
            why = self.identify(op)
        return op, why

    def identify(self, op: Any) -> str | None:
        """None when ``op`` is the PTO kernel, else why not: the same schema also names the
        earlier Ascend C kernel of PR #420. One call with W = 65, refused by either host side
        before anything is launched; the message says which kernel it is."""
        device = "npu" if self.ref.device == "npu" else "cpu"
        f16 = dict(dtype=torch.float16, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        args = (torch.zeros(1, 1, DIM_MULTIPLE, **f16), torch.zeros(PROBE_WIDTH, DIM_MULTIPLE, **f16),
                torch.zeros(1, PROBE_WIDTH - 1, DIM_MULTIPLE, **f16), torch.tensor([0, 1], **i32),
                torch.zeros(1, **i32), torch.zeros(1, dtype=torch.bool, device=device))
        try:
            op(*args, None, False, -1)
        except Exception as exc:  # the host's TORCH_CHECK arrives as RuntimeError; anything else is unknown too
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if PTO_WIDTH_MESSAGE in message:
                return None
            if OLDER_WIDTH_MESSAGE in message:
                return (f"{self.ref.qualname} is the earlier Ascend C kernel of sgl-kernel-npu PR #420 "
                        f"({dist_version('sgl-kernel-npu')}; released wheels up to 2026.7.0 carry it under the PTO "
                        "kernel's schema), not the PTO-ISA kernel: W = 4 only and a state writeback that races at "
                        "large batch, so it is not used. A build with PR #592 serves prefill as `asc`")
            return (f"{self.ref.qualname} has the PTO kernel's schema but cannot be identified as the PTO-ISA kernel "
                    f"(sgl-kernel-npu PR #572): W={PROBE_WIDTH} was refused with {message!r}")
        return (f"{self.ref.qualname} has the PTO kernel's schema but accepted W={PROBE_WIDTH}, which neither the "
                "PTO-ISA kernel (PR #572) nor the earlier Ascend C kernel (PR #420) does: not used")

    def causal_conv1d_fn(self, x, weight, bias=None, *, conv_states=None, cache_indices=None,
                         has_initial_state=None, query_start_loc=None, activation=None, pad_slot_id=-1):
        """x: [B, L, D] or [T, D] with query_start_loc; weight: [D, W]; conv_states: [N, S, D]
        updated in place; returns x's shape and dtype."""
        op = self.kernel()

        def call(x_in, w_in, states, qsl, ci, init, b_in, silu, pad_id):
            if qsl is None:  # dense input: the kernel still takes the offsets
                batch, length = x_in.shape[0], x_in.shape[1]
                qsl = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=x_in.device)
            return op(x_in, w_in, states, qsl, ci, init, b_in, silu, pad_id)

        return prefill_rows0(call, x, weight, bias, conv_states, cache_indices, has_initial_state,
                             query_start_loc, activation is not None, pad_slot_id, dim_multiple=DIM_MULTIPLE)


def variants(adapter: PtoAdapter, *, vid: str = "pto", devices=frozenset({"npu"}), priority: int = 10) -> list[Variant]:
    version = "1"  # what the kernel's speed depends on is declared below (depends=...)
    return [
        Variant(id=vid, op="causal_conv1d_fn", version=version, depends=SGL_NPU_DEPENDS, fn=adapter.causal_conv1d_fn, probe=adapter.probe,
                priority=priority, sources=ADAPTER_SOURCES,
                capabilities=ConvCapabilities(devices=devices, dtypes={"bfloat16", "float16"}, width=(2, 64),
                                              varlen=True, noncontiguous_states=True, graph_safe=True),
                description=f"sgl-kernel-npu PTO-ISA causal_conv1d (PR #572) as {adapter.ref.qualname}"),
    ]


@hookimpl
def kv_register_variants(register) -> None:
    for v in variants(PtoAdapter(default_ref())):
        register(v)
