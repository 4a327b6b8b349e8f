"""The registry: variants and ops as plugins declare them (``models``, ``spec``), the pluggy
hooks (``hookspecs``) and the registry that loads them (``registry``). Authors use
:mod:`kernel_variants.plugin`."""

from kernel_variants._registry.hookspecs import PROJECT_NAME, hookimpl
from kernel_variants._registry.models import Capabilities, Variant
from kernel_variants._registry.spec import CallKey, Case, Features, OpSpec, Sweep

__all__ = ["PROJECT_NAME", "CallKey", "Capabilities", "Case", "Features", "OpSpec", "Sweep", "Variant", "hookimpl"]
