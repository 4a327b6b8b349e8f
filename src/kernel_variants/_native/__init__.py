"""The package's C++ extensions built and loaded: below every other part of kernel_variants, and
importing none of it, so that the runtime loads its call core and the kernels theirs without
either importing the other (the kernels' package registers variants through the plugin API,
which imports the runtime). Each extension names its own source folder (:class:`build.Extension`).
"""
