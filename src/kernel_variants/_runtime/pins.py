"""The variants pinned by ``force()`` (per context) and by ``KV_FORCE`` (per process), as the
call path and the compiled call core read them."""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernel_variants._registry.registry import Registry

# Pins set by force(), as a hashable tuple of (op, id) pairs so that it can be part of a memo key.
_pins: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("kv_pins", default=())
pins_in_context = _pins.get


def parse_force(raw: str, ops: Iterable[str]) -> dict[str, str]:
    """``"causal_conv1d_fn=reference,causal_conv1d_update=x"``; a bare id pins every op; an id
    is a variant or ``variant:tactic``."""
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


def check_tactics(pins: dict[str, str], registry: Registry) -> dict[str, str]:
    """``pins``, once every ``variant:tactic`` among them names a tactic that one of the ops it
    pins registers (else a ValueError naming the variant's tactics) and none is a retired id
    (else a ValueError naming its tactic). (An unknown variant is the
    call's error, as before: its decision says what is registered.)"""
    renames = registry.renames()
    for op, vid in pins.items():
        if (op, vid) in renames:
            raise ValueError(f"KV_FORCE: variant {vid!r} of {op} is now the tactic {renames[(op, vid)]!r}")
    for name in {vid for vid in pins.values() if ":" in vid}:
        ops = [op for op, vid in pins.items() if vid == name]
        base = name.partition(":")[0]
        found = [rv for op in ops for rv in registry.variants(op) if rv.id in (name, base)]
        if found and not any(rv.id == name for rv in found):
            tactics = sorted({t for rv in found for t in rv.tactics})
            raise ValueError(f"KV_FORCE: variant {base!r} has no tactic {name.partition(':')[2]!r} "
                             f"(its tactics: {', '.join(tactics) or 'none'})")
    return pins
