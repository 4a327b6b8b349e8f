"""The two hooks plugins implement, built-in or third-party: ops, then variants."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

PROJECT_NAME = "kernel_variants"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

if TYPE_CHECKING:
    from kernel_variants._registry.registry import Register


class HookSpecs:
    @hookspec
    def kv_register_ops(self, register: Register) -> None:
        """Call ``register(spec)`` once for each :class:`OpSpec` (a new op) this plugin provides.

        Called for every plugin before any ``kv_register_variants``, so variants may be for ops
        of any plugin. Each op's reference variant comes with its spec.
        """

    @hookspec
    def kv_register_variants(self, register: Register) -> None:
        """Call ``register(variant)`` once for each :class:`Variant` this plugin provides."""
