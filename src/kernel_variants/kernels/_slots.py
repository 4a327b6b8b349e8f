"""Slots and state rows, shared by the variants that gather or scatter a pool themselves.

- Slots: slot ids as int32 for a kernel, int64 ones for torch's index ops, a "safe" int64 copy
  for gathers, which sequences are live (not ``pad_slot_id``), and compact ids into a gathered
  buffer. Every kernel skips *any* index equal to the pad id it is handed, so a pad id inside
  ``[0, B)`` (``pad_slot_id=0`` is legal) would also skip the live sequence renumbered to it:
  compact ids always travel with the negative marker :data:`COMPACT_PAD` instead, which no
  compact id can equal.
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

import torch
import torch.nn.functional as F


def int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


COMPACT_PAD = -1  # the pad id handed to a kernel together with compact ids (never one of 0..B-1)


class Slots:
    """The slot of each of B sequences, each form computed on first use (a device op each, never
    a host sync).

    ``kernel``: int32 slot ids as a kernel takes them (pad entries keep ``pad_slot_id``);
    ``live``: bool ``[B]``, or None when no entry can be a pad (``indices`` None); ``safe``:
    int64 ids with pad entries replaced by 0, for gathers; ``ids``: int64 ids with pad entries
    kept, for torch's index ops; ``compact``: int32 ``[B]`` indices into
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

    def history(self, pool: torch.Tensor) -> torch.Tensor:
        """``pool[slot_b]`` for each sequence, ``[B, S, D]`` (a gathered copy), zeros for pad
        entries: a pad's stand-in slot holds whatever it holds, NaN included, and nothing of it
        may reach an output or, through an activation's derivative, a gradient."""
        return self.live_only(pool[self.safe])

    def live_only(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (leading dimension B) with the pad sequences' rows zeroed: a pad's tokens may
        be anything, NaN included, and none of it may reach an output or, through a weight's
        gradient (a sum over every token), the caller's backward."""
        if self.live is None:
            return x
        return x.masked_fill(~self.live.view(-1, *([1] * (x.ndim - 1))), 0)

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        return self.safe if self.indices is None else self.indices.long()

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


def finish_decode(out: torch.Tensor, conv_state: torch.Tensor, slots: Slots, new_state: torch.Tensor,
                  x: torch.Tensor) -> torch.Tensor:
    """The end of a plain-torch decode: pad sequences get a zero output and no state write, the
    live ones their new state ``[B, S, D]`` (detached: states never join a graph); the output
    ``[B, L, D]`` in x's layout (``[B, D]`` for one token)."""
    ids, live = slots.ids, slots.live
    if live is not None:
        out[~live] = 0
        ids, new_state = ids[live], new_state[live]
    conv_state[ids] = new_state.detach()
    return out.squeeze(1) if x.ndim == 2 else out


def initial(has_initial_state: torch.Tensor | None, slots: Slots) -> torch.Tensor:
    """[B] bool: whether sequence b starts from its slot's history (never for padding)."""
    init = has_initial_state
    if init is None:
        init = torch.zeros(slots.batch, dtype=torch.bool, device=slots.device)
    return init if slots.live is None else init & slots.live


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


def padded_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, multiple: int
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(D', x, weight as [W, D'], bias)``, each contiguous, channels zero-padded to ``D'``, the
    next multiple of ``multiple``: the inputs of a kernel with the Ascend layout."""
    padded = round_up(x.shape[-1], multiple)
    x_in = pad_channels(x.contiguous(), padded)
    w_in = pad_channels(weight.t(), padded).contiguous()
    b_in = pad_channels(bias.contiguous(), padded) if bias is not None else None
    return padded, x_in, w_in, b_in


def trimmed(out: torch.Tensor, dim: int, live: torch.Tensor | None,
            query_start_loc: torch.Tensor | None = None) -> torch.Tensor:
    """A kernel's output cut back to ``dim`` channels (a copy only when it was padded), rows of
    padded sequences zeroed (see :func:`zero_dead_rows`)."""
    if out.shape[-1] != dim:
        out = out[..., :dim].contiguous()
    return zero_dead_rows(out, live, query_start_loc)


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
