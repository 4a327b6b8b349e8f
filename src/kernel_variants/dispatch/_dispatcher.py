"""The stateful side of dispatch: the registry, pinned variants and the per-process memo.

Decisions are memoised per call key, so a call whose shape was seen before costs one dict hit
on top of validation. Anything that can change a decision (calibration, registry reload) clears
the memo; pins are part of the memo key.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from kernel_variants._capture import capturing
from kernel_variants.registry import CallKey
from kernel_variants.registry._registry import Registry, make_plugin_manager

from ._fingerprint import fingerprint, fingerprint_id
from ._select import Decision, NoVariantError, select
from ._table import DEFAULT_MARGIN, CalibrationTable

Hit = tuple[str, Callable[..., Any], Callable[..., Any], tuple[tuple[int, Any], ...]]
_MEMO_LIMIT = 65536  # varlen batches make many distinct keys; a bound keeps serving memory flat

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


class VariantFailed(RuntimeError):
    """A variant raised during a real call; the message names it, ``__cause__`` is the original."""


class Dispatcher:
    def __init__(self, registry: Registry | None = None, *, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._registry = registry
        self._force_raw = env.get("KV_FORCE", "")
        self._env_pins: dict[str, str] | None = None
        self.check_values = _flag(env.get("KV_CHECK_VALUES", "1"))
        self.tune = _flag(env.get("KV_TUNE", "0"))
        self._table: CalibrationTable | None = None
        # call signature (op, pins, each argument's metadata) -> (id, fn, invoker, substitutions)
        self.memo: dict[tuple[Any, ...], Hit] = {}

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry(make_plugin_manager())
        return self._registry

    @property
    def table(self) -> CalibrationTable:
        if self._table is None:
            self._table = CalibrationTable()
        return self._table

    def versions(self) -> dict[tuple[str, str], str]:
        return {(rv.op, rv.id): rv.version for rv in self.registry.variants()}

    def pinned(self, op: str) -> str | None:
        if self._env_pins is None:  # parsed against the registered ops, so on first use
            self._env_pins = parse_force(self._force_raw, (spec.name for spec in self.registry.ops()))
        return dict(_pins.get()).get(op) or self._env_pins.get(op)

    def decide(self, key: CallKey, forced: str | None = None, *, tune: bool | None = None) -> Decision:
        """The decision for ``key``; ``tune`` (default: KV_TUNE) may measure an unseen key first."""
        entries = self.registry.variants(key.op)
        if forced is not None:
            return select(entries, key, forced=forced)
        runnable = [rv.id for rv in entries if rv.why_not(key) is None]
        if not runnable:
            return select(entries, key)
        fpid = fingerprint_id(fingerprint(key.device))
        found = self.table.lookup(key, fpid, runnable, self.versions())
        if (self.tune if tune is None else tune) and (found is None or found[2] != "table") and not capturing(key.device):
            self._tune(key)
            found = self.table.lookup(key, fpid, runnable, self.versions())
        if found is None:
            return select(entries, key)
        timings, winner, source, at, rejected = found
        return select(entries, key, timings=timings, winner=winner, timings_source=source, measured_key=at,
                      rejected=rejected)

    def _tune(self, key: CallKey) -> None:
        """KV_TUNE=1: measure an unseen key on first sight, as PyTorch TunableOp's online tuning."""
        from ._calibrate import run_calibration
        from ._timing import TimingConfig

        run_calibration(self.registry.variants(key.op), self.table, key.spec, [key.shape], dtype=key.dtype,
                        device=key.device, features=key.features, timing=TimingConfig(), variants=None,
                        rotate=0, margin=DEFAULT_MARGIN, progress=None)
        self.invalidate()  # signatures memoised from nearest or priority decisions may change

    def resolve(self, sig: tuple[Any, ...] | None, key: CallKey, args: tuple[Any, ...]) -> Hit:
        """Decide for a validated call and remember the decision under its signature ``sig``."""
        decision = self.decide(key, self.pinned(key.op))
        # A variant compiled here is built before its first call (announced on stderr); one whose
        # build fails is unavailable from then on, and the call goes to the next choice.
        while decision.chosen is not None and decision.chosen.ensure_built() is not None:
            decision = self.decide(key, self.pinned(key.op))
        if decision.chosen is None:
            raise NoVariantError(f"no variant can run this call\n{decision}")
        spec = key.spec
        # Normalised arguments depend only on values that are part of the signature.
        subs = tuple((i, spec.normalize[n](args[i])) for i, n in enumerate(spec.params) if n in spec.normalize)
        hit = (decision.chosen.id, decision.chosen.variant.fn, spec.invoke, subs)
        if sig is not None:
            if len(self.memo) >= _MEMO_LIMIT:
                self.memo.clear()
            self.memo[sig] = hit
        return hit

    def invalidate(self) -> None:
        self.memo.clear()


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


_current: Dispatcher | None = None


def dispatcher() -> Dispatcher:
    """The process-wide dispatcher, created on first use (not at import)."""
    global _current
    if _current is None:
        _current = Dispatcher()
    return _current


def reset(registry: Registry | None = None) -> Dispatcher:
    """Start over: re-read the environment and plugins (or use ``registry``), forget decisions."""
    global _current
    _current = Dispatcher(registry)
    return _current


@contextlib.contextmanager
def force(**pins: str) -> Iterator[None]:
    """Pin ops to variants inside the block: ``with force(causal_conv1d_fn="reference"): ...``.

    A pinned variant that cannot run a call raises with its reasons; it never falls back.
    """
    registry = dispatcher().registry
    for op, vid in pins.items():
        try:
            registry.spec(op)
        except ValueError:
            raise TypeError(f"force: expected keyword arguments among {', '.join(s.name for s in registry.ops())}, "
                            f"got {op!r}") from None
        if not isinstance(vid, str):
            raise TypeError(f"force: expected a variant id string for {op}, got {type(vid).__name__}")
        registry.get(op, vid)  # raises KeyError listing what is registered
    token = _pins.set(tuple({**dict(_pins.get()), **pins}.items()))
    try:
        yield
    finally:
        _pins.reset(token)
