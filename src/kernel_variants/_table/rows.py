"""The table's rows and keys: what a calibration measured (``Measurement``), which variant a
shape goes to (``Winner``), whether a variant qualified for a class of calls (``Verdict``), and
the call key's text and plain-data forms. Every row is a JSON document validated on read."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.models import DTypeName
from kernel_variants._registry.spec import Shape
from kernel_variants._table.fingerprint import is_legacy

if TYPE_CHECKING:
    from kernel_variants._registry.registry import Registry

VERDICT_PREFIX = "q|"  # qualification verdicts, stored beside the timings

# 2: a group is (op, dtype, the op's own feature flags); rows of 1 (causal_conv1d's fields
# inline) are migrated when the table loads.
# 3: per-window samples, noise, pruned rows, each row's dependency versions; winners say how
# sure they are. The fingerprint no longer holds torch's and kernel_variants' versions: rows
# written with those (``is_legacy``) are ignored with one warning, never mixed with new ones.
SCHEMA = 3
# A challenger must be this much faster to take a shape from its winner: noise on a shared
# machine is a few percent, and choices that flip back and forth help nobody. It is the floor:
# where the measured noise of the two is larger, the lead must exceed that instead.
DEFAULT_MARGIN = 0.02
# After the first round of a shape, a candidate slower than the best by more than this is timed
# no further (recorded as pruned, with the ratio).
DEFAULT_PRUNE = 3.0
FeatureValue = bool | int | float | str


def check_margin(margin: float) -> float:
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError(f"margin: expected a fraction in [0, 1), got {margin!r}")
    return float(margin)


def check_prune(prune: float | None) -> float | None:
    """None (prune nothing) or a factor above 1."""
    if prune is None:
        return None
    if isinstance(prune, bool) or not isinstance(prune, (int, float)) or not (1 < prune < math.inf):
        raise ValueError(f"prune: expected a factor above 1 (or None for no pruning), got {prune!r}")
    return float(prune)


class Group(BaseModel):
    """The part of a call key other than the shape: timings are compared only within a group.

    ``features`` are the op's own flags as sorted (name, value) pairs, so that a group is the
    same whatever order an op declares them in.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    dtype: DTypeName
    features: tuple[tuple[str, FeatureValue], ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: object) -> object:
        """Schema 1 stored causal_conv1d's flags as fields of the group itself."""
        if isinstance(data, dict) and "features" not in data:
            flags = {k: v for k, v in data.items() if k not in ("op", "dtype")}
            data = {"op": data.get("op"), "dtype": data.get("dtype"), "features": flags}
        if isinstance(data, dict) and isinstance(data.get("features"), dict):
            data = {**data, "features": tuple(sorted(data["features"].items()))}
        elif isinstance(data, dict) and data.get("features") is not None:
            data = {**data, "features": tuple(sorted(tuple(p) for p in data["features"]))}
        return data

    @classmethod
    def of(cls, key: CallKey) -> Group:
        return cls(op=key.op, dtype=key.dtype, features=key.features.model_dump())

    def flags(self) -> dict[str, FeatureValue]:
        return dict(self.features)

    def slug(self) -> str:
        flags = ",".join(f"{k}={v}" for k, v in self.features)
        return f"{self.op}|{self.dtype}|{flags or '-'}"


class Measurement(BaseModel):
    """One variant timed (or rejected) on one shape of one group on one device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2, 3] = SCHEMA
    fingerprint: dict[str, str]
    fingerprint_id: str
    group: Group
    shape: Shape
    variant: str
    version: str
    # "pruned": timed for the first round only, ``pruned_at`` times slower than the best there;
    # ``best_us`` is that round's figure. Measured slower, never unmeasured. With no window
    # (``by_neighbours``), not timed here at all: it lost by far at the neighbouring shapes, and
    # ``best_us`` is that bound times its rival's figure here.
    status: Literal["ok", "rejected", "pruned"]
    reason: str = ""
    best_us: float | None = None
    median_us: float | None = None
    spread: float | None = None
    windows: int = 0
    iters: int = 0
    method: str = ""
    samples_us: tuple[float, ...] = Field(default=(), max_length=10_000)  # each window's mean
    noise: float | None = None  # (median - best) / best: how far a typical window is from the best
    pruned_at: float | None = None
    deps: dict[str, str] = Field(default_factory=dict, max_length=64)  # the variant's dependencies then
    measured_at: float

    def storage_key(self) -> str:
        return mkey(self.fingerprint_id, self.group, self.shape, self.variant)

    @property
    def timed(self) -> bool:
        """Has a figure (fully timed, or pruned after its first round or by its neighbours)."""
        return self.status in ("ok", "pruned") and self.best_us is not None

    @property
    def by_neighbours(self) -> bool:
        """Pruned by its neighbours: neither checked nor timed at this shape."""
        return self.status == "pruned" and self.windows == 0


Confidence = Literal["", "clear", "within noise", "single"]


class Winner(BaseModel):
    """The variant a shape goes to; it keeps the shape until a challenger beats it by the margin
    and by the measured noise.

    How sure it is: ``lead`` is the runner-up's time over the winner's, minus one (negative when
    a faster challenger did not lead by enough to take the shape), ``noise`` the two figures'
    combined noise, and ``confidence`` "clear" (the lead exceeds the margin and the noise),
    "within noise" (it does not: either could be faster) or "single" (nothing to compare)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2, 3] = SCHEMA
    fingerprint_id: str
    group: Group
    shape: Shape
    variant: str
    best_us: float
    runner_up: str | None = None
    lead: float | None = None
    noise: float | None = None
    confidence: Confidence = ""
    decided_at: float

    def storage_key(self) -> str:
        return wkey(self.fingerprint_id, self.group, self.shape)


def mkey(fp: str, group: Group, shape: Shape, variant: str) -> str:
    return f"m|{fp}|{group.slug()}|{','.join(map(str, shape))}|{variant}"


def wkey(fp: str, group: Group, shape: Shape) -> str:
    return f"w|{fp}|{group.slug()}|{','.join(map(str, shape))}"


@dataclass(frozen=True)
class StaleRow:
    """A measurement of this device that no longer matches its variant: why, and where it is."""

    group: Group
    shape: Shape
    variant: str
    measured: str  # the version it was measured with
    current: str  # the registered version now
    why: str
    legacy: bool  # written by an earlier release (its fingerprint held package versions, or no CPU kind)
    measured_at: float
    key: str  # its storage key
    winner_key: str  # the storage key of the winner row it was decided under


def stale_reason(m: Measurement, deps_now: dict[str, str], source_now: str = "") -> str:
    """Why ``m`` no longer matches the variant registered now (whose dependencies are
    ``deps_now`` and whose version without them is ``source_now``)."""
    if is_legacy(m.fingerprint):
        versions = ", ".join(f"{k} {m.fingerprint[k]}" for k in ("kernel_variants", "torch") if k in m.fingerprint)
        why = f"measured by an earlier release ({versions}), before staleness was kept per variant" if versions \
            else "measured by an earlier release, which did not record the CPU's model and ISA level"
        if source_now and m.version != source_now:
            why += "; its source has changed since"
        return why
    changed = [f"{k} {m.deps.get(k, '(none)')} -> {deps_now.get(k, '(none)')}"
               for k in sorted(set(m.deps) | set(deps_now)) if m.deps.get(k) != deps_now.get(k)]
    return "; ".join(changed) if changed else "its source or declared version changed"


class Verdict(BaseModel):
    """Whether one variant qualified for one class of calls on one device, and on what."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    fingerprint: dict[str, str]
    fingerprint_id: str
    group: Group
    variant: str
    version: str  # the variant's full version it was qualified at
    suite: str = ""  # the suite it ran (``_tuning.cases.suite_of``); "": written before suites were kept
    passed: bool
    cases: int  # cases run (each out= form of a case counts as one)
    failed_case: str = ""
    failed_shape: Shape = ()  # where a check at a calibrated shape failed (the edge cases: empty)
    reason: str = ""
    where: Literal["process", "child", "shadow"] = "process"  # shadow: a live call failed it
    evidence: str = ""  # where a shadowed call failed it: the file holding that call's inputs
    seconds: float = 0.0
    # Per shape axis, the largest size a passing check ran at (edge cases and calibrated shapes):
    # beyond it in some axis, the variant runs a shape it was never compared at.
    largest: Shape = ()
    qualified_at: float

    def storage_key(self) -> str:
        return verdict_key(self.fingerprint_id, self.group, self.variant)

    def summary(self) -> str:
        if self.passed:
            return f"qualified ({self.cases} cases)"
        return f"failed qualification: {self.failed_case}: {self.reason}" if self.failed_case else \
            f"failed qualification: {self.reason}"


def verdict_key(fingerprint_id: str, group: Group, variant: str) -> str:
    return f"{VERDICT_PREFIX}{fingerprint_id}|{group.slug()}|{variant}"


def parse_verdict(raw: str | None) -> Verdict | None:
    if raw is None:
        return None
    try:
        return Verdict.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None


def verdict_fingerprint(fp: dict[str, str]) -> dict[str, str]:
    """The part of a device fingerprint a verdict is valid for: not the CPU's thread count, which
    changes timings but not whether a kernel is right (a verdict holds for every process). The
    CPU's kind and ISA level stay: a kernel right on one code path says nothing of another."""
    return {k: v for k, v in fp.items() if k != "threads"}


def key_text(key: CallKey) -> str:
    """A call key as one line, the same in every process: op, device, dtype, features, shape, extra."""
    return (f"{Group.of(key).slug()}|{key.device}|{','.join(map(str, key.shape))}"
            f"|{','.join(sorted(key.extra)) or '-'}")


def key_parts(key: CallKey) -> dict[str, Any]:
    """A call key as plain data (JSON, picklable), from which ``key_from_parts`` rebuilds it."""
    return {"op": key.op, "device": key.device, "dtype": key.dtype, "features": key.features.model_dump(),
            "shape": list(key.shape), "extra": sorted(key.extra)}


def key_from_parts(registry: Registry, parts: Mapping[str, Any]) -> CallKey:
    """The key ``key_parts`` described; ValueError when this registry cannot express it."""
    spec = registry.spec(str(parts["op"]))
    try:
        features = spec.features(**dict(parts["features"]))
    except Exception as exc:
        raise ValueError(f"features {parts['features']!r} are not {spec.name}'s: {exc}") from None
    shape = tuple(int(v) for v in parts["shape"])
    if len(shape) != len(spec.axes):
        raise ValueError(f"shape {shape} does not have {spec.name}'s axes {spec.axes}")
    return CallKey(spec, str(parts["device"]), str(parts["dtype"]), features, shape, frozenset(parts.get("extra", ())))
