// AVX2+FMA build of the kernel in gemma_rms_norm_kernel.h. Same scheme as
// the causal_conv1d ISA files (see isa.h): a per-file `#pragma GCC target`
// rather than a global -mavx2, so the binding TU stays baseline x86-64 and
// the module imports on any CPU; ATen's Vectorized<> picks its
// implementation from the CPU_CAPABILITY_* macros defined in isa_avx2.h (own inline
// namespace at::vec::AVX2). No objects with dynamic initialisers here: they
// would run AVX2 code at import time on CPUs without it.
#include "isa_avx2.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_GRMS_ISA_NS avx2
#include "gemma_rms_norm_kernel.h"
#endif
