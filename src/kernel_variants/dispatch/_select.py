"""Choosing a variant for a call: a pure function of candidates, call key and measurements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kernel_variants._checks import CallKey
from kernel_variants.registry._models import Capabilities
from kernel_variants.registry._registry import RegisteredVariant


def _in(value: int, bounds: tuple[int, int | None]) -> bool:
    lo, hi = bounds
    return value >= lo and (hi is None or value <= hi)


def _fmt(bounds: tuple[int, int | None]) -> str:
    lo, hi = bounds
    return f"{lo}..{'' if hi is None else hi}"


def uncovered(caps: Capabilities, key: CallKey) -> str | None:
    """Why ``caps`` does not cover the call ``key``, or ``None`` when it does."""
    if key.device not in caps.devices:
        return f"device {key.device} not in {sorted(caps.devices)}"
    if key.dtype not in caps.dtypes:
        return f"dtype {key.dtype} not in {sorted(caps.dtypes)}"
    for name, value, bounds in (
        ("width W", key.width, caps.width),
        ("batch B", key.batch, caps.batch),
        ("dim D", key.dim, caps.dim),
        ("seqlen L", key.seqlen, caps.seqlen),
    ):
        if not _in(value, bounds):
            return f"{name}={value} outside {_fmt(bounds)}"
    if key.varlen and not caps.varlen:
        return "varlen input (query_start_loc) not supported"
    if key.states and not caps.conv_states:
        return "conv states not supported"
    if key.noncontig_states and not caps.noncontiguous_states:
        return "non-contiguous state view not supported"
    if key.spec:
        if not caps.num_accepted_tokens:
            return "num_accepted_tokens not supported"
        spec_width = caps.num_accepted_tokens_width
        if spec_width is not None and not _in(key.width, spec_width):
            return f"num_accepted_tokens only for width {_fmt(spec_width)}, got W={key.width}"
    if key.bias and not caps.bias:
        return "bias not supported"
    if key.activation not in caps.activations:
        return f"activation {key.activation} not in {sorted(caps.activations)}"
    return None


@dataclass(frozen=True)
class TraceRow:
    """One candidate's fate in a decision."""

    variant: str
    accepted: bool
    reason: str
    time_us: float | None = None

    def __str__(self) -> str:
        mark = "+" if self.accepted else "-"
        t = f" {self.time_us:.2f} us" if self.time_us is not None else ""
        return f"  {mark} {self.variant}{t}: {self.reason}"


@dataclass(frozen=True)
class Decision:
    """Which variant runs a call, and why. ``chosen`` is None when nothing can run it."""

    key: CallKey
    chosen: RegisteredVariant | None
    source: str  # "forced", "table", "nearest", "priority" or "none"
    trace: tuple[TraceRow, ...]
    note: str = ""
    measured_key: tuple[int, int, int] | None = field(default=None)

    def __str__(self) -> str:
        k = self.key
        head = (
            f"{k.op} on {k.device} {k.dtype} W={k.width} (B={k.batch}, D={k.dim}, L={k.seqlen}) "
            f"bias={k.bias} act={k.activation} states={k.states} varlen={k.varlen} spec={k.spec}"
        )
        pick = self.chosen.id if self.chosen is not None else "nothing"
        notes = [self.note] if self.note else []
        if self.chosen is not None and self.chosen.needs_build():
            notes.append("not built yet: the first call compiles it, or run `kv build`")
        if self.measured_key is not None:
            b, d, seq = self.measured_key
            notes.append(f"timings measured at B={b}, D={d}, L={seq}")
        lines = [head, f"-> {pick} (by {self.source}{'; ' + '; '.join(notes) if notes else ''})"]
        lines += [str(r) for r in self.trace]
        return "\n".join(lines)


class NoVariantError(RuntimeError):
    """No registered variant can run a call (or the forced one cannot); the message has the trace."""


def select(
    entries: Sequence[RegisteredVariant],
    key: CallKey,
    *,
    forced: str | None = None,
    timings: Mapping[str, float] | None = None,
    timings_source: str = "table",
    measured_key: tuple[int, int, int] | None = None,
    winner: str | None = None,
) -> Decision:
    """Pick the variant for ``key`` among ``entries``.

    ``timings`` maps variant id to measured microseconds for this call's key (or the nearest
    calibrated one); ``winner`` is the table's recorded winner there, which keeps its place
    unless it cannot run this call. Without timings, the highest priority wins.
    """
    rows: list[TraceRow] = []
    ok: list[RegisteredVariant] = []
    for rv in entries:
        if forced is not None and rv.id != forced:
            rows.append(TraceRow(rv.id, False, f"not the forced variant {forced!r}"))
            continue
        why = uncovered(rv.variant.capabilities, key) or rv.unavailable_reason()
        if why is not None:
            rows.append(TraceRow(rv.id, False, why))
            continue
        ok.append(rv)
    if forced is not None:
        if not any(rv.id == forced for rv in entries):
            rows.append(TraceRow(forced, False, "not registered for this op"))
        if not ok:
            return Decision(key, None, "none", tuple(rows), note=f"forced variant {forced!r} cannot run this call")
        rows.append(TraceRow(forced, True, "forced"))
        return Decision(key, ok[0], "forced", tuple(rows))
    if not ok:
        return Decision(key, None, "none", tuple(rows))
    timed = {rv.id: timings[rv.id] for rv in ok if timings and rv.id in timings}
    if timed:
        if winner in timed:
            best = winner
            note = "recorded winner"
        else:
            best = min(timed, key=timed.__getitem__)
            note = "fastest measured"
        for rv in ok:
            t = timed.get(rv.id)
            if rv.id == best:
                rows.append(TraceRow(rv.id, True, note, t))
            elif t is None:
                rows.append(TraceRow(rv.id, False, "not measured for this key", None))
            else:
                rows.append(TraceRow(rv.id, False, f"{t / timed[best]:.2f}x the winner", t))
        chosen = next(rv for rv in ok if rv.id == best)
        return Decision(key, chosen, timings_source, tuple(rows), measured_key=measured_key)
    ranked = sorted(ok, key=lambda rv: -rv.variant.priority)
    for i, rv in enumerate(ranked):
        rows.append(TraceRow(rv.id, i == 0, f"priority {rv.variant.priority}" + ("" if i == 0 else " (lower)")))
    return Decision(key, ranked[0], "priority", tuple(rows), note="no measurements for this key")
