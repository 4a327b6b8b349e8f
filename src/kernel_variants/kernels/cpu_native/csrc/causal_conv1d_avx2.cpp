// AVX2+FMA build of the kernel in causal_conv1d_kernel.h.
//
// Why a per-file `#pragma GCC target` rather than -mavx2 in extra_cflags:
// cpp_extension applies one flag set to every source, and the binding TU
// must stay baseline x86-64 so the module imports (and falls back to the
// portable kernel) on any CPU; -march=native would also tie the cached .so
// to the build host. ATen's Vectorized<> selects its implementation at
// compile time from CPU_CAPABILITY_* macros, so this TU defines them and
// gets its own inline namespace (at::vec::AVX2): no ODR clash with the other
// builds. The binding picks a build with __builtin_cpu_supports at runtime.
// This file must not define objects with dynamic initialisers: they would
// run, with AVX2 code, at import time on CPUs that lack it.
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
#define KV_ISA_NS avx2
#include "causal_conv1d_kernel.h"
#endif
