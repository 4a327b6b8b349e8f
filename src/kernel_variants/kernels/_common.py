"""What the built-in torch variants share: slot bookkeeping."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Slots(NamedTuple):
    slots: torch.Tensor  # [B] int64, pad entries kept as pad_slot_id
    safe: torch.Tensor  # [B] int64, pad entries replaced by slot 0 so gathers stay in bounds
    live: torch.Tensor | None  # [B] bool, False for padded sequences; None when none can be


def resolve(indices: torch.Tensor | None, batch: int, pad_slot_id: int, device: torch.device) -> Slots:
    """Sequence b's slot is ``indices[b]`` (or b); a slot equal to ``pad_slot_id`` is padding."""
    if indices is None:
        slots = torch.arange(batch, device=device)
        return Slots(slots, slots, None)
    slots = indices.long()
    live = slots != pad_slot_id
    return Slots(slots, torch.where(live, slots, 0), live)


def initial(has_initial_state: torch.Tensor | None, s: Slots, batch: int, device: torch.device) -> torch.Tensor:
    """[B] bool: whether sequence b starts from its slot's history (never for padding)."""
    init = has_initial_state if has_initial_state is not None else torch.zeros(batch, dtype=torch.bool, device=device)
    return init if s.live is None else init & s.live
