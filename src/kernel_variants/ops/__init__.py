"""The built-in ops, one package each: everything specific to an op family lives in its own
package, which registers an :class:`~kernel_variants.plugin.OpSpec` per public op."""
