"""What the engine modules share: the marks on their adapters, the calls into the dispatched
ops in the engines' layouts (views only; the vocabulary is in :mod:`._layout`), the warning
``patch()`` gives, and the import hook that patches modules an engine loads late.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import itertools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

import kernel_variants
from kernel_variants._capture import capturing
from kernel_variants.integrations._layout import first_rows, head_rows, same_dtype, skip_empty

#: Attribute set on every adapter, so a second ``patch()`` can tell its own functions apart.
ADAPTER_MARK = "__kv_integration__"


def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, ADAPTER_MARK, True)
    return fn


class IntegrationWarning(UserWarning):
    """``patch()`` left something out of the engine's routing (a variant not built yet)."""


def prefill(
    engine: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pool: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    act: str | None,
    sentinel: int,
    *,
    seq_lens: list[int] | None = None,
    channel_first: bool = False,
) -> torch.Tensor:
    """Varlen prefill. x: ``[T, D]`` view; weight ``[D, W]``; pool ``[N, S, D]`` view or None.

    Returns ``[T, D]``. ``seq_lens`` (host lengths, when the engine has them) lets tokens past
    ``query_start_loc[-1]`` (padding the engine ignores) be left out, as zeros in the result.
    Without ``query_start_loc``, x is ``[B, L, D]``: sequences of equal length.
    ``channel_first``: x and pool are the engines' transposed views of those (``(D, T)`` or
    ``(B, D, L)``, and ``(N, D, S)``), and the result has x's layout.
    """
    if channel_first:
        pool = pool.transpose(-1, -2) if pool is not None else None
        y = prefill(engine, x.transpose(-1, -2), weight, bias, pool, query_start_loc,
                    cache_indices, has_initial_state, act, sentinel, seq_lens=seq_lens)
        return y.transpose(-1, -2)
    same_dtype(engine, x, weight, pool)
    if query_start_loc is None:
        return kernel_variants.causal_conv1d_fn(
            x, weight, bias,
            conv_states=head_rows(engine, pool, weight.shape[1] - 1) if pool is not None else None,
            cache_indices=cache_indices, has_initial_state=has_initial_state, activation=act,
            pad_slot_id=sentinel,
        )
    cache_indices, has_initial_state = first_rows(query_start_loc, cache_indices, has_initial_state)
    if pool is not None:
        pool = head_rows(engine, pool, weight.shape[1] - 1)
        if seq_lens is None or 0 in seq_lens:
            cache_indices, sentinel = skip_empty(cache_indices, query_start_loc, sentinel)
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
    *,
    channel_first: bool = False,
) -> torch.Tensor:
    """Decode or verify of equal-length sequences. x: ``[B, D]`` or ``[B, L, D]`` view; pool
    ``[N, S, D]`` view; weight ``[D, W]``. Returns x's shape. ``channel_first``: x is
    ``(B, D)`` or ``(B, D, L)`` and pool ``(N, D, S)``, the engines' transposed views of those,
    and the result has x's layout."""
    if channel_first:
        pool = pool.transpose(-1, -2)
        if x.ndim == 3:
            y = decode(engine, x.transpose(1, 2), pool, weight, bias, act, indices,
                       num_accepted_tokens, sentinel)
            return y.transpose(1, 2)
        if x.ndim != 2:
            raise ValueError(
                f"{engine}: x: expected (batch, dim) or (batch, dim, seqlen), got {list(x.shape)}"
            )
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
    if x.ndim != 2:
        raise ValueError(f"{engine}: x: expected (tokens, dim) with query_start_loc, got {list(x.shape)}")
    batch = indices.shape[0] if indices is not None else query_start_loc.shape[0] - 1
    total = x.shape[0]
    length: int | None = None
    starts: list[int] = []
    lengths: list[int] = []
    if max_query_len is not None and max_query_len > 0 and total == batch * max_query_len:
        length = max_query_len
    elif capturing(x.device.type):
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


def _spec_then(finder: object, then: Callable[[ModuleType], None], name: str, path: Any = None,
              target: Any = None) -> Any:
    """For a meta path finder's ``find_spec``: the spec ``sys.meta_path``'s other finders give
    ``name``, its loader followed by ``then(module)``; None where they find none."""
    for other in sys.meta_path:
        find = getattr(other, "find_spec", None)
        if other is finder or find is None:
            continue
        spec = find(name, path, target)
        if spec is not None:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _AfterExec(spec.loader, then)
            return spec
    return None


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


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
        return _spec_then(self, self._then, name, path, target)

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class Originals:
    """The engine functions ``patch()`` replaced, by name: what an uncovered call runs instead.
    ``home(name)`` names the module that defines ``name`` (for a replay in a process where the
    engine was never patched)."""

    def __init__(self, home: Callable[[str], str]) -> None:
        self._fns: dict[str, Callable[..., Any]] = {}
        self._home = home

    def remember(self, name: str, adapter: Callable[..., Any]) -> Callable[[Any], Callable[..., Any]]:
        """A ``patch_engine`` factory: keeps the function it replaces, returns ``adapter``."""
        def factory(original: Any) -> Callable[..., Any]:
            self._fns[name] = original
            return adapter

        return factory

    def own(self, name: str) -> Callable[..., Any]:
        """The engine's own function ``name``: the one ``patch()`` replaced, else the one its
        module holds (an adapter there means it is unknown here: RuntimeError)."""
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(importlib.import_module(self._home(name)), name)
            if getattr(fn, "__kv_integration__", False):
                raise RuntimeError(f"the engine's own {name} is unknown here (its binding is an adapter)")
        return fn
