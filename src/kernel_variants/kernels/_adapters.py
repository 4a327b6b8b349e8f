"""Shared code of the adapters that bind kernels living outside this project.

An adapter is the thin layer between the contract (``kernel_variants.ops``, channel-last, weight
``[D, W]``, history in the *last* W-1 rows of a slot, zero rows for padded sequences) and a
kernel with its own schema and quirks. What they share lives here:

- Finding a kernel. :class:`OpRef` names a registered torch op and the modules whose import
  registers it; :class:`FunctionRef` names a Python function. Both are recognised by what they
  are (the op's registered schema, the function's signature), never by version numbers, and say
  precisely why they cannot be used. Tests point them at CPU doubles of the real kernels.
- Prefill through a kernel with the Ascend layout (:func:`prefill_rows0`), on the slot and row
  helpers of :mod:`._slots`.
- Marking the tensors a kernel wrote through its pointer (:func:`mark_written`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernel_variants.kernels._slots import (
    COMPACT_PAD,
    Slots,
    gather_rows,
    int32,
    pad_channels,
    padded_inputs,
    scatter_rows,
    trimmed,
    zero_fresh_history,
)
from kernel_variants.plugin import ConvCapabilities, Variant

# --------------------------------------------------------------------------------------------
# Finding kernels
# --------------------------------------------------------------------------------------------

_PIP_NAMES = {"torch_npu": "torch_npu", "sgl_kernel_npu": "sgl-kernel-npu", "causal_conv1d": "causal-conv1d",
              "triton": "triton"}


def import_reason(modules: Sequence[str]) -> str | None:
    """Import ``modules`` in order; None when all import, else why not (never raises)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            top = name.split(".")[0]
            if exc.name == top:
                return f"{top} not installed (pip install {_PIP_NAMES.get(top, top)})"
            if exc.name == name:
                return f"module {name} not found in the installed {top}"
            return f"importing {name} failed: {type(exc).__name__}: {exc}"
        except Exception as exc:  # a native extension that fails to load is a reason, not a crash
            return f"importing {name} failed: {type(exc).__name__}: {exc}"
    return None


# What an sgl-kernel-npu kernel's speed depends on besides our adapter's source: its rows go
# stale when one of these changes.
SGL_NPU_DEPENDS = ("sgl-kernel-npu", "torch_npu", "cann", "torch")
#: The shared code every adapter runs, as ``Variant(sources=...)``: a change to it makes the
#: adapters' timings stale.
ADAPTER_SOURCES = tuple(str(Path(__file__).with_name(name)) for name in ("_adapters.py", "_slots.py"))


def sgl_npu_update_variant(adapter: Any, *, vid: str, devices: frozenset[str], priority: int, width: tuple[int, int],
                           description: str) -> Variant:
    """One of sgl-kernel-npu's decode kernels, through ``adapter``, as the variant ``vid`` of
    causal_conv1d_update: bf16/fp16, speculative verify, any pool strides, safe in a graph
    capture; ``width`` is the range its kernel takes. (Tests build it on a CPU double with
    ``devices={"cpu"}``.)"""
    caps = ConvCapabilities(devices=devices, dtypes={"bfloat16", "float16"}, width=width, num_accepted_tokens=True,
                            noncontiguous_states=True, graph_safe=True)
    # version "1": what the kernel's speed depends on is declared in depends.
    return Variant(id=vid, op="causal_conv1d_update", version="1", depends=SGL_NPU_DEPENDS,
                   fn=adapter.causal_conv1d_update, probe=adapter.probe, priority=priority, sources=ADAPTER_SOURCES,
                   capabilities=caps, description=description)


def dist_version(*dists: str) -> str:
    """The installed version of the first of ``dists`` found (package metadata only: nothing is
    imported), for variant versions, so that upgrading a kernel package makes old timings stale."""
    for dist in dists:
        try:
            return f"{dist}-{importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{dists[0]}-absent"


def npu_reason() -> str | None:
    """None when torch_npu is importable and an Ascend NPU is visible, else why not."""
    why = import_reason(["torch_npu"])
    if why is not None:
        return why
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return "no Ascend NPU visible (torch.npu.is_available() is False)"
    return None


def soc_name() -> str | None:
    """The Ascend SoC name of the current NPU (``Ascend910B2``, ``Ascend950PR_9599``...), or None
    where it cannot be read (no torch_npu, no NPU). Never raises."""
    npu = getattr(torch, "npu", None)
    try:
        if npu is None or not npu.is_available():
            return None
        return str(npu.get_device_name())
    except Exception:  # a driver that cannot answer is no reason to crash a probe
        return None


class FirstDevice:
    """The device a kernel first ran on, for kernels that keep a static device buffer made on
    their first call (sgl-kernel-npu's tiling caches: one NPU per process). ``check(device)``
    remembers the first device and raises ``RuntimeError`` for any other one, instead of letting
    the kernel read its tiling from another device's memory."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.device: torch.device | None = None
        self._lock = threading.Lock()

    def check(self, device: torch.device) -> None:
        with self._lock:
            if self.device is None:
                self.device = device
                return
        if device != self.device:
            raise RuntimeError(
                f"{self.what} keeps its tiling cache in a static buffer on the device of its first call "
                f"({self.device}); a call on {device} in the same process would read it from the wrong "
                "device. Use one NPU per process (set ASCEND_RT_VISIBLE_DEVICES), or another variant.")


@dataclass(frozen=True)
class Param:
    """One argument of an expected schema: its name, its torch type as the schema reports it
    (``str(argument.type)``: ``Tensor``, ``Optional[Tensor]``, ``int``, ``bool``...) and whether
    it has a default."""

    name: str
    type: str
    default: bool = False

    def __str__(self) -> str:
        return f"{self.type} {self.name}{'=...' if self.default else ''}"


def schema_mismatch(schema: Any, expected: Sequence[Param], what: str) -> str | None:
    """None when ``schema`` (a ``torch.FunctionSchema``) starts with ``expected`` (names, types,
    which ones have defaults) and any further arguments have defaults; else a reason that shows
    the schema found."""
    args = list(schema.arguments)
    found = [Param(a.name, str(a.type), a.has_default_value()) for a in args[: len(expected)]]
    extra_required = [a.name for a in args[len(expected):] if not a.has_default_value()]
    if found == list(expected) and not extra_required:
        return None
    want = ", ".join(map(str, expected))
    return f"{schema.name} has the schema `{schema}`, not {what} `({want})`"


@dataclass(frozen=True)
class OpRef:
    """A kernel registered as a torch op: ``qualname`` (``"npu::causal_conv1d"``), found after
    importing ``modules`` (the packages whose import registers it), on ``device`` (checked by
    :func:`npu_reason` for ``"npu"``; None checks nothing, as for CPU doubles in tests)."""

    qualname: str
    modules: tuple[str, ...] = ()
    device: str | None = None

    def load(self) -> tuple[Any, str | None]:
        """(the op's default overload, None), or (None, why it cannot be used)."""
        if self.device == "npu":
            why = npu_reason()
            if why is not None:
                return None, why
        why = import_reason(self.modules)
        if why is not None:
            return None, why
        ns, sep, name = self.qualname.partition("::")
        if not sep or not ns or not name:
            return None, f"op name {self.qualname!r} is not of the form 'namespace::name'"
        try:
            packet = getattr(getattr(torch.ops, ns), name)
        except (AttributeError, RuntimeError):
            hint = f" (imported {', '.join(self.modules)})" if self.modules else ""
            return None, f"op {self.qualname} is not registered{hint}"
        return packet.default, None


@dataclass(frozen=True)
class FunctionRef:
    """A kernel that is a Python function: ``module:attribute``, importable after ``modules``."""

    target: str
    modules: tuple[str, ...] = ()
    device: str | None = None

    def load(self) -> tuple[Callable[..., Any] | None, str | None]:
        if self.device == "npu":
            why = npu_reason()
            if why is not None:
                return None, why
        module, _, attr = self.target.partition(":")
        why = import_reason([*self.modules, module])
        if why is not None:
            return None, why
        fn = getattr(importlib.import_module(module), attr, None)
        if not callable(fn):
            return None, f"{module} has no function {attr}"
        return fn, None


def signature_mismatch(fn: Callable[..., Any], leading: Sequence[str], also: Sequence[str], what: str) -> str | None:
    """None when ``fn``'s parameters start with ``leading`` and include ``also``, else why not."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        return f"cannot read the signature of {what}: {exc}"
    missing = [p for p in also if p not in params]
    if params[: len(leading)] == list(leading) and not missing:
        return None
    name = getattr(fn, "__qualname__", repr(fn))
    return (f"{name}{inspect.signature(fn)} is not {what}: expected parameters "
            f"({', '.join(leading)}, ...) including {', '.join(also)}")


# --------------------------------------------------------------------------------------------
# Prefill through a kernel that keeps the history in rows 0..W-2 of a slot
# --------------------------------------------------------------------------------------------

# call(x, weight_wd, states, query_start_loc_i32_or_None, cache_indices_i32, has_initial_state,
#      bias, silu, pad_id) -> out. ``states`` is [N', R, D'] with R == W-1, contiguous; ``pad_id``
# is the pad id that goes with ``cache_indices``.
PrefillCall = Callable[..., torch.Tensor]


def prefill_rows0(
    call: PrefillCall,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    silu: bool,
    pad_slot_id: int,
    *,
    dim_multiple: int = 1,
    pad_marker: int | None = None,
) -> torch.Tensor:
    """``causal_conv1d_fn`` through a kernel with the Ascend layout: weight ``[W, D]`` contiguous,
    history in rows ``0..W-2`` of a contiguous pool (written back there), int32 indices and
    ``query_start_loc``, padded and empty sequences skipped (output rows of pads left as they
    were, state of an empty sequence left unwritten), channel count a multiple of
    ``dim_multiple``. ``pad_marker`` (negative): hand the kernel this pad id, with every pad
    entry rewritten to it, instead of the caller's (a kernel whose caches key on the pad id).

    Fast path, no copy of the pool: a contiguous pool with exactly W-1 rows and channels already
    aligned; dense or packed (``query_start_loc`` and the caller's slot ids go to the kernel as
    they are). Packed input can hold empty sequences, which the kernel skips: the history of
    live sequences without initial state is zeroed first (:func:`zero_fresh_history`), so an
    empty one ends with the contract's zero history. Otherwise the used history rows (the
    *last* W-1 of each slot) are gathered into a contiguous ``[B, W-1, D]`` buffer, zeroed for
    sequences without initial state, the kernel runs on the buffer with compact slot ids (pads
    as :data:`COMPACT_PAD`), and the buffer is scattered back in place.
    """
    width = weight.shape[1]
    keep = width - 1
    dim = x.shape[-1]
    batch = x.shape[0] if query_start_loc is None else query_start_loc.shape[0] - 1
    device = x.device
    slots = Slots(cache_indices, batch, pad_slot_id, device)
    init = has_initial_state if has_initial_state is not None else torch.zeros(batch, dtype=torch.bool, device=device)
    qsl = int32(query_start_loc) if query_start_loc is not None else None
    padded, x_in, w_in, b_in = padded_inputs(x, weight, bias, dim_multiple)
    fast = (conv_states is not None and conv_states.is_contiguous() and conv_states.shape[1] == keep
            and padded == dim)
    if fast:
        if query_start_loc is not None and keep > 0:
            zero_fresh_history(conv_states, slots, init, slice(0, keep))
        if pad_marker is None:
            ids, pad_id = slots.kernel, pad_slot_id
        else:
            ids, pad_id = slots.marked(pad_marker), pad_marker
        out = call(x_in, w_in, conv_states, qsl, ids, init, b_in, silu, pad_id)
        mark_written(conv_states)  # the kernel wrote the caller's pool
    else:
        if conv_states is None:
            hist = x_in.new_zeros(batch, keep, padded)
            init = torch.zeros(batch, dtype=torch.bool, device=device)
        else:
            rows = conv_states.shape[1]
            hist = gather_rows(conv_states, slots, slice(rows - keep, rows))
            hist.masked_fill_(~init.view(-1, 1, 1), 0)
            hist = pad_channels(hist, padded).contiguous()
        pad_id = COMPACT_PAD if pad_marker is None else pad_marker
        out = call(x_in, w_in, hist, qsl, slots.compact_marked(pad_id), init, b_in, silu, pad_id)
        if conv_states is not None:
            rows = conv_states.shape[1]
            scatter_rows(conv_states, slots, slice(rows - keep, rows), hist[..., :dim])
    return trimmed(out, dim, slots.live, query_start_loc)


class LazyKernel:
    """A kernel looked up on first need: ``probe()`` says why it cannot run (and remembers it when
    it can), ``kernel()`` returns it or raises with that reason. Subclasses implement ``find``."""

    def __init__(self) -> None:
        self._found: Any = None
        self._lock = threading.Lock()

    def find(self) -> tuple[Any, str | None]:
        """(the kernel, None) when it is there and matches, else (anything, the reason)."""
        raise NotImplementedError

    def probe(self) -> str | None:
        found, why = self.find()
        if why is None:
            with self._lock:
                self._found = found
        return why

    def kernel(self) -> Any:
        if self._found is None:
            why = self.probe()
            if why is not None:
                raise RuntimeError(why)
        return self._found


class OpAdapter(LazyKernel):
    """An adapter over the torch op ``ref`` finds (the real one, or a test double), used when its
    schema starts with ``SCHEMA``; ``WHAT`` names the kernel in the reason when it does not."""

    SCHEMA: tuple[Param, ...] = ()
    WHAT = "the kernel's"

    def __init__(self, ref: OpRef) -> None:
        super().__init__()
        self.ref = ref

    def find(self) -> tuple[Any, str | None]:
        op, why = self.ref.load()
        if why is None:
            why = schema_mismatch(op._schema, self.SCHEMA, self.WHAT)
        return op, why


def mark_written(*tensors: torch.Tensor | None) -> None:
    """Bump autograd's version counter of each tensor a kernel wrote through its pointer (torch's
    own in-place ops do this themselves), so that a graph which saved one fails at backward
    instead of using the new values. Inference tensors have no counter: a serving loop's calls
    (inference_mode) skip the call into torch altogether."""
    written = [t for t in tensors if t is not None and not t.is_inference()]
    if written:
        torch.autograd.graph.increment_version(written)


def with_fixed(fn: Callable[..., Any], label: str, **fixed: Any) -> Callable[..., Any]:
    """``fn`` with keyword arguments ``fixed``: one tactic of a variant (a block size, a chunk
    length), named ``fn[label]``."""
    def run(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs, **fixed)

    run.__qualname__ = f"{fn.__qualname__}[{label}]"
    run.__name__ = f"{fn.__name__}[{label}]"
    run.__doc__ = f"``{fn.__name__}`` with {', '.join(f'{k}={v!r}' for k, v in fixed.items())}."
    return run
