"""Gone: ``kernel_variants.registry`` is ``kernel_variants.plugin``."""

raise ImportError(
    "kernel_variants.registry is gone: use kernel_variants.plugin (Variant, Capabilities, OpSpec, Features, "
    "Case, Sweep, hookimpl, make_op, ConvCapabilities); docs/changes.md maps every old name"
)
