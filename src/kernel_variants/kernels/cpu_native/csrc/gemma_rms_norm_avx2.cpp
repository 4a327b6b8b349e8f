// AVX2+FMA build of the kernel in gemma_rms_norm_kernel.h. Same scheme as
// causal_conv1d_avx2.cpp (see there): a per-file `#pragma GCC target`
// rather than a global -mavx2, so the binding TU stays baseline x86-64 and
// the module imports on any CPU; ATen's Vectorized<> picks its
// implementation from the CPU_CAPABILITY_* macros defined here (own inline
// namespace at::vec::AVX2). No objects with dynamic initialisers here: they
// would run AVX2 code at import time on CPUs without it.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("avx,avx2,fma,f16c")
// GCC's target pragma does not define the ISA macros; sleef.h (pulled in by
// ATen's vec headers) needs them to declare its AVX2 entry points.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define KV_GRMS_ISA_NS avx2
#include "gemma_rms_norm_kernel.h"
#endif
