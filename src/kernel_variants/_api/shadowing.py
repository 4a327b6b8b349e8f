"""Shadow verification from Python and ``kv shadow``: the rate, the counters of this process and
of every process that wrote its counters to the table directory, and the replay of a saved
mismatch."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from kernel_variants._paths import table_dir
from kernel_variants._runtime import shadow as _shadow
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.shadow import ShadowCount
from kernel_variants._tuning.verify import judge_saved, load_call


def shadow(rate: float, *, seed: int | None = None) -> None:
    """Shadow ``rate`` (0 to 1) of the dispatched calls from now on (``KV_SHADOW`` in Python):
    each (op, variant) stream sampled at that rate, deterministically given ``seed``. A shadowed
    call also runs the reference on copies of its inputs taken before the call; when the
    variant's output or written state is not the reference's (within the dtype's tolerance;
    state bit for bit), the caller gets the reference's result and state, the variant's verdict
    for that class of calls fails (so later calls go to the next qualified variant), and the
    call's inputs are saved (``kv shadow --replay FILE``). ``shadow(0)``: off (the default)."""
    d = dispatcher()  # made first: its creation reads KV_SHADOW, which this call overrides
    _shadow.set_rate(rate, seed)
    d.memo_clear()  # decisions hold the variant itself, or its shadowing wrapper


@dataclasses.dataclass(frozen=True)
class ShadowReport:
    """What ``kv shadow`` reads: the counters every process wrote (summed per op and variant;
    ``processes``: how many files) and the saved mismatches, newest last."""

    counts: list[ShadowCount]
    processes: int
    mismatches: list[dict[str, str]]


def shadow_report(*, all_processes: bool = False) -> ShadowReport:
    """Per (op, variant): calls served (counted while shadowing is on, at any rate), calls
    shadowed, mismatches found, in this process, or (``all_processes``) summed over every
    process that wrote its counters beside the table (each does every 10 s while it shadows,
    and at exit); with every mismatch saved there."""
    _shadow.flush()  # this process's own counters first
    folder = table_dir() / "shadow"
    mismatches = _mismatches(folder)
    if not all_processes:
        return ShadowReport(_shadow.counts(), 1, mismatches)
    total: dict[tuple[str, str], ShadowCount] = {}
    files = sorted(folder.glob("counts-*.json")) if folder.is_dir() else []
    for f in files:
        try:
            rows = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for row in rows:
            c = total.setdefault((row["op"], row["variant"]), ShadowCount(row["op"], row["variant"]))
            c.served, c.shadowed, c.mismatches = (c.served + row["served"], c.shadowed + row["shadowed"],
                                                  c.mismatches + row["mismatches"])
            c.last_mismatch = row.get("last_mismatch") or c.last_mismatch
    return ShadowReport([total[k] for k in sorted(total)], len(files), mismatches)


def _mismatches(folder: Path) -> list[dict[str, str]]:
    mismatches = []
    for f in sorted(folder.glob("mismatch-*.pt"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []:
        try:
            doc = load_call(str(f))
        except Exception as exc:  # a truncated or foreign file is listed, not fatal
            mismatches.append({"file": str(f), "op": "?", "variant": "?", "oracle": "?",
                               "reason": f"unreadable ({type(exc).__name__})"})
            continue
        mismatches.append({"file": str(f), "op": doc["op"], "variant": doc["variant"],
                           "oracle": str(doc.get("oracle", "the reference")), "reason": str(doc.get("reason", ""))})
    return mismatches


def replay_mismatch(path: str | Path) -> tuple[str | None, str]:
    """Judge the variant of a saved mismatch again on its inputs, against the reference, as the
    shadowed call did; a mismatch found against an engine's own function is replayed against
    that function too where it can be imported. Returns (what is wrong, or None; what ran)."""
    try:
        doc = load_call(str(path))
    except Exception as exc:  # torch.load's refusals are of several types
        return f"cannot read the saved call ({type(exc).__name__}: {exc})".splitlines()[0], str(path)
    registry = dispatcher().registry
    spec = registry.spec(doc["op"])
    rv = registry.get(spec.name, doc["variant"])
    why = judge_saved(doc, rv, spec)
    ran = f"{doc['op']} variant {doc['variant']} against the reference"
    engine = doc.get("engine")
    if why is None and isinstance(engine, dict):
        from kernel_variants.integrations._shadow import replay_engine

        why = replay_engine(engine)
        ran += f", then {engine.get('adapter')} against {engine.get('function')}"
    return why, ran


def clear_shadow() -> Path:
    """Remove every process's counters and the saved mismatches; returns the folder."""
    folder = table_dir() / "shadow"
    shutil.rmtree(folder, ignore_errors=True)
    return folder
