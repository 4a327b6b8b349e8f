"""The engines' everyday calls on the fewest Python steps: a decode step of one token per
sequence, and a CPU prefill whose slots and lengths need no rewriting.

An adapter tries these first and takes the general path (:mod:`._common`) where one returns
None: anything else, which the general path maps, or refuses with its message; and a call that
Dynamo traces (the layout helpers below are C functions, which it cannot trace).

What they save: the checks that decide whether a call is an everyday one, the views of the
engines' layouts and the op's call are one call into the compiled call core
(``decode_step``/``prefill_step``, see :class:`kernel_variants._runtime.callcore.Functions`):
the views are plain aliases (~0.2 us against ~0.8 us for a view from Python), and the op's
CallCore is called from C, its arguments in signature order, below its public function and its
entry (where the core misses, the entry serves). What the op validates (shapes, index values) is
left to it.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_variants._runtime.callcore import FUNCTIONS as _C
from kernel_variants._runtime.callcore import entry_of
from kernel_variants.integrations._layout import as_activation
from kernel_variants.ops.causal_conv1d import FN_SPEC, UPDATE_SPEC

# Folded to True while Dynamo traces (the layout functions are C, which it cannot trace); one
# frame eagerly, where is_compiling takes two. A real run under torch.export or a compile session
# gets to the steps, which hand its fake or functional tensors (symbolic sizes among them) to the
# general path without reading them.
_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_any_trace = torch.compiler.is_compiling
# The ops' entries: the core bound to each is read per call and called from C (the entry frame
# and its compile check skipped: a step has asked already); where it misses, the entry serves.
_FN_ENTRY, _UPDATE_ENTRY = entry_of(FN_SPEC), entry_of(UPDATE_SPEC)
_FN, _UPDATE = _FN_ENTRY.call, _UPDATE_ENTRY.call


# The Python of the core's layout functions (_runtime/csrc/layout.cpp), for where the core is off or not
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


def _decode_step_py(core: Any, entry: Any, x: Any, pool: Any, weight: Any, bias: Any, act: Any, indices: Any,
                    sentinel: int, table: bool) -> Any:
    if _any_trace():  # the C step's readable(): nothing traced is read here
        return None
    if not all(isinstance(t, torch.Tensor) for t in (x, pool, weight)):
        return None
    if (x.ndim != 2 or pool.ndim != 3 or weight.ndim != 2 or pool.shape[2] != weight.shape[1] - 1
            or not x.dtype == pool.dtype == weight.dtype):
        return None
    indices = _slot_ids_py(indices, x.shape[0], table)
    if indices is _REFUSED:
        return None
    return entry(x, pool.transpose(-1, -2), weight, bias, act, indices, None, sentinel, None)


def _host_lengths_fill(lengths: Any, total: int) -> bool:
    return (isinstance(lengths, list | tuple) and all(type(n) is int and 0 < n <= total for n in lengths)
            and sum(lengths) == total)


def _prefill_step_py(core: Any, entry: Any, x: Any, weight: Any, bias: Any, pool: Any, qsl: Any, indices: Any,
                     init: Any, act: Any, sentinel: Any, table: bool, lengths: Any) -> Any:
    if _any_trace():
        return None
    if type(sentinel) is not int or not all(isinstance(t, torch.Tensor) for t in (x, weight, qsl)):
        return None
    if x.ndim != 2 or weight.ndim != 2 or qsl.ndim != 1 or qsl.shape[0] < 1 or x.dtype != weight.dtype:
        return None
    batch = qsl.shape[0] - 1
    if init is not None and (not isinstance(init, torch.Tensor) or init.ndim != 1 or init.shape[0] != batch):
        return None
    if lengths is not None and not _host_lengths_fill(lengths, x.shape[1]):
        return None
    if pool is not None:
        if (not isinstance(pool, torch.Tensor) or pool.ndim != 3 or pool.shape[2] != weight.shape[1] - 1
                or pool.dtype != x.dtype or not (lengths is not None or _no_empty_py(qsl) is True)):
            return None
        pool = pool.transpose(-1, -2)
    indices = _slot_ids_py(indices, batch, table)
    if indices is _REFUSED:
        return None
    y = entry(x.transpose(-1, -2), weight, bias, pool, indices, init, qsl, act, sentinel, None)
    return y.transpose(-1, -2)


def _no_empty_py(qsl: Any) -> bool | None:
    if (isinstance(qsl, torch.Tensor) and qsl.is_cpu and qsl.ndim == 1
            and qsl.dtype in (torch.int32, torch.int64)):
        return bool((qsl.diff() != 0).all())
    return None


# channel_last(t): t.transpose(-1, -2) (in C a plain alias sharing storage and version counter,
# the ordinary view for a subclass, a functional tensor, one that requires grad in grad mode, or
# under a dispatch mode); decode_step / prefill_step: the checks, the views and the op in one
# call (in C the op's CallCore called directly, its entry where the core misses), None where the
# general path serves.
_C.provide("channel_last", lambda t: t.transpose(-1, -2))
_C.provide("decode_step", _decode_step_py)
_C.provide("prefill_step", _prefill_step_py)


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
    if indices is None and query_start_loc is not None and not (
            isinstance(x, torch.Tensor) and isinstance(query_start_loc, torch.Tensor)
            and x.ndim >= 1 and query_start_loc.ndim == 1 and x.shape[0] == query_start_loc.shape[0] - 1):
        return None
    act = activation if activation == "silu" else as_activation(activation)
    return _C.decode_step(_UPDATE_ENTRY.core, _UPDATE, x, pool, weight, bias, act, indices, sentinel, table)


def prefill_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pool: torch.Tensor | None,
    query_start_loc: torch.Tensor, indices: torch.Tensor | None, has_initial_state: torch.Tensor | None,
    activation: object, sentinel: object, table: bool = True, lengths: list[int] | None = None,
) -> torch.Tensor | None:
    """x ``(dim, T)`` (a view of ``[T, dim]``), pool ``(N, dim, W-1)`` or None, query_start_loc
    ``[B+1]`` with exactly B slot ids (``[B]``, or with ``table`` ``[B, k]`` at column 0) and flags,
    a plain int pad id ``sentinel``, no empty sequence (read here from query_start_loc on the CPU;
    given the engine's host ``lengths``, from them, and they must sum to T), one dtype
    throughout: the op's varlen prefill on the channel-last views; returns ``(dim, T)``. None
    where :func:`._common.prefill` serves (an empty sequence is skipped there, extra slot entries
    cut, more state rows narrowed, tokens past the lengths zeroed, another pad id converted).
    Positional all through: a keyword costs a call here more than the check it names."""
    if _compiling():
        return None
    act = activation if activation == "silu" else as_activation(activation)
    return _C.prefill_step(_FN_ENTRY.core, _FN, x, weight, bias, pool, query_start_loc, indices, has_initial_state,
                           act, sentinel, table, lengths)
