"""The stateful side of dispatch: the registry, pinned variants and the per-process memo.

Decisions are memoised per call key, so a call whose shape was seen before costs one dict hit
on top of validation. Anything that can change a decision (calibration, registry reload) clears
the memo; pins are part of the memo key.

``KV_RECORD=1`` (or a directory) records each key decided without a measured row (once per key
per process) for ``kv calibrate --recorded``. Under ``torch.distributed`` with ``KV_TUNE=1``, the
ranks tune together: rank 0 measures a key none has measured and every rank runs its choice
(see ``_tuning.distributed.tune_together``; ``KV_TUNE=local`` tunes each rank on its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from kernel_variants._capture import capturing
from kernel_variants._decide import Build, Facts, Look, Qualify, Tune, decide
from kernel_variants._policy import Decision, Figures, NoVariantError, is_reference, policy_from
from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.registry import RegisteredVariant, Registry, make_plugin_manager
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime import callcore, shadow
from kernel_variants._runtime.pins import _pins, check_tactics, parse_force
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import DEFAULT_MARGIN, DEFAULT_PRUNE, Verdict, key_parts, key_text
from kernel_variants._table.store import CalibrationWarning, Recorder
from kernel_variants._table.table import CalibrationTable
from kernel_variants._tuning.qualify import Qualifier


@dataclasses.dataclass(frozen=True, slots=True)
class Hit:
    """A memoised decision and what each call with its signature runs around the variant."""

    vid: str
    fn: Callable[..., Any]
    invoke: Callable[..., Any]  # how to call fn (spec.invoke, or an out= runner)
    subs: tuple[tuple[int, Any], ...]  # normalised arguments: (index, value)
    guard: Callable[..., bool] | None  # the write guard: (args, out) -> whether out is an input
    checks: Callable[..., None] | None  # the index value checks: (args)
    rule: Callable[..., Any] | None  # off the CPU, the device rule: args -> args


_MEMO_LIMIT = 65536  # varlen batches make many distinct keys; a bound keeps serving memory flat


class Memo(dict):
    """The memo: call signature -> Hit. The compiled call cores hold copies of its entries, so
    clearing it (invalidation, calibration, its bound) clears them too."""

    def clear(self) -> None:
        super().clear()
        callcore.clear_all()


def record_dir(raw: str, table_dir: Path) -> Path | None:
    """Where ``KV_RECORD`` sends records: off (None), the table directory, or a directory named."""
    raw = raw.strip()
    if raw.lower() in ("", "0", "false", "no", "off"):
        return None
    if raw.lower() in ("1", "true", "yes", "on"):
        return table_dir
    return Path(raw).expanduser()


class Dispatcher:
    def __init__(self, registry: Registry | None = None, *, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._registry = registry
        self._force_raw = env.get("KV_FORCE", "")
        self._env_pins: dict[str, str] | None = None
        # KV_CHECK_VALUES unset (or "auto"): host value checks on the CPU, the op's device rule
        # elsewhere (no sync); "1": host checks everywhere (syncs); "0": neither off the CPU.
        values = env.get("KV_CHECK_VALUES", "auto").strip().lower()
        self.device_values = values == "auto"
        self.check_values = not self.device_values and _flag(values)
        tune = env.get("KV_TUNE", "0").strip().lower()
        self.tune = tune == "local" or _flag(tune)
        self.tune_ranks = tune != "local"  # under torch.distributed: rank 0 measures, all follow
        self._record_raw = env.get("KV_RECORD", "")
        self._recorder: Recorder | None = None
        self._recorded: set[str] = set()  # keys this process has recorded (or tried to)
        self._record_lock = threading.Lock()
        self._table: CalibrationTable | None = None
        self._versions: dict[tuple[str, str], str] | None = None
        shadow.configure(env)  # KV_SHADOW: a sampled share of calls checked against the reference
        # KV_QUALIFY: who may be chosen (require: qualified variants only; strict: and checked
        # at a shape beyond those they were checked at, first; off: anything that can run).
        # A verdict turning to a failure drops every memoised decision: one may have chosen it.
        self.qualifier = Qualifier(lambda: self.table, policy_from(env.get("KV_QUALIFY", "")), self.memo_clear)
        # call signature (op, pins, each argument's metadata) -> what runs for it (a Hit)
        self.memo: dict[tuple[Any, ...], Hit] = Memo()
        # key_text -> (key, the variant chosen): what this process ran, for check_agreement()
        self.decided: dict[str, tuple[CallKey, str]] = {}
        # key_text -> the variant rank 0 chose for it (distributed tuning): every rank runs it
        self.agreed: dict[str, str] = {}

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry(make_plugin_manager())
        return self._registry

    @property
    def table(self) -> CalibrationTable:
        if self._table is None:
            self._table = CalibrationTable()
            self._table.renames = self.registry.renames()  # rows of retired ids move to their tactics
        return self._table

    def versions(self) -> dict[tuple[str, str], str]:
        """Each candidate's full version (the registry is fixed for this dispatcher's life)."""
        if self._versions is None:
            self._versions = {(rv.op, rv.id): rv.version for rv in self.registry.variants()}
        return self._versions

    def pinned(self, op: str) -> str | None:
        if self._env_pins is None:  # parsed against the registered ops, so on first use
            self._env_pins = check_tactics(parse_force(self._force_raw, (s.name for s in self.registry.ops())),
                                           self.registry)
        return dict(_pins.get()).get(op) or self._env_pins.get(op)

    def decide(self, key: CallKey, forced: str | None = None, *, tune: bool | None = None,
               qualify: bool = True, exclude: Iterable[str] = (), build: bool = False) -> Decision:
        """The decision for ``key``, by ``_decide.decide``; ``tune`` (default: KV_TUNE) may measure
        an unseen key first, ``build`` builds the choice (a call runs it).

        Only a variant qualified on this device for the key's class may be chosen, by any route;
        one without a verdict yet is qualified when it would be chosen (``qualify``; never while
        a graph is captured or traced: there it is passed over). ``qualify=False`` previews the
        choice, as ``explain`` does. ``exclude``: ids another rank may not choose (rank 0 decides
        for all). A forced variant runs as forced; the decision says if it is unqualified."""
        tune = self.tune if tune is None else tune
        if (tune and self.tune_ranks and not capturing(key.device) and key_text(key) not in self.agreed
                and self.registry.variants(key.op)):
            from kernel_variants._tuning.distributed import tune_together, tuning_world

            if tuning_world() > 1:
                return tune_together(self, key, forced, build=build)  # a collective: every rank decides now
        facts = self.facts(key, forced, tune=tune, qualify=qualify, build=build,
                           exclude=dict.fromkeys(exclude, "not qualified on every rank (rank 0 chose among the others)"))
        return self.settle(facts, decide)

    def facts(self, key: CallKey, forced: str | None = None, *, tune: bool = False, qualify: bool = True,
              build: bool = False, exclude: Mapping[str, str] | None = None) -> Facts:
        """What is known of ``key`` before deciding: the candidates and what each cannot run
        (a registry exclusion among it), their verdicts, the pin, ``exclude`` (another rank's
        choice to make) and rank 0's choice."""
        entries = tuple(self.registry.variants(key.op))
        unfit = {rv.id: rv.why_not(key) for rv in entries}
        capture = capturing(key.device)  # (it says so under compile too)
        return Facts(key, entries, self.qualifier.announced_policy(), self._verdicts(entries, key, unfit),
                     forced=forced, may_run=qualify and not capture, preview=not qualify, build=build,
                     tune=tune and not capture, agreed=self.agreed.get(key_text(key)),
                     excluded=dict(exclude or {}), unfit=unfit)

    def _verdicts(self, entries: Iterable[RegisteredVariant], key: CallKey,
                  unfit: Mapping[str, str | None]) -> dict[str, Verdict | None]:
        return {rv.id: self.qualifier.stored(rv, key) for rv in entries if unfit[rv.id] is None}

    def settle(self, facts: Facts, rule: Callable[[Facts], Any]) -> Any:
        """Ask ``rule`` (``_decide.decide`` or ``admissions``) until it answers with something
        other than a request, carrying out each request and adding what it learnt to the facts."""
        key = facts.key
        while True:
            asked = rule(facts)
            if isinstance(asked, Look):
                facts = dataclasses.replace(facts, figures={**facts.figures, asked.among: self.figures(key, asked.among)})
            elif isinstance(asked, Qualify):
                facts = self.qualifier.answer(facts, asked, announce=True)
            elif isinstance(asked, Tune):
                self._tune(key)
                facts = dataclasses.replace(facts, tuned=True, figures={},
                                            verdicts=self._verdicts(facts.entries, key, facts.unfit))
            elif isinstance(asked, Build):
                why = self.registry.get(key.op, asked.variant).ensure_built()
                facts = dataclasses.replace(facts, built={**facts.built, asked.variant: why})
            else:
                return asked

    def figures(self, key: CallKey, candidates: Iterable[str]) -> Figures | None:
        """What this device's table has for ``key`` among ``candidates``."""
        fpid = fingerprint_id(fingerprint(key.where))  # this GPU, not the first one
        return self.table.figures(key, fpid, candidates, self.versions())

    def _tune(self, key: CallKey) -> None:
        """KV_TUNE=1: measure an unseen key on first sight, as PyTorch TunableOp's online tuning
        (a variant out of routing is unavailable: neither built nor measured)."""
        from kernel_variants._tuning.calibrate import run_calibration
        from kernel_variants._tuning.timing import TimingConfig

        run_calibration(self.registry.variants(key.op), self.table, key.spec, [key.shape], dtype=key.dtype,
                        device=key.where, features=key.features, timing=TimingConfig(), variants=None,
                        rotate=0, margin=DEFAULT_MARGIN, progress=None, prune=DEFAULT_PRUNE,
                        qualifier=self.qualifier)
        self.invalidate()  # signatures memoised from nearest or priority decisions may change

    def resolve(self, sig: tuple[Any, ...] | None, key: CallKey, args: tuple[Any, ...],
                finish: Callable[[RegisteredVariant, Hit], Hit] | None = None) -> Hit:
        """Decide for a validated call and remember the decision under its signature ``sig``;
        ``finish(chosen, hit)`` may adapt the hit to the call (its ``out=``) before it is kept."""
        # A variant compiled here is built before its first call (announced on stderr); one whose
        # build fails is unavailable from then on, and the call goes to the next choice.
        decision = self.decide(key, self.pinned(key.op), build=True)
        if decision.chosen is None:
            raise NoVariantError(f"no variant can run this call\n{decision}")
        text = key_text(key)
        if len(self.decided) < _MEMO_LIMIT or text in self.decided:
            self.decided[text] = (key, decision.chosen.id)
        if (self._record_raw and decision.source in ("nearest", "priority") and decision.measured_key != key.shape
                and text not in self._recorded):
            self._record(key, text)
        spec = key.spec
        # Normalised arguments depend only on values that are part of the signature.
        subs = tuple((i, spec.normalize[n](args[i])) for i, n in enumerate(spec.params) if n in spec.normalize)
        fn = decision.chosen.variant.fn
        if shadow.active() and not is_reference(decision.chosen, spec):
            fn = shadow.wrap(spec, decision.chosen.id, fn, self.shadow_failed)
        hit = Hit(decision.chosen.id, fn, spec.invoke, subs, guard=None, checks=None, rule=None)
        if finish is not None:
            hit = finish(decision.chosen, hit)
        if sig is not None and not decision.provisional:
            if len(self.memo) >= _MEMO_LIMIT:
                self.memo.clear()
            self.memo[sig] = hit
        return hit

    def shadow_failed(self, spec: OpSpec, vid: str, args: tuple[Any, ...], why: str, *,
                      oracle: str = "the reference", extra: Mapping[str, Any] | None = None) -> str:
        """A shadowed call of variant ``vid`` (``args`` in signature order, as it got them)
        disagreed with ``oracle``: its inputs are saved (``kv shadow --replay``), its verdict for
        the call's class fails, so no later call is routed to it, and the file's path is returned."""
        key = spec.key(args, values=False)
        rv = self.registry.get(spec.name, vid)
        try:
            where = evidence = shadow.save_mismatch({
                "op": spec.name, "variant": vid, "version": rv.version, "oracle": oracle, "reason": why,
                "key": key_text(key), "fingerprint": fingerprint(key.where), "args": tuple(args), **(extra or {}),
            })
        except Exception as exc:  # a full disk must not keep a wrong variant serving
            where, evidence = f"(inputs not saved: {type(exc).__name__}: {exc})".splitlines()[0], ""
        self.qualifier.shadow_failed(rv, key, f"{why} (a live call, against {oracle})", evidence)
        return where

    def _record(self, key: CallKey, text: str) -> None:
        """KV_RECORD: note a key decided without a measured row, once per process; a record that
        cannot be written turns recording off for this process, with one warning."""
        with self._record_lock:
            if text in self._recorded:
                return
            self._recorded.add(text)
            if self._recorder is None:
                where = record_dir(self._record_raw, self.table.directory)
                if where is None:
                    return
                self._recorder = Recorder(where)
            fp = fingerprint(key.where)
            doc = {**key_parts(key), "fingerprint": fp, "fingerprint_id": fingerprint_id(fp)}
            kid = hashlib.sha256(f"{doc['fingerprint_id']}|{text}".encode()).hexdigest()[:20]
            try:
                got = self._recorder.add(kid, doc)
            except Exception as exc:  # sqlite3.Error, OSError: never the call's problem
                self._record_raw = ""
                warnings.warn(f"KV_RECORD: cannot write the record {self._recorder.path} ({type(exc).__name__}: "
                              f"{exc}); recording is off for this process", CalibrationWarning, stacklevel=5)
                return
            if got == "full":
                self._record_raw = ""
                warnings.warn(f"KV_RECORD: the record {self._recorder.path} already holds {self._recorder.limit} keys "
                              "waiting for calibration; this process records no more (kv calibrate --recorded "
                              "measures them)", CalibrationWarning, stacklevel=5)

    def invalidate(self) -> None:
        self.memo.clear()
        self.qualifier.forget()

    def memo_clear(self) -> None:
        self.memo.clear()


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


_current: Dispatcher | None = None


def dispatcher() -> Dispatcher:
    """The process-wide dispatcher, created on first use (not at import)."""
    global _current
    if _current is None:
        _current = Dispatcher()
        callcore.rearm()
    return _current


def reset(registry: Registry | None = None) -> Dispatcher:
    """Start over: re-read the environment and plugins (or use ``registry``), forget decisions."""
    global _current
    old, _current = _current, Dispatcher(registry)
    if old is not None:
        # This thread's connections to the old table and record would stay open until
        # collected: a folder the caller then removes (a benchmark's throwaway table) would be
        # held open, and each reload leak one. (diskcache keeps one per thread: other threads'
        # go with their threads or at collection.)
        if old._table is not None:
            old._table.close()
        with old._record_lock:  # `add` writes under it
            if old._recorder is not None:
                old._recorder.close()
    callcore.rearm()  # the cores held the old memo's entries; KV_CALL_CORE is read again
    return _current


@contextlib.contextmanager
def force(**pins: str) -> Iterator[None]:
    """Pin ops to variants inside the block: ``with force(causal_conv1d_fn="reference"): ...``;
    ``"variant:tactic"`` pins one tactic of a variant (an unknown tactic: ValueError naming them).

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
