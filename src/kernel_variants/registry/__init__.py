"""Writing a variant plugin for kernel_variants.

A plugin is any object (usually a module) with a ``kv_register_variants`` hook implementation.
It calls ``register`` once per variant it provides::

    import torch
    from kernel_variants.registry import Capabilities, Variant, hookimpl

    def my_conv(x, weight, bias=None, *, conv_states=None, cache_indices=None,
                has_initial_state=None, query_start_loc=None, activation=None, pad_slot_id=-1):
        ...  # same arguments as kernel_variants.causal_conv1d_fn, already validated

    @hookimpl
    def kv_register_variants(register):
        register(Variant(
            id="my_conv", op="causal_conv1d_fn", version="1",
            capabilities=Capabilities(devices={"cpu"}, dtypes={"float32", "bfloat16"},
                                      width=(2, 4), varlen=True),
            fn=my_conv,
            probe=lambda: None,   # or a one-line reason why it cannot run here
        ))

Make it discoverable by declaring an entry point in the plugin package's ``pyproject.toml``::

    [project.entry-points.kernel_variants]
    my_plugin = "my_package.my_module"

Rules the registry enforces: ids are stable lowercase names; one id per op across all plugins
(a duplicate names both plugins); a hook implementation with a misspelled name is an error;
``KV_DISABLE_PLUGINS=name,...`` blocks plugins by name. The conformance suite tests every
registered variant against the reference, so a new variant is tested by registering it.
"""

from ._hookspecs import PROJECT_NAME, hookimpl
from ._models import Capabilities, Variant

__all__ = ["PROJECT_NAME", "Capabilities", "Variant", "hookimpl"]
