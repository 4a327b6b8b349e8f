"""``patch()``: an engine's functions swapped for the adapters wherever the engine's loaded
modules bind them, and :class:`Patch`, the handle that undoes it."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

from kernel_variants._runtime import shadow as _shadow
from kernel_variants.integrations._common import (
    ADAPTER_MARK,
    IntegrationWarning,
    _ImportHook,
    _within,
)
from kernel_variants.integrations._shadow import shadowed

if TYPE_CHECKING:
    from kernel_variants._registry.registry import RegisteredVariant

#: The ops every engine adapter here routes to.
CONV_OPS = ("causal_conv1d_fn", "causal_conv1d_update")


@dataclass(frozen=True)
class _Swap:
    module: ModuleType
    name: str
    original: Any
    replacement: Any


@dataclass(frozen=True)
class _LeftOut:
    """A variant made unavailable for as long as the patch is active, with the reason set."""

    variant: RegisteredVariant
    reason: str


class Patch:
    """What ``patch()`` replaced, and the way back: ``.undo()``, or use it as a context manager.

    ``undo()`` restores each name only where it still holds the adapter ``patch()`` put there,
    so a later patch by someone else is left standing, and gives back to the routing each
    variant ``patch()`` left out (unless something else has marked it since); calling it twice
    is harmless.
    """

    def __init__(self, engine: str, swaps: list[_Swap], left_out: list[_LeftOut] | None = None,
                 hook: _ImportHook | None = None, shadow: float = 0.0) -> None:
        self.engine = engine
        #: The share of the engine's calls judged against its own functions (``patch(shadow=)``).
        self.shadow = shadow
        self._swaps = swaps
        self._left_out = left_out or []
        self._hook = hook
        self.active = True
        #: The engine's padding convention as patch() read it (vLLM: a Convention), or None.
        self.convention: object = None

    @property
    def replaced(self) -> tuple[str, ...]:
        """``"module.name"`` of every replaced binding, in the order they were replaced."""
        return tuple(f"{s.module.__name__}.{s.name}" for s in self._swaps)

    @property
    def left_out(self) -> tuple[str, ...]:
        """``"op:variant"`` of every variant left out of the routing while the patch is active."""
        return tuple(f"{e.variant.op}:{e.variant.id}" for e in self._left_out)

    def undo(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for s in reversed(self._swaps):
            if vars(s.module).get(s.name) is s.replacement:
                setattr(s.module, s.name, s.original)
        if self._left_out:
            for e in self._left_out:
                _give_back(e)
            self._left_out = []
            _forget_decisions()
        if self.shadow and self.active:
            _shadow.engine_shadowing(-1)
            _forget_decisions()  # decisions made while it shadowed hold the counting wrapper
        self.active = False

    def __enter__(self) -> Patch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<kernel_variants {self.engine} patch, {state}, {len(self._swaps)} bindings>"


def module_names(also: object) -> tuple[str, ...]:
    """``patch(also=...)`` as a tuple of module names (a bare string is refused: it would be
    read as its letters)."""
    if isinstance(also, str) or not isinstance(also, tuple | list | set | frozenset):
        raise TypeError(
            f"also: expected a tuple or list of module names, got {type(also).__name__} {also!r}"
        )
    names = tuple(also)
    for name in names:
        if not isinstance(name, str) or not name or name.strip(".") != name:
            raise ValueError(f"also: expected module names such as 'my_pkg.layers', got {name!r}")
    return names


def _forget_decisions() -> None:
    from kernel_variants._runtime.dispatcher import dispatcher

    dispatcher().invalidate()


def _leave_out(rv: RegisteredVariant, reason: str) -> _LeftOut | None:
    from kernel_variants._runtime.dispatcher import dispatcher

    if rv.unavailable_reason() is not None:  # probed, and already out for its own reason
        return None
    return _LeftOut(rv, reason) if dispatcher().registry.exclude(rv.op, rv.id, reason) else None


def _give_back(entry: _LeftOut) -> None:
    from kernel_variants._runtime.dispatcher import dispatcher

    dispatcher().registry.include(entry.variant.op, entry.variant.id, entry.reason)


def _unbuilt(ops: tuple[str, ...]) -> list[RegisteredVariant]:
    from kernel_variants._runtime.dispatcher import dispatcher

    registry = dispatcher().registry
    known = {spec.name for spec in registry.ops()}
    return [rv for op in ops if op in known for rv in registry.variants(op) if rv.needs_build()]


def _builds(engine: str, ops: tuple[str, ...], build: bool) -> list[_LeftOut]:
    """Make sure no dispatched call of ``ops`` compiles anything: build the variants that would
    (``build``), or leave them out of the routing with one warning. Returns what was left out."""
    pending = _unbuilt(ops)
    if not pending:
        return []
    names = ", ".join(sorted({f"{rv.id} ({rv.op})" for rv in pending}))
    if build:
        print(f"kernel_variants: {engine} patch(build=True): building {names} before the engine "
              "runs", file=sys.stderr, flush=True)
        for rv in pending:
            rv.ensure_built()  # a failed build leaves the variant out, with the compiler's reason
        _forget_decisions()
        return []
    reason = (f"not built on this machine; {engine} patch() leaves it out rather than compile "
              "inside the engine (run `kv build` ahead, or patch(build=True))")
    left = [e for e in (_leave_out(rv, reason) for rv in pending) if e is not None]
    if left:
        _forget_decisions()
        warnings.warn(
            f"kernel_variants: {engine} patch(): {names} not built on this machine, so left out "
            f"of the engine's routing instead of compiling inside its first call; run `kv build` "
            f"once after installing (or patch(build=True)) to include them",
            IntegrationWarning, stacklevel=3,
        )
    return left


def patch_engine(
    engine: str,
    sources: Mapping[str, Mapping[str, Callable[[Any], Any]]],
    *,
    prefixes: tuple[str, ...],
    also: tuple[str, ...] = (),
    keep: tuple[str, ...] = (),
    ops: tuple[str, ...] = CONV_OPS,
    build: bool = False,
    shadow: float = 0.0,
) -> Patch:
    """Replace an engine's functions wherever the engine's own loaded modules bind them.

    ``sources``: for each module that defines engine functions, function name -> factory that
    returns the adapter for the original found there. The originals are then replaced, by
    identity (so ``from x import f`` and ``g = f`` aliases are caught), in the loaded modules
    under ``prefixes`` (the engine's packages) and ``also`` (modules the caller names) only:
    never in ``__main__`` or any other module of the user's unless named, never in
    kernel_variants, and not under the ``keep`` prefixes (whose kernels kernel_variants' own
    variants call). Modules within reach that are imported while the patch is active are
    patched as soon as they have run (an import hook, removed by ``undo()``), and undo gives
    them the originals too. Nothing is imported, and nothing is compiled: variants of ``ops``
    that would compile on their first call are built now (``build``) or left out (one warning).
    ``shadow``: the share of each replaced function's calls also run by the function itself and
    judged (``integrations._shadow``).
    """
    if not isinstance(build, bool):
        raise TypeError(f"build: expected True or False, got {type(build).__name__} {build!r}")
    rate = _shadow.parse_rate(shadow, "shadow")
    if rate:
        from kernel_variants._runtime.dispatcher import dispatcher

        dispatcher()  # made now if not yet: its creation reads KV_SHADOW_SEED, which the streams use
    originals: dict[int, tuple[Any, Any]] = {}
    already = False

    def collect(module: ModuleType, factories: Mapping[str, Callable[[Any], Any]]) -> None:
        nonlocal already
        for fn_name, factory in factories.items():
            fn = vars(module).get(fn_name)
            if fn is None:
                continue
            if getattr(fn, ADAPTER_MARK, False):
                already = True
                continue
            if id(fn) not in originals:
                adapter = factory(fn)
                originals[id(fn)] = (fn, shadowed(adapter, fn, rate, _shadow.seed()) if rate else adapter)

    for module_name, factories in sources.items():
        module = sys.modules.get(module_name)
        if isinstance(module, ModuleType):
            collect(module, factories)
    if not originals:
        if already:
            raise RuntimeError(f"{engine} is already patched by kernel_variants; undo() it first")
        raise RuntimeError(
            f"none of {', '.join(sources)} is loaded; import {engine} (or let it start) before "
            f"calling patch(), which only looks at loaded modules"
        )
    left_out = _builds(engine, ops, build)
    reach = (*prefixes, *also)
    skip = ("kernel_variants", *keep)
    swaps: list[_Swap] = []

    def swap_in(module: ModuleType) -> None:
        for attr, value in list(vars(module).items()):
            hit = originals.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(module, attr, hit[1])
                swaps.append(_Swap(module, attr, value, hit[1]))

    for module_name, module in list(sys.modules.items()):
        if (isinstance(module, ModuleType) and _within(module_name, reach)
                and not _within(module_name, skip)):
            swap_in(module)

    def imported(module: ModuleType) -> None:
        factories = sources.get(module.__name__)
        if factories is not None:  # a defining module loaded late: its functions join in
            collect(module, factories)
        swap_in(module)
        # A module imported now may have taken an adapter from a patched module (``from ops
        # import causal_conv1d_fn``): recorded as if swapped, so undo() gives it the original.
        original_of: dict[int, Any] = {}
        for original, adapter in originals.values():
            known = original_of.setdefault(id(adapter), original)
            if known is not original:
                original_of[id(adapter)] = None  # one adapter for two originals: cannot tell
        for attr, value in list(vars(module).items()):
            original = original_of.get(id(value))
            if original is not None and not any(
                    s.module is module and s.name == attr for s in swaps):
                swaps.append(_Swap(module, attr, original, value))

    hook = _ImportHook(reach, skip, imported)
    hook.install()
    if rate:
        _shadow.engine_shadowing(+1)
        _forget_decisions()  # decisions from now on count who serves (the engine's mismatches name them)
    return Patch(engine, swaps, left_out, hook, rate)
