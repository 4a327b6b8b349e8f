"""Shared code of the adapters that bind kernels living outside this project.

An adapter is the thin layer between the contract (``kernel_variants.ops``, channel-last, weight
``[D, W]``, history in the *last* W-1 rows of a slot, zero rows for padded sequences) and a
kernel with its own schema and quirks. What they share lives here:

- Finding a kernel. :class:`OpRef` names a registered torch op and the modules whose import
  registers it; :class:`FunctionRef` names a Python function. Both are recognised by what they
  are (the op's registered schema, the function's signature), never by version numbers, and say
  precisely why they cannot be used. Tests point them at CPU doubles of the real kernels.
- Slots: slot ids as int32 for a kernel, a "safe" int64 copy for gathers, which sequences are
  live (not ``pad_slot_id``), and compact ids into a gathered buffer. Every kernel skips *any*
  index equal to the pad id it is handed, so a pad id inside ``[0, B)`` (``pad_slot_id=0`` is
  legal) would also skip the live sequence renumbered to it: compact ids always travel with
  the negative marker :data:`COMPACT_PAD` instead, which no compact id can equal.
- State pools. A kernel that needs a contiguous pool, or keeps its history elsewhere in a slot,
  gets a contiguous buffer gathered from the used slots; the rows it wrote are then scattered
  back into the caller's pool *in place*, through the caller's own tensor, so the update lands
  also when that pool is a non-contiguous view. Never ``pool.contiguous()``: for a strided pool
  that is a copy, and every state write into it is lost (the bug of SGLang's adoption of
  ``causal_conv1d_update_v2``).
- No host synchronisation: nothing here reads a device tensor's values (no ``nonzero()``, no
  boolean-mask indexing, no ``.item()``), so the adapters can run inside a CUDA/NPU graph
  capture. Writing only the live sequences' rows back uses :func:`write_rows`, which redirects
  padded entries to a live one instead of filtering them out.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

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
# Slots and rows
# --------------------------------------------------------------------------------------------


def int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


COMPACT_PAD = -1  # the pad id handed to a kernel together with compact ids (never one of 0..B-1)


class Slots:
    """The slot of each of B sequences, each form computed on first use (a device op each, never
    a host sync).

    ``kernel``: int32 slot ids as a kernel takes them (pad entries keep ``pad_slot_id``);
    ``live``: bool ``[B]``, or None when no entry can be a pad (``indices`` None); ``safe``:
    int64 ids with pad entries replaced by 0, for gathers; ``compact``: int32 ``[B]`` indices into
    a gathered ``[B, ...]`` buffer, pad entries set to :data:`COMPACT_PAD` (hand the kernel that
    as its pad id: the caller's ``pad_slot_id`` may be one of 0..B-1).
    """

    def __init__(self, indices: torch.Tensor | None, batch: int, pad_slot_id: int, device: torch.device) -> None:
        self.indices = indices
        self.batch = batch
        self.pad_slot_id = pad_slot_id
        self.device = device

    @functools.cached_property
    def _seq(self) -> torch.Tensor:
        return torch.arange(self.batch, device=self.device, dtype=torch.int32)

    @functools.cached_property
    def kernel(self) -> torch.Tensor:
        return self._seq if self.indices is None else int32(self.indices)

    @functools.cached_property
    def live(self) -> torch.Tensor | None:
        return None if self.indices is None else self.kernel != self.pad_slot_id

    @functools.cached_property
    def safe(self) -> torch.Tensor:
        if self.live is None:
            return self.kernel.long()
        return torch.where(self.live, self.kernel, 0).long()

    @functools.cached_property
    def compact(self) -> torch.Tensor:
        if self.live is None:
            return self._seq
        return torch.where(self.live, self._seq, COMPACT_PAD).to(torch.int32)

    def compact_marked(self, marker: int) -> torch.Tensor:
        """``compact`` with pad entries set to ``marker`` (negative) instead of COMPACT_PAD."""
        if marker >= 0:
            raise ValueError(f"a pad marker must be negative (no compact id), got {marker}")
        if self.live is None or marker == COMPACT_PAD:
            return self.compact
        return torch.where(self.live, self._seq, marker).to(torch.int32)

    def marked(self, marker: int) -> torch.Tensor:
        """The caller's slot ids (int32) with every pad entry set to ``marker``: for a kernel that
        must be handed a pad id of the adapter's choosing. ``marker`` must be negative, so that
        it equals no slot of the pool."""
        if marker >= 0:
            raise ValueError(f"a pad marker must be negative (no slot id), got {marker}")
        if self.live is None:
            return self.kernel
        return torch.where(self.live, self.kernel, marker).to(torch.int32)


def gather_rows(pool: torch.Tensor, slots: Slots, rows: slice) -> torch.Tensor:
    """A contiguous copy ``[B, r, D]`` of rows ``rows`` of each sequence's slot (pad: slot 0)."""
    return pool[:, rows].index_select(0, slots.safe)


def write_rows(pool: torch.Tensor, rows: slice, slot_ids: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None = None) -> None:
    """``pool[slot_ids[b], rows] = values[b]`` for every ``b`` with ``mask[b]`` (every ``b`` when
    ``mask`` is None), in place in the caller's ``pool`` (a non-contiguous view included:
    ``index_copy_`` on a view of it writes through). ``slot_ids``: int64 ``[B]``, valid even
    where masked off; ``values``: ``[B, r, D]`` (or broadcastable to it).

    No host synchronisation: instead of selecting the kept entries (``nonzero()``, a sync), each
    masked-off entry is redirected to the first kept one, so it writes the very same values to
    the very same slot (duplicate indices with identical values: the result does not depend on
    their order). When no entry is kept, every entry writes back what ``slot_ids[0]`` holds."""
    target = pool[:, rows]
    batch = slot_ids.shape[0]
    values = values.to(pool.dtype).expand(batch, *target.shape[1:])
    if mask is None:
        target.index_copy_(0, slot_ids, values)
        return
    first = mask.to(torch.int32).argmax()  # the first kept entry (0 when there is none)
    src = torch.where(mask, torch.arange(batch, device=mask.device), first)
    idx = slot_ids.index_select(0, src)
    kept = values.index_select(0, src)
    keep_any = mask.any()
    unchanged = target.index_select(0, idx[:1])  # what slot_ids[first] holds now
    target.index_copy_(0, idx, torch.where(keep_any, kept, unchanged))


def scatter_rows(pool: torch.Tensor, slots: Slots, rows: slice, values: torch.Tensor) -> None:
    """``pool[slot_b, rows] = values[b]`` for every live sequence, in place in the caller's
    ``pool`` (a non-contiguous view included). No host sync (see :func:`write_rows`)."""
    write_rows(pool, rows, slots.safe, values, slots.live)


def zero_fresh_history(pool: torch.Tensor, slots: Slots, init: torch.Tensor, rows: slice) -> None:
    """Zero, in place, the history rows of every live sequence without initial state.

    For a kernel that skips empty sequences (varlen, length 0) without writing their state: the
    contract gives such a sequence the zero history when it has no initial state. Zeroing the
    history of *every* live sequence without initial state is harmless for the others: the
    kernel reads no history for them and rewrites all W-1 rows. No host sync."""
    fresh = ~init if slots.live is None else slots.live & ~init
    target = pool[:, rows]
    zeros = target.new_zeros(1, *target.shape[1:])
    write_rows(pool, rows, slots.safe, zeros, fresh)


def zero_dead_rows(out: torch.Tensor, live: torch.Tensor | None, query_start_loc: torch.Tensor | None) -> torch.Tensor:
    """Zero, in place, the output rows of padded sequences (a kernel may leave them uninitialised).
    ``out``: ``[B, L, D]``, or ``[T, D]`` with ``query_start_loc``. No host sync."""
    if live is None:
        return out
    if query_start_loc is None:
        dead = ~live.view(-1, *([1] * (out.ndim - 1)))
    else:
        lengths = query_start_loc[1:] - query_start_loc[:-1]
        dead = ~live.repeat_interleave(lengths.long(), output_size=out.shape[0]).unsqueeze(1)
    return out.masked_fill_(dead, 0)


def pad_channels(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """``t`` with its last dimension zero-padded to ``dim`` (a copy), or ``t`` when already there."""
    if t is None or t.shape[-1] == dim:
        return t
    return F.pad(t, (0, dim - t.shape[-1]))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def spec_shift(old: torch.Tensor, x3: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The contract's new slots for a speculative step: ``old[b, n_b : n_b + S - L] ++ x3[b]``,
    last S rows. old: ``[B, S, D]``, x3: ``[B, L, D]``, accepted: ``[B]``."""
    batch, rows, dim = old.shape
    length = x3.shape[1]
    kept = max(rows - length, 0)
    pick = accepted.long()[:, None] + torch.arange(kept, device=old.device)
    pick = pick.clamp(max=rows - 1)  # padded sequences carry garbage counts; their rows are never written
    stream = torch.cat([old.gather(1, pick[:, :, None].expand(batch, kept, dim)), x3.to(old.dtype)], dim=1)
    return stream[:, stream.shape[1] - rows:]


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
    padded = round_up(dim, dim_multiple)
    x_in = x.contiguous()
    w_in = weight.t().contiguous()  # [W, D]
    b_in = bias.contiguous() if bias is not None else None
    if padded != dim:
        x_in, w_in, b_in = pad_channels(x_in, padded), pad_channels(w_in, padded), pad_channels(bias, padded)
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
    if padded != dim:
        out = out[..., :dim].contiguous()
    return zero_dead_rows(out, slots.live, query_start_loc)


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


def mark_written(*tensors: torch.Tensor | None) -> None:
    """Bump autograd's version counter of each tensor a kernel wrote through its pointer (torch's
    own in-place ops do this themselves), so that a graph which saved one fails at backward
    instead of using the new values. Inference tensors have no counter; torch skips them."""
    torch.autograd.graph.increment_version([t for t in tensors if t is not None])
