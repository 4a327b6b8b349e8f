"""Layout helpers of the engine adapters: checks and views, never copies.

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

import torch


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
) -> tuple[torch.Tensor, int]:
    """(slots with empty sequences made pads, the pad id to hand the op): the engines' kernels
    skip an empty sequence (no state write), the contract would still write its history back
    (zeros without an initial state). Without ``cache_indices`` (sequence b in slot b) the slots
    are made here and the pad id is -1, as the op's own rule has it: the caller's sentinel may be
    a live slot among 0..B-1 (vLLM's null block 0). Device-side, so no sync and safe inside a
    graph capture."""
    empty = query_start_loc[1:] == query_start_loc[:-1]
    if cache_indices is None:
        cache_indices = torch.arange(
            empty.shape[0], device=query_start_loc.device, dtype=query_start_loc.dtype
        )
        sentinel = -1
    return torch.where(empty, torch.full_like(cache_indices, sentinel), cache_indices), sentinel


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
