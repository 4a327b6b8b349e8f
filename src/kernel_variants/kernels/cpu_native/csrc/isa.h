// Whether this compiler builds the AVX2 / AVX-512 kernel files (isa_avx2.h, isa_avx512.h,
// isa_avx512bf16.h). Free of other includes: an ISA file includes it before anything else.
//
// Why a per-file `#pragma GCC target` rather than -mavx2 in extra_cflags:
// cpp_extension applies one flag set to every source, and the binding TU
// must stay baseline x86-64 so the module imports (and falls back to the
// portable kernel) on any CPU; -march=native would also tie the cached .so
// to the build host. ATen's Vectorized<> selects its implementation at
// compile time from CPU_CAPABILITY_* macros, so each ISA TU defines them and
// gets its own inline namespace (e.g. at::vec::AVX2): no ODR clash with the other
// builds. The binding picks a build with __builtin_cpu_supports at runtime.
// An ISA file must not define objects with dynamic initialisers: they would
// run, with AVX2 (AVX-512) code, at import time on CPUs that lack it.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KV_X86_BUILDS 1
#else
#define KV_X86_BUILDS 0
#endif
