"""The one hook every plugin implements, built-in or third-party."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

PROJECT_NAME = "kernel_variants"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

if TYPE_CHECKING:
    from ._registry import Register


class VariantSpecs:
    @hookspec
    def kv_register_variants(self, register: Register) -> None:
        """Call ``register(variant)`` once for each :class:`Variant` this plugin provides."""
