"""Gone: ``kernel_variants.dispatch`` was split; docs/changes.md maps each of its names."""

raise ImportError(
    "kernel_variants.dispatch is gone: callers use kernel_variants (explain, force, bind, calibrate, "
    "reload ...), plugin authors kernel_variants.plugin (make_op ...); docs/changes.md maps every old name"
)
