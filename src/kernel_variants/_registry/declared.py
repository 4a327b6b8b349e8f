"""The built-in plugins the registry loads, as the package declares them.

The registry stands below every plugin, so it never names one: it loads the plugins it is given,
as it loads entry points. The package's namespace declares its built-ins
(``kernel_variants._builtins``) and hands them over here once, when ``kernel_variants/__init__``
runs: Python runs it before any module of the package, on every import path, so the declaration
is here before a plugin manager is made. Imports nothing (``import kernel_variants`` stays cheap).
"""

from __future__ import annotations

_DECLARED: tuple[tuple[tuple[str, str], ...], frozenset[str]] | None = None


def declare(plugins: tuple[tuple[str, str], ...], essential: tuple[str, ...]) -> None:
    """Declare the built-in plugins, ``(name, module)`` in load order, and those of them that
    ``KV_DISABLE_PLUGINS`` cannot block. Once per process: declaring the same again (the package
    re-imported) changes nothing, declaring others raises ``RuntimeError``."""
    global _DECLARED
    declaration = (tuple((name, module) for name, module in plugins), frozenset(essential))
    if _DECLARED not in (None, declaration):
        raise RuntimeError("the built-in plugins are declared once, by kernel_variants/__init__")
    _DECLARED = declaration


def declared() -> tuple[tuple[tuple[str, str], ...], frozenset[str]]:
    """The built-in plugins ``(name, module)`` in load order, and the names that cannot be blocked."""
    if _DECLARED is None:
        raise RuntimeError("no built-in plugins declared: kernel_variants/__init__ declares them "
                           "(from kernel_variants._builtins) when the package is imported")
    return _DECLARED
