"""Plugin manager factory and the registry facade that callers use instead of pluggy."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import pluggy

from kernel_variants._registry.hookspecs import PROJECT_NAME, HookSpecs
from kernel_variants._registry.keys import CallKey
from kernel_variants._registry.models import Variant
from kernel_variants._registry.spec import OpSpec
from kernel_variants._registry.versions import full_version, resolve_depends, source_version


def blocked_from_env() -> list[str]:
    raw = os.environ.get("KV_DISABLE_PLUGINS", "")
    return [name.strip() for name in raw.split(",") if name.strip()]


def strict_from_env() -> bool:
    return os.environ.get("KV_STRICT_PLUGINS", "").strip().lower() not in ("", "0", "false", "no", "off")


class PluginWarning(UserWarning):
    """A plugin could not be loaded or declared something invalid; the rest of the registry works."""


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager plus the plugins that failed to load, by name, with the reason."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.broken: dict[str, str] = {}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def make_plugin_manager(
    *,
    builtins: bool = True,
    entry_points: bool = True,
    blocked: Iterable[str] | None = None,
    extra_plugins: Sequence[tuple[str, object]] = (),
    strict: bool | None = None,
) -> pluggy.PluginManager:
    """A fresh plugin manager: the declared built-ins (``declared``), ``extra_plugins``, entry points.

    ``blocked`` defaults to ``KV_DISABLE_PLUGINS``; the built-in op plugins (which bring each
    op's reference) cannot be blocked. A plugin that cannot be imported or implements
    a hook that does not exist (a misspelled ``kv_register_variant``, say) is left out and listed
    in ``pm.broken`` with the reason; with ``strict`` (default: ``KV_STRICT_PLUGINS``) it raises.
    """
    from kernel_variants._registry.declared import declared

    plugins, essential = declared()  # handed over by kernel_variants/__init__: the registry names none

    strict = strict_from_env() if strict is None else strict
    pm = _PluginManager()
    pm.add_hookspecs(HookSpecs)
    for name in blocked_from_env() if blocked is None else blocked:
        if name not in essential:  # the built-in ops and their references are the oracle
            pm.set_blocked(name)

    def add(name: str, load) -> None:
        if pm.is_blocked(name) or pm.get_plugin(name) is not None:
            return
        try:
            pm.register(load(), name=name)
            pm.check_pending()
        except Exception as exc:
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)
            if strict:
                raise
            pm.broken[name] = _describe(exc)

    if builtins:
        for name, mod in plugins:
            add(name, lambda mod=mod: importlib.import_module(mod))
    for name, plugin in extra_plugins:
        add(name, lambda plugin=plugin: plugin)
    if entry_points:
        # pluggy's own loader stops at the first entry point that fails to import; this one
        # loads each on its own, so one broken package leaves the others working.
        for dist in importlib.metadata.distributions():
            for ep in dist.entry_points:
                if ep.group == PROJECT_NAME:
                    add(ep.name, ep.load)
    return pm


@dataclass(eq=False)
class RegisteredVariant:
    """A variant as the registry holds it: who registered it, its full version (declared
    version, source hash, dependencies' hash) and the dependency versions it was made of.

    Each tactic of a variant is registered beside it as a candidate of its own, ``id:tactic``
    (``tactic`` set, ``parent`` the variant's entry, ``variant.fn`` the tactic's function): it
    is verified, qualified, timed and chosen like any variant; it is available, and built,
    exactly when its variant is."""

    variant: Variant
    plugin: str
    version: str
    deps: dict[str, str] = field(default_factory=dict)
    source_version: str = ""  # see source_version()
    tactic: str | None = None
    parent: RegisteredVariant | None = field(default=None, repr=False)
    _reason: str | None = field(default=None, repr=False)
    _excluded: str | None = field(default=None, repr=False)  # Registry.exclude's reason
    _probed: bool = field(default=False, repr=False)
    _built: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @functools.cached_property  # read for every candidate of every decision; fixed once made
    def id(self) -> str:
        """The candidate's name: the variant id, or ``variant:tactic`` for a tactic."""
        return self.variant.id if self.tactic is None else f"{self.variant.id}:{self.tactic}"

    @property
    def tactics(self) -> tuple[str, ...]:
        """The variant's tactic names (a tactic's own entry has none)."""
        return tuple(self.variant.tactics)

    @property
    def op(self) -> str:
        return self.variant.op

    def why_not(self, key: CallKey) -> str | None:
        """Why this variant cannot run the call ``key`` (outside its capabilities, or unavailable
        here), or ``None`` when it can. Never builds."""
        return self.variant.capabilities.uncovered(key) or self.unavailable_reason()

    def unavailable_reason(self) -> str | None:
        """``None`` when this variant can run here, else why not. Probed once, then remembered;
        a build that failed makes it unavailable with the build's reason, and so does an
        exclusion (``Registry.exclude``) while it lasts. Never builds."""
        if self._excluded is not None:
            return self._excluded
        if self.parent is not None:
            return self.parent.unavailable_reason()
        with self._lock:
            if not self._probed:
                self._reason = _run_probe(self.variant)
                self._probed = True
            return self._reason

    def needs_build(self) -> bool:
        """Whether the first call would compile this variant first (``kv build`` does it ahead)."""
        built = self.variant.is_built  # (None on a tactic's entry: its variant's build covers it)
        if built is None or self.unavailable_reason() is not None:
            return False
        try:
            return not built()
        except Exception:  # a broken check is answered by the build itself
            return True

    def code_path(self) -> str | None:
        """Which of its code paths the variant runs here (its ``code_path``), "not built" while
        a build is pending; None when it declares none or cannot run here. Never builds."""
        if self.parent is not None:
            return self.parent.code_path()
        ask = self.variant.code_path
        if ask is None or self.unavailable_reason() is not None:
            return None
        if self.needs_build():
            return "not built"
        try:
            path = ask()
        except Exception as exc:  # third-party code: its failure is no reason to fail a listing
            return f"unknown ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"[:200]
        return path if isinstance(path, str) else f"unknown (code_path returned {type(path).__name__})"

    def ensure_built(self) -> str | None:
        """Build now if the variant needs it; ``None`` when it can run, else why not."""
        if self.parent is not None:
            return self.parent.ensure_built()
        reason = self.unavailable_reason()
        if reason is not None or self.variant.build is None:
            return reason
        with self._lock:
            if not self._built:
                try:
                    self.variant.build()
                except Exception as exc:  # a failed build means "cannot run here", with its log line
                    self._reason = f"build failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                self._built = True
            return self._reason


def _run_probe(variant: Variant) -> str | None:
    if variant.probe is None:
        return None
    try:
        reason = variant.probe()
    except Exception as exc:  # a probe is third-party code: its crash means "cannot run here"
        return f"availability probe raised {type(exc).__name__}: {exc}"
    if reason is not None and not isinstance(reason, str):
        return f"availability probe returned {type(reason).__name__}, expected str or None"
    return reason


class DuplicateVariantError(ValueError):
    pass


class UnknownTacticError(KeyError, ValueError):
    """``variant:tactic`` names a registered variant but none of its tactics."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Register:
    """Passed to the hooks; validates each op spec or variant and stages it for its plugin."""

    def __init__(self, plugin: str, accepts: type, stage: Callable[[object], None]) -> None:
        self._plugin = plugin
        self._accepts = accepts
        self._stage = stage

    def __call__(self, item: object) -> None:
        if not isinstance(item, self._accepts):
            raise TypeError(
                f"plugin {self._plugin!r}: register() expects a kernel_variants "
                f"{self._accepts.__name__}, got {type(item).__name__}"
            )
        self._stage(item)


class Registry:
    """Every registered op spec, by name, and every variant, keyed by (op, id).

    Ops are registered first (``kv_register_ops``), each bringing its reference variant; then
    variants (``kv_register_variants``), each for a registered op with capabilities of that op's
    model. A plugin whose hook raises or registers something invalid (a bad declaration, a
    duplicate id, an unknown op) contributes nothing: it is listed in :attr:`broken` with the
    reason and one :class:`PluginWarning` names it, unless ``strict`` (default:
    ``KV_STRICT_PLUGINS``), where the error propagates.
    """

    def __init__(self, pm: pluggy.PluginManager, *, strict: bool | None = None) -> None:
        strict = strict_from_env() if strict is None else strict
        self._pm = pm
        self._ops: dict[str, OpSpec] = {}
        self._op_plugin: dict[str, str] = {}
        self._by_key: dict[tuple[str, str], RegisteredVariant] = {}
        self.broken: dict[str, str] = dict(getattr(pm, "broken", {}))
        self._exclusion_lock = threading.Lock()
        for impl in pm.hook.kv_register_ops.get_hookimpls():
            ops: dict[str, OpSpec] = {}
            if self._run(impl, OpSpec, lambda spec, ops=ops, p=impl.plugin_name: self._stage_op(spec, p, ops), strict):
                for spec in ops.values():
                    self._ops[spec.name] = spec
                    self._op_plugin[spec.name] = impl.plugin_name
                    self._by_key[(spec.name, "reference")] = self._registered(spec.reference, impl.plugin_name)
        # Calling each implementation with its own Register is how a variant is attributed to the
        # plugin that provided it, so that a duplicate id can name both plugins.
        for impl in pm.hook.kv_register_variants.get_hookimpls():
            staged: dict[tuple[str, str], RegisteredVariant] = {}
            if self._run(impl, Variant, lambda v, st=staged, p=impl.plugin_name: self._stage_variant(v, p, st), strict):
                self._by_key.update(staged)  # all of a plugin's variants, or none of them
        if self.broken:
            warnings.warn(
                "kernel_variants: plugins left out: "
                + "; ".join(f"{name!r} ({why})" for name, why in self.broken.items())
                + " (KV_STRICT_PLUGINS=1 makes this an error)",
                PluginWarning, stacklevel=2,
            )

    def _run(self, impl, accepts: type, stage: Callable[[object], None], strict: bool) -> bool:
        try:
            impl.function(register=Register(impl.plugin_name, accepts, stage))
        except Exception as exc:
            if strict:
                raise
            self.broken[impl.plugin_name] = _describe(exc)
            return False
        return True

    def _stage_op(self, spec: OpSpec, plugin: str, staged: dict[str, OpSpec]) -> None:
        first = self._op_plugin.get(spec.name) or (plugin if spec.name in staged else None)
        if first is not None:
            raise DuplicateVariantError(
                f"op {spec.name!r} is registered twice: by plugin {first!r} and by plugin {plugin!r}")
        staged[spec.name] = spec

    def _stage_variant(self, variant: Variant, plugin: str, staged: dict[tuple[str, str], RegisteredVariant]) -> None:
        spec = self._ops.get(variant.op)
        if spec is None:
            raise ValueError(f"plugin {plugin!r}: variant {variant.id!r} is for op {variant.op!r}, which is not "
                             f"registered (registered: {', '.join(sorted(self._ops)) or 'none'})")
        if not isinstance(variant.capabilities, spec.capabilities):
            raise TypeError(f"plugin {plugin!r}: variant {variant.id!r} of {variant.op}: capabilities must be a "
                            f"{spec.capabilities.__module__}.{spec.capabilities.__name__}, "
                            f"got {type(variant.capabilities).__name__}")
        caps = variant.capabilities
        unknown = (set(caps.limits) | set(caps.multiple_of)) - set(spec.axes)
        if unknown:
            raise ValueError(f"plugin {plugin!r}: variant {variant.id!r} limits axes {sorted(unknown)}, "
                             f"but {variant.op}'s axes are {', '.join(spec.axes)}")
        key = (variant.op, variant.id)
        if key in self._by_key or key in staged:
            first = (self._by_key.get(key) or staged[key]).plugin
            raise DuplicateVariantError(
                f"variant id {variant.id!r} for op {variant.op!r} is registered twice: by plugin "
                f"{first!r} and by plugin {plugin!r}"
            )
        staged[key] = rv = self._registered(variant, plugin)
        for name, fn in variant.tactics.items():
            # The tactic's own function and source make its version; the build stays the variant's.
            tv = variant.model_copy(update={"fn": fn, "tactics": {}, "replaces": {}, "build": None, "is_built": None})
            staged[(variant.op, f"{variant.id}:{name}")] = RegisteredVariant(
                tv, plugin, full_version(tv, plugin, rv.deps), rv.deps, source_version(tv, plugin), name, rv)

    @staticmethod
    def _registered(variant: Variant, plugin: str) -> RegisteredVariant:
        deps = resolve_depends(variant, plugin)
        return RegisteredVariant(variant, plugin, full_version(variant, plugin, deps), deps,
                                 source_version(variant, plugin))

    def renames(self) -> dict[tuple[str, str], str]:
        """(op, retired variant id) -> the ``variant:tactic`` that replaces it (``Variant.replaces``)."""
        return {(rv.op, old): f"{rv.id}:{tactic}" for rv in self._by_key.values() if rv.tactic is None
                for old, tactic in rv.variant.replaces.items()}

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        return self._pm

    def ops(self) -> list[OpSpec]:
        """Every registered op spec, in registration order."""
        return list(self._ops.values())

    def op_plugin(self, name: str) -> str:
        """The plugin that registered op ``name``."""
        return self._op_plugin[name]

    def spec(self, name: str) -> OpSpec:
        """The op called ``name`` (or one of its aliases); ``ValueError`` listing the ops otherwise."""
        spec = self._ops.get(name) or next((s for s in self._ops.values() if name in s.aliases), None)
        if spec is None:
            raise ValueError(f"op must be one of {', '.join(self._ops) or '(none registered)'}, got {name!r}")
        return spec

    def variants(self, op: str | None = None) -> list[RegisteredVariant]:
        """Every candidate (of ``op``): each variant, followed by its tactics' entries."""
        if op is not None and op not in self._ops:
            raise ValueError(f"op must be one of {', '.join(self._ops)}, got {op!r}")
        return [rv for (o, _), rv in self._by_key.items() if op is None or o == op]

    def get(self, op: str, variant_id: str) -> RegisteredVariant:
        try:
            return self._by_key[(op, variant_id)]
        except KeyError:
            base, sep, tactic = variant_id.partition(":")
            parent = self._by_key.get((op, base)) if sep else None
            if parent is not None:
                raise UnknownTacticError(f"variant {base!r} of op {op!r} has no tactic {tactic!r} (its tactics: "
                                         f"{', '.join(parent.tactics) or 'none'})") from None
            renamed = self.renames().get((op, variant_id))
            if renamed is not None:
                raise KeyError(f"variant {variant_id!r} of op {op!r} is now the tactic {renamed!r}") from None
            known = ", ".join(sorted(i for (o, i) in self._by_key if o == op)) or "none"
            raise KeyError(
                f"no variant {variant_id!r} registered for op {op!r} (registered: {known})"
            ) from None

    def exclude(self, op: str, variant_id: str, reason: str) -> bool:
        """Take a variant (with its tactics) or one tactic out of routing, with ``reason``, until
        :meth:`include`: it is unavailable for that reason (never chosen, forced or not, built,
        qualified or timed). Decisions memoised before are the caller's to drop. False when out."""
        rv = self.get(op, variant_id)
        with self._exclusion_lock:
            if rv._excluded is not None:
                return False
            rv._excluded = reason
            return True

    def include(self, op: str, variant_id: str, reason: str | None = None) -> bool:
        """Lift an :meth:`exclude` (only the one made with ``reason``, when given); True if lifted."""
        rv = self.get(op, variant_id)
        with self._exclusion_lock:
            if rv._excluded is None or (reason is not None and rv._excluded != reason):
                return False
            rv._excluded = None
            return True

    def plugins(self) -> list[str]:
        return [name for name, _ in self._pm.list_name_plugin()]
