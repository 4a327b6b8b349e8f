"""Shadow verification of live calls: a sampled fraction of dispatched calls is also run by the
reference, and judged by qualification's own verifier (``_tuning.verify.judge``).

Qualification sees synthetic inputs; real traffic has what they lack (activation outliers, odd
index patterns). With ``KV_SHADOW=<rate>`` (or :func:`set_rate`), each (op, variant) stream of
calls is sampled at ``rate``, deterministically given ``KV_SHADOW_SEED``. A shadowed call runs
the reference and the variant each on its own copy of the call's inputs, taken before either
ran; the caller gets the variant's result and state when the verifier passes them, else the
reference's: a shadowed call never returns a wrong answer nor half-writes a state. A mismatch
fails the variant's verdict for the call's class (stored, naming the output, the error and the
tolerance), so later calls route to the next qualified variant; the call's inputs are saved to
a file that ``kv shadow --replay FILE`` judges again.

Rate 0 (the default) adds nothing to a call: the memoised decision runs the variant itself.
Otherwise the decision runs :func:`wrap`'s function in the variant's place (the compiled call
core included), which counts the call and, when sampled, shadows it. Never while a graph is
captured or traced, nor for a call whose output must carry gradients: such a call is counted
and runs unshadowed.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import random
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kernel_variants._capture import capturing
from kernel_variants._paths import table_dir
from kernel_variants._registry.case import Case
from kernel_variants._tuning.verify import copy_case, judge

if TYPE_CHECKING:
    from kernel_variants._registry.spec import OpSpec

ENV, SEED_ENV = "KV_SHADOW", "KV_SHADOW_SEED"


class ShadowMismatch(UserWarning):
    """A shadowed call's variant disagreed with its oracle (the caller got the oracle's result)."""


@dataclasses.dataclass
class ShadowCount:
    """Per (op, variant): calls served by it, calls shadowed, mismatches found (this process)."""

    op: str
    variant: str
    served: int = 0
    shadowed: int = 0
    mismatches: int = 0
    last_mismatch: str = ""  # the file holding the inputs of the latest mismatch


def parse_rate(raw: object, what: str = ENV) -> float:
    """A shadow rate from the environment or an argument: a number in [0, 1]."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise TypeError(f"{what}: expected a rate between 0 and 1, got {type(raw).__name__} {raw!r}")
    text = raw.strip() if isinstance(raw, str) else raw
    if text == "":
        return 0.0
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"{what}: expected a rate between 0 and 1 (0.01: one call in a hundred), "
                         f"got {raw!r}") from None
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{what}: expected a rate between 0 and 1, got {rate}")
    return rate


class _State:
    """The process's shadow settings and counters."""

    def __init__(self) -> None:
        self.rate = 0.0
        self.seed = 0
        self.engine = 0  # engine patches shadowing now (patch(shadow=...)): they need the counts
        self.counts: dict[tuple[str, str], ShadowCount] = {}
        self.streams: dict[tuple[str, str], Stream] = {}
        self.lock = threading.Lock()
        self.directory: Path | None = None  # where counters and mismatches go (the table's)
        self.flushed = 0.0
        self.generation = 0  # counters started over (kv.reload): each run of them has its own file

    def count(self, op: str, vid: str) -> ShadowCount:
        c = self.counts.get((op, vid))
        if c is None:
            with self.lock:
                c = self.counts.setdefault((op, vid), ShadowCount(op, vid))
        return c

    def sample(self, op: str, vid: str) -> bool:
        """Whether this call of the (op, vid) stream is shadowed (the streams start over when
        the rate or the seed changes)."""
        stream = self.streams.get((op, vid))
        if stream is None:
            with self.lock:
                stream = self.streams.setdefault((op, vid), Stream(f"{self.seed}|{op}|{vid}", self.rate))
        return stream.sample()


class Stream:
    """One sampled stream of calls (an (op, variant)'s, an engine function's): ``rate`` of them,
    deterministically given the name (which carries the seed), so a rerun samples the same calls."""

    def __init__(self, name: str, rate: float) -> None:
        self.rate = parse_rate(rate, "shadow")
        self._rng = random.Random(name)

    def sample(self) -> bool:
        return self.rate >= 1.0 or (self.rate > 0.0 and self._rng.random() < self.rate)


_state = _State()


def configure(env: Mapping[str, str]) -> None:
    """Read ``KV_SHADOW`` / ``KV_SHADOW_SEED`` at each dispatcher's creation (``kv.reload``),
    which starts the counters over (those so far are written out first)."""
    rate = parse_rate(env.get(ENV, ""))
    flush()
    with _state.lock:
        _state.counts = {}
        _state.generation += 1
    _state.rate = rate
    seed = env.get(SEED_ENV, "0").strip() or "0"
    try:
        _state.seed = int(seed)
    except ValueError:
        raise ValueError(f"{SEED_ENV}: expected an integer, got {seed!r}") from None
    _state.streams.clear()
    # Fixed now, with the table's: counters flushed at exit go beside the table this process used.
    _state.directory = table_dir()


def set_rate(rate: float, seed: int | None = None) -> None:
    """The Python form of ``KV_SHADOW``; the caller forgets the memoised decisions (they hold
    the variant itself, or its shadowing wrapper)."""
    _state.rate = parse_rate(rate, "rate")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed: expected an integer, got {type(seed).__name__} {seed!r}")
        _state.seed = seed
    _state.streams.clear()


def rate() -> float:
    return _state.rate


def seed() -> int:
    return _state.seed


def engine_shadowing(delta: int) -> None:
    """An engine patch with ``shadow=`` starts (+1) or ends (-1): dispatched calls are counted
    while one is active, so a mismatch with the engine names the variant that served."""
    with _state.lock:
        _state.engine = max(0, _state.engine + delta)


def active() -> bool:
    """Whether decisions run the shadowing wrapper instead of the variant."""
    return _state.rate > 0.0 or _state.engine > 0


def count_of(op: str, vid: str) -> ShadowCount:
    """The live counter of variant ``vid`` of ``op`` (engine shadowing adds to it)."""
    return _state.count(op, vid)


def counts() -> list[ShadowCount]:
    """A snapshot of this process's counters, by op and variant."""
    return [dataclasses.replace(c) for _, c in sorted(_state.counts.items())]


# While an engine-shadowed adapter call runs (``integrations._shadow``), the dispatched calls it
# makes: (spec, variant, its arguments in signature order, copied before it ran) each. The
# engine's function is that call's oracle: those calls are not also shadowed by the reference.
_served_log = threading.local()


def served_log() -> list[tuple[OpSpec, str, tuple[Any, ...]]] | None:
    return getattr(_served_log, "calls", None)


def set_served_log(calls: list[Any] | None) -> None:
    _served_log.calls = calls


OnMismatch = Callable[..., str]  # (spec, vid, args in signature order, why) -> the file saved


def wrap(spec: OpSpec, vid: str, fn: Callable[..., Any], on_mismatch: OnMismatch) -> Callable[..., Any]:
    """``fn`` (variant ``vid`` of ``spec``) counted and shadowed at the current rate.
    ``on_mismatch``: fails the variant's class and returns the file its inputs were saved to."""
    count = _state.count(spec.name, vid)
    reference = spec.reference.fn
    first = spec.tensor_indices[0]

    def shadowed(*args: Any, **kwargs: Any) -> Any:
        count.served += 1
        log = served_log()
        if log is not None:
            mine = copy_case(Case(spec, args, {k: v for k, v in kwargs.items() if k != "out"}))
            log.append((spec, vid, spec.bind(*mine.args, **mine.kwargs)))
            return fn(*args, **kwargs)
        if not _state.sample(spec.name, vid):
            return fn(*args, **kwargs)
        t = args[first] if first < len(args) else kwargs.get(spec.params[first])
        call = spec.bind(*args, **{k: v for k, v in kwargs.items() if k != "out"})  # signature order
        if capturing(getattr(getattr(t, "device", None), "type", "cpu")) or (
                torch.is_grad_enabled() and spec.needs_grad(call)):
            # (a result built from copies would cut the caller's autograd graph)
            return fn(*args, **kwargs)
        count.shadowed += 1
        return _shadow_call(spec, vid, fn, reference, (args, kwargs, call), count, on_mismatch)

    shadowed.__name__ = shadowed.__qualname__ = f"{spec.name}_{vid.replace(':', '_')}_shadowed"
    shadowed.__wrapped__ = fn  # type: ignore[attr-defined]
    return shadowed


def _shadow_call(spec: OpSpec, vid: str, fn: Callable[..., Any], reference: Callable[..., Any],
                 given: tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]], count: ShadowCount,
                 on_mismatch: OnMismatch) -> Any:
    """``given``: the call as the variant got it (args, kwargs) and in signature order."""
    args, kwargs, call = given
    out = kwargs.pop("out", None)  # judged without it; the result is copied into it below
    case = Case(spec, args, kwargs)
    try:
        expected_on = copy_case(case)
        ref = expected_on.call(reference)
        expected = (ref, {n: expected_on.allocation(n) for n in spec.mutates if n in expected_on.storages})
    except Exception:  # no memory for the copies, say: the call runs unshadowed, as it would at rate 0
        count.shadowed -= 1
        return fn(*args, **kwargs) if out is None else fn(*args, **kwargs, out=out)
    judged = judge(fn, case, expected)
    if judged.why is None:
        result, ran_on = judged.got, judged.ran_on
    else:
        count.mismatches += 1
        # Saved while the caller's tensors still hold the inputs (nothing below has run on them).
        try:
            where = on_mismatch(spec, vid, call, judged.why)
        except Exception as exc:  # the caller still gets the reference's answer
            where = f"(not recorded: {type(exc).__name__}: {exc})".splitlines()[0]
        count.last_mismatch = where
        warnings.warn(f"kernel_variants: shadow: {spec.name} variant {vid!r} disagrees with the reference on a "
                      f"live call: {judged.why}; this call returned the reference's result, and {vid!r} no longer "
                      f"serves this class of calls here (inputs saved to {where}: kv shadow --replay {where})",
                      ShadowMismatch, stacklevel=3)
        result, ran_on = ref, expected_on
    for name in spec.mutates:  # the state as the judged run wrote it
        mine = case.get(name)
        if isinstance(mine, torch.Tensor):
            mine.copy_(ran_on.tensor(spec, name))
    _flush_soon()
    if out is None:
        return result
    if len(spec.outputs) == 1:
        return out.copy_(result)
    for o, r in zip(out, result, strict=True):
        o.copy_(r)
    return tuple(out)


def save_mismatch(doc: dict[str, Any]) -> str:
    """Write a mismatch's inputs and what was found; returns the file's path."""
    folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"mismatch-{doc['op']}-{doc['variant'].replace(':', '_')}-{stamp}-{os.getpid()}-{time.monotonic_ns() % 10**6}.pt"
    path = folder / name
    torch.save(doc, path)
    return str(path)


def _folder() -> Path:
    return (_state.directory or table_dir()) / "shadow"


def _flush_soon() -> None:
    if time.monotonic() - _state.flushed > 10.0:
        flush()


def flush() -> None:
    """Write this process's counters where ``kv shadow`` reads them (one file per process)."""
    _state.flushed = time.monotonic()
    if not _state.counts:
        return
    try:
        folder = _folder()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"counts-{socket.gethostname()}-{os.getpid()}-{_state.generation}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([dataclasses.asdict(c) for c in counts()]))
        os.replace(tmp, path)
    except OSError:  # a counter file is a report, never the call's problem
        pass


atexit.register(flush)
