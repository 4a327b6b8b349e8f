"""``triton``: this project's own Triton kernels for both ops, channel-last, for CUDA.

Prefill is two launches. The first is token-major: a program covers ``BLOCK_T`` consecutive
tokens of the packed (or dense) input by ``BLOCK_D`` channels and walks its tokens in order,
loading each input row once and keeping the last W-1 rows in registers (a sliding window), so
that no tap reloads a tile; each token finds its sequence (dense: ``t // L``; varlen: a
per-token sequence id from ``searchsorted`` on ``query_start_loc``, no host sync), and a tap
that falls before the sequence's first token reads the history rows of its slot instead. The
second launch writes the new history (last W-1 rows of history ++ tokens), one program per
sequence and channel block, after every read of the old history has happened. Decode is one
launch, one program per sequence and channel block: it reads the history and the rows the new
slot is built from, then (after a barrier) writes the slot and the output.

Every tensor is addressed through its strides, so the state lands in the caller's pool also when
it is a non-contiguous view. Arithmetic in fp32, results cast to x's dtype. A slot id outside
``[0, N)`` (or, in decode, a ``num_accepted_tokens`` outside ``1..L``), which reaches a kernel
only off the CPU (where the dispatcher counts such values on the device instead of reading
them) or with ``KV_CHECK_VALUES=0``, is treated as a pad, as vLLM's kernels mask
``coord < num_cache_lines``: zero output, nothing read or written, never memory outside the
pool. The variants declare it (``slot_bounds_safe``), so the dispatcher hands them the caller's
indices as they are instead of rewriting them first. The decode kernel also counts such values
(``counts_bad_values``): the first channel block of each sequence adds its bad slot id, its
slot's reuse by an earlier live sequence and its bad count to ``bad_value_counter(x)`` with
atomics, so a decode call launches no device rule before it. Launches run under ``x``'s device
(``torch.cuda.device``, where it is not the current one already), so a tensor on another GPU
than the current one is never handed to a kernel compiled and launched for the current one.
Nothing reads a tensor's values on the host: the variants are declared graph_safe.

Block sizes are chosen per shape by the calibrator: ``triton`` (block sizes by a heuristic)
declares each configuration in ``FN_CONFIGS`` / ``UPDATE_CONFIGS`` as a tactic (``triton:d64_t32``,
``triton:d64``...), measured, qualified and chosen as a candidate of its own. (They were variant
ids of their own, ``triton_d64_t32``..., before: the table moves such rows to the tactics.) The kernels are built on first use, so ``import kernel_variants``
works without triton; they run on CUDA, or on the CPU under the Triton interpreter when
``TRITON_INTERPRET=1`` is set before they are first used (the variants then also declare the
CPU, at a priority below every native CPU variant, since the interpreter is very slow).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernel_variants.kernels._adapters import mark_written, with_fixed
from kernel_variants.kernels._triton import (
    DEPENDS,
    cdiv,
    dense,
    device_guard,
    interpreting,
    pow2,
    probe,
)
from kernel_variants.kernels._triton_conv_kernels import MAX_WIDTH, kernels
from kernel_variants.plugin import ConvCapabilities, Variant, bad_value_counter, hookimpl

# The jitted bodies live beside this module: its timings go stale when they change too.
SOURCES = ("_triton_conv_kernels.py",)


@dataclass(frozen=True)
class Blocks:
    """A block configuration: channels per program, and (prefill) tokens per program."""

    d: int
    t: int | None = None

    @property
    def name(self) -> str:
        """The tactic's name."""
        return f"d{self.d}" if self.t is None else f"d{self.d}_t{self.t}"

    @property
    def id(self) -> str:
        """The candidate's name (in the table, force and KV_FORCE)."""
        return f"triton:{self.name}"


FN_CONFIGS = (Blocks(32, 64), Blocks(64, 32), Blocks(128, 16), Blocks(256, 8))
UPDATE_CONFIGS = (Blocks(32), Blocks(64), Blocks(128), Blocks(256))


def fn_heuristic(tokens: int, dim: int) -> Blocks:
    """Fill the GPU with programs first, then widen the channel block."""
    d = min(128, max(16, pow2(dim)))
    t = 32 if tokens >= 4096 else 16
    return Blocks(d, t)


@functools.lru_cache(maxsize=1024)  # per decode call: one Blocks per (batch, dim) seen
def update_heuristic(batch: int, dim: int) -> Blocks:
    return Blocks(min(256 if batch <= 16 else 128, max(16, pow2(dim))))


def causal_conv1d_fn(x, weight, bias=None, *, conv_states=None, cache_indices=None, has_initial_state=None,
                     query_start_loc=None, activation=None, pad_slot_id=-1, blocks: Blocks | None = None,
                     out=None):
    """x: [B, L, D], or [T, D] with query_start_loc; weight: [D, W]; conv_states: [N, S, D]
    updated in place; returns x's shape and dtype (contiguous), or writes ``out`` (contiguous,
    x's shape and dtype, not x) and returns it."""
    k = kernels(interpreting())
    width = weight.shape[1]
    varlen = query_start_loc is not None
    x2 = x if varlen else x.reshape(-1, x.shape[-1])  # a view for the usual contiguous x
    tokens, dim = x2.shape
    length = 1 if varlen else x.shape[1]
    batch = query_start_loc.shape[0] - 1 if varlen else x.shape[0]
    blocks = blocks or fn_heuristic(tokens, dim)
    given = out
    out = torch.empty((tokens, dim), dtype=x.dtype, device=x.device) if given is None else given.view(tokens, dim)
    has_states = conv_states is not None
    has_hist = has_states and has_initial_state is not None
    dummy = out  # stands in for absent pointers; never dereferenced
    st = conv_states if has_states else dummy
    ci = dense(cache_indices) if cache_indices is not None else dummy
    init = dense(has_initial_state).view(torch.uint8) if has_hist else dummy
    qsl = dense(query_start_loc) if varlen else dummy
    seq = dummy
    if varlen:
        seq = torch.searchsorted(qsl, torch.arange(tokens, device=x.device, dtype=qsl.dtype), right=True) - 1
    rows = conv_states.shape[1] if has_states else width - 1
    n_slots = conv_states.shape[0] if has_states else 0
    ss = conv_states.stride() if has_states else (0, 0, 0)
    with device_guard(x):
        if tokens > 0:
            grid = (cdiv(tokens, blocks.t), cdiv(dim, blocks.d))
            k.fn_conv[grid](
                x2, weight, dense(bias) if bias is not None else dummy, st, ci, init, qsl, seq, out,
                tokens, dim, length, rows, n_slots, pad_slot_id,
                x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), *ss, out.stride(0), out.stride(1),
                W=width, HAS_BIAS=bias is not None, SILU=activation is not None, HAS_HIST=has_hist,
                HAS_CI=cache_indices is not None, VARLEN=varlen, BLOCK_T=blocks.t, BLOCK_D=blocks.d)
        if has_states and width > 1:
            grid = (batch, cdiv(dim, blocks.d))
            k.fn_state[grid](
                x2, st, ci, init, qsl, dim, length, rows, n_slots, pad_slot_id, x2.stride(0), x2.stride(1), *ss,
                W=width, HAS_HIST=has_hist, HAS_CI=cache_indices is not None, VARLEN=varlen,
                BLOCK_R=pow2(width - 1), BLOCK_D=blocks.d)
    mark_written(given, conv_states)
    if given is not None:
        return given
    return out if varlen else out.view(x.shape)


def _btd_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """A ``[B, L, D]`` tensor's strides; a ``[B, D]`` one's as its ``unsqueeze(1)`` would have
    them (so the kernel specialises alike), without the view (a dispatched op, microseconds of a
    decode call's host time)."""
    if t.ndim == 2:
        sb, sd = t.stride()
        return sb, t.shape[1] * sd, sd
    return t.stride()


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None, conv_state_indices=None,
                         num_accepted_tokens=None, pad_slot_id=-1, blocks: Blocks | None = None, out=None):
    """x: [B, D] or [B, L, D]; conv_state: [N, S, D] updated in place; weight: [D, W]. Returns
    x's shape and dtype, or writes ``out`` (x's shape and dtype, not x; any strides)."""
    k = kernels(interpreting())
    batch, length, dim = (x.shape[0], 1, x.shape[1]) if x.ndim == 2 else x.shape
    width = weight.shape[1]
    rows = conv_state.shape[1]
    spec = num_accepted_tokens is not None
    blocks = blocks or update_heuristic(batch, dim)
    given = out
    if given is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kept = max(rows - length, 0) if spec else rows  # rows of the old slot in the stream old ++ x
    offset = kept + length - rows  # first stream row of the new slot
    dummy = out
    counter = bad_value_counter(x)
    grid = (batch, cdiv(dim, blocks.d))
    with device_guard(x):
        k.update[grid](
            x, weight, dense(bias) if bias is not None else dummy, conv_state,
            dense(conv_state_indices) if conv_state_indices is not None else dummy,
            dense(num_accepted_tokens) if spec else dummy, out, counter if counter is not None else dummy,
            dim, length, rows, conv_state.shape[0], kept, offset, pad_slot_id,
            *_btd_strides(x), weight.stride(0), weight.stride(1), *conv_state.stride(), *_btd_strides(out),
            W=width, HAS_BIAS=bias is not None, SILU=activation is not None, HAS_CI=conv_state_indices is not None,
            SPEC=spec, COUNT=counter is not None, BLOCK_L=pow2(length), BLOCK_S=pow2(rows), BLOCK_D=blocks.d,
            BLOCK_B=64)  # earlier slots compared 64 at a time: one compile for every batch
    mark_written(given, conv_state)
    return out


def _caps(**extra) -> ConvCapabilities:
    devices = {"cuda", "cpu"} if interpreting() else {"cuda"}
    return ConvCapabilities(devices=devices, dtypes={"float32", "bfloat16", "float16"}, width=(1, MAX_WIDTH),
                            noncontiguous_states=True, graph_safe=True, slot_bounds_safe=True, takes_out=True, **extra)


def _tactics(fn, configs) -> dict:
    return {"tactics": {c.name: with_fixed(fn, c.name, blocks=c) for c in configs},
            "replaces": {f"triton_{c.name}": c.name for c in configs}}  # the ids they had before


def variants() -> list[Variant]:
    # Under the interpreter the kernels claim the CPU too, where they are far slower than any
    # native variant: ranked below them, they run there only when forced or measured.
    base = -50 if interpreting() else 15
    version = "1"
    fn_caps, update_caps = _caps(varlen=True), _caps(num_accepted_tokens=True, counts_bad_values=True)
    common = dict(id="triton", version=version, depends=DEPENDS, sources=SOURCES, probe=probe, priority=base)
    return [
        Variant(op="causal_conv1d_fn", fn=causal_conv1d_fn, capabilities=fn_caps, **common, **_tactics(causal_conv1d_fn, FN_CONFIGS),
                description="Triton prefill, block sizes by a heuristic; tactics: fixed BLOCK_D, BLOCK_T"),
        Variant(op="causal_conv1d_update", fn=causal_conv1d_update, capabilities=update_caps, **common,
                **_tactics(causal_conv1d_update, UPDATE_CONFIGS),
                description="Triton decode, block sizes by a heuristic; tactics: fixed BLOCK_D"),
    ]


@hookimpl
def kv_register_variants(register) -> None:
    for v in variants():
        register(v)
