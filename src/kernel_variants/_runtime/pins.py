"""The variants pinned by ``force()`` (per context) and by ``KV_FORCE`` (per process), as the
call path and the compiled call core read them."""

from __future__ import annotations

import contextvars
from collections.abc import Iterable

# Pins set by force(), as a hashable tuple of (op, id) pairs so that it can be part of a memo key.
_pins: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("kv_pins", default=())
pins_in_context = _pins.get


def parse_force(raw: str, ops: Iterable[str]) -> dict[str, str]:
    """``"causal_conv1d_fn=reference,causal_conv1d_update=x"``; a bare id pins every op."""
    ops = list(ops)
    pins: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        op, sep, vid = item.partition("=")
        if not sep:
            pins.update(dict.fromkeys(ops, item))
            continue
        op, vid = op.strip(), vid.strip()
        if op not in ops:
            raise ValueError(f"KV_FORCE: expected op names {', '.join(ops)}, got {op!r} in {raw!r}")
        if not vid:
            raise ValueError(f"KV_FORCE: expected a variant id after '{op}=', got nothing in {raw!r}")
        pins[op] = vid
    return pins
