"""The registry: variants and ops as plugins declare them (``models``, ``keys``, ``case``,
``spec``), each variant's full version (``versions``), the pluggy hooks (``hookspecs``) and the
registry that loads them (``registry``). Authors import from :mod:`kernel_variants.plugin`."""
