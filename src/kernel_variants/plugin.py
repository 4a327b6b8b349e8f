"""Writing a plugin for kernel_variants: new variants of an op, or a new op.

A plugin is any object (usually a module) with hook implementations. ``kv_register_variants``
calls ``register`` once per variant it provides::

    import torch
    from kernel_variants.plugin import ConvCapabilities, Variant, hookimpl

    def my_conv(x, weight, bias=None, *, conv_states=None, cache_indices=None,
                has_initial_state=None, query_start_loc=None, activation=None, pad_slot_id=-1):
        ...  # same arguments as kernel_variants.causal_conv1d_fn, already validated

    @hookimpl
    def kv_register_variants(register):
        register(Variant(
            id="my_conv", op="causal_conv1d_fn", version="1",
            capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32", "bfloat16"},
                                          width=(2, 4), varlen=True),
            fn=my_conv,
            probe=lambda: None,   # or a one-line reason why it cannot run here
        ))

The capabilities are an instance of the op's own model (``ConvCapabilities`` for the conv ops,
the base :class:`Capabilities` for ops with nothing beyond devices, dtypes and ``limits`` on
their shape axes).

A new op is an :class:`OpSpec` registered by ``kv_register_ops`` (called for every plugin
before any variants): the op's public function, written with its signature and docstring,
returns ``make_op(spec)``'s entry called with its arguments. ``examples/kv-my-conv`` in the repository does both, and the built-in
``kernel_variants.ops.gemma_rms_norm`` is a complete op in one package. The entry ``make_op``
returns is what the public function calls for the life of the process, never rebound; it reads
the compiled call core bound to it on each call, and where that core serves the call the variant
runs from C++ (same arguments, results and errors as the Python path).

Make a plugin discoverable by declaring an entry point in its package's ``pyproject.toml``::

    [project.entry-points.kernel_variants]
    my_plugin = "my_package.my_module"

Rules the registry enforces: ids are stable lowercase names; one id per op across all plugins
(a duplicate names both plugins); a variant's op must be registered; a hook implementation with
a misspelled name is an error. A plugin that breaks a rule, or fails to import, is left out
with one warning (``KV_STRICT_PLUGINS=1``: an error); ``KV_DISABLE_PLUGINS=name,...`` blocks
plugins by name. The conformance suite tests every registered variant against its op's
reference, so a new variant is tested by registering it.
"""

from kernel_variants._registry.case import Case, Sweep
from kernel_variants._registry.hookspecs import PROJECT_NAME, hookimpl
from kernel_variants._registry.keys import CallKey, Features
from kernel_variants._registry.models import Capabilities, Variant
from kernel_variants._registry.registry import DuplicateVariantError, RegisteredVariant
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.entry import make_op
from kernel_variants._runtime.values import Bounded, Offsets, SlotIds
from kernel_variants.ops.causal_conv1d import ConvCapabilities, ConvFeatures, bad_value_counter

__all__ = [
    "PROJECT_NAME",
    "Bounded",
    "CallKey",
    "Capabilities",
    "Case",
    "ConvCapabilities",
    "ConvFeatures",
    "DuplicateVariantError",
    "Features",
    "Offsets",
    "OpSpec",
    "RegisteredVariant",
    "SlotIds",
    "Sweep",
    "Variant",
    "bad_value_counter",
    "hookimpl",
    "make_op",
]
