"""The engines' everyday calls on the fewest Python steps: a decode step of one token per
sequence, and a CPU prefill whose slots and lengths need no rewriting.

An adapter tries these first and takes the general path (:mod:`._common`) where one returns
None: anything else, which the general path maps, or refuses with its message; and a call that
Dynamo traces (the layout helpers below are C functions, which it cannot trace).

What they save: the checks that decide whether a call is an everyday one, and the views of the
engines' layouts, are one call into the compiled call core (``decode_views``/``prefill_views``:
plain aliases, ~0.2 us against ~0.8 us for a view from Python, see
:class:`kernel_variants._runtime.callcore.Functions`); the op is entered below its public
function (its arguments in signature order); what the op validates (shapes, index values) is
left to it.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants._runtime.callcore import FUNCTIONS as _C
from kernel_variants.integrations._layout import as_activation
from kernel_variants.ops.causal_conv1d import _FN, _UPDATE

_compiling = torch.compiler.is_compiling


# The Python of the core's layout functions (call_core.cpp), for where the core is off or not
# built: the same results, views made the ordinary way.

_REFUSED = object()


def _slot_ids_py(indices: Any, batch: int, table: bool) -> Any:
    if indices is None:
        return None
    if not isinstance(indices, torch.Tensor) or indices.ndim == 0 or indices.shape[0] != batch:
        return _REFUSED
    if indices.ndim == 1:
        return indices
    return indices[:, 0] if indices.ndim == 2 and indices.shape[1] >= 1 and table else _REFUSED


def _decode_views_py(x: Any, pool: Any, weight: Any, indices: Any, table: bool) -> tuple[Any, Any] | None:
    if not all(isinstance(t, torch.Tensor) for t in (x, pool, weight)):
        return None
    if (x.ndim != 2 or pool.ndim != 3 or weight.ndim != 2 or pool.shape[2] != weight.shape[1] - 1
            or not x.dtype == pool.dtype == weight.dtype):
        return None
    indices = _slot_ids_py(indices, x.shape[0], table)
    return None if indices is _REFUSED else (pool.transpose(-1, -2), indices)


def _prefill_views_py(x: Any, weight: Any, pool: Any, qsl: Any, indices: Any, init: Any, table: bool,
                      known_nonempty: bool) -> tuple[Any, Any, Any] | None:
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, qsl)):
        return None
    if x.ndim != 2 or weight.ndim != 2 or qsl.ndim != 1 or qsl.shape[0] < 1 or x.dtype != weight.dtype:
        return None
    batch = qsl.shape[0] - 1
    if init is not None and (not isinstance(init, torch.Tensor) or init.ndim != 1 or init.shape[0] != batch):
        return None
    if pool is not None:
        if (not isinstance(pool, torch.Tensor) or pool.ndim != 3 or pool.shape[2] != weight.shape[1] - 1
                or pool.dtype != x.dtype or not (known_nonempty or _no_empty_py(qsl) is True)):
            return None
        pool = pool.transpose(-1, -2)
    indices = _slot_ids_py(indices, batch, table)
    return None if indices is _REFUSED else (x.transpose(-1, -2), pool, indices)


def _no_empty_py(qsl: Any) -> bool | None:
    if (isinstance(qsl, torch.Tensor) and qsl.is_cpu and qsl.ndim == 1
            and qsl.dtype in (torch.int32, torch.int64)):
        return bool((qsl.diff() != 0).all())
    return None


# channel_last(t): t.transpose(-1, -2) (in C a plain alias sharing storage and version counter,
# the ordinary view for a subclass, a functional tensor, one that requires grad in grad mode, or
# under a dispatch mode); decode_views / prefill_views: the checks and views of decode_step and
# prefill_step in one call, None where the general path serves.
_C.provide("channel_last", lambda t: t.transpose(-1, -2))
_C.provide("decode_views", _decode_views_py)
_C.provide("prefill_views", _prefill_views_py)


def decode_step(
    x: torch.Tensor,
    pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: object,
    indices: torch.Tensor | None,
    sentinel: int,
    query_start_loc: torch.Tensor | None = None,
    *,
    table: bool = True,
) -> torch.Tensor | None:
    """x ``[B, dim]`` (one token per sequence; with ``query_start_loc`` ``[B+1]``, the caller has
    proven every sequence one token long), pool ``(N, dim, W-1)`` (a view of ``[N, W-1, dim]``),
    slot ids ``[B]`` or, with ``table`` (vLLM's rule), ``[B, k]`` read at column 0; one dtype
    throughout: the op's decode on the channel-last view of the pool; returns ``[B, dim]``. None
    where :func:`._common.decode` serves."""
    if _compiling():
        return None
    views = _C.decode_views(x, pool, weight, indices, table)
    if views is None:
        return None
    if indices is None and query_start_loc is not None and x.shape[0] != query_start_loc.shape[0] - 1:
        return None
    act = activation if activation == "silu" else as_activation(activation)
    return _UPDATE(x, views[0], weight, bias, act, views[1], None, sentinel, None)


def prefill_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pool: torch.Tensor | None,
    query_start_loc: torch.Tensor, indices: torch.Tensor | None, has_initial_state: torch.Tensor | None,
    activation: object, sentinel: int, *, known_nonempty: bool = False, table: bool = True,
) -> torch.Tensor | None:
    """x ``(dim, T)`` (a view of ``[T, dim]``), pool ``(N, dim, W-1)`` or None, query_start_loc
    ``[B+1]`` with exactly B slot ids (``[B]``, or with ``table`` ``[B, k]`` at column 0) and flags, no empty
    sequence (read here on the CPU unless ``known_nonempty``), one dtype throughout: the op's varlen
    prefill on the channel-last views; returns ``(dim, T)``. None where :func:`._common.prefill`
    serves (an empty sequence is skipped there, extra slot entries cut, more state rows narrowed)."""
    if _compiling():
        return None
    views = _C.prefill_views(x, weight, pool, query_start_loc, indices, has_initial_state, table, known_nonempty)
    if views is None:
        return None
    act = activation if activation == "silu" else as_activation(activation)
    y = _FN(views[0], weight, bias, views[1], views[2], has_initial_state, query_start_loc, act, sentinel, None)
    return _C.channel_last(y)
