// AVX-512 (F/BW/VL/DQ, the set ATen's AVX512 kernels use) build of the
// kernel in causal_conv1d_kernel.h. See causal_conv1d_avx2.cpp for why this
// is a separate TU with a target pragma. Twice the lanes of AVX2 matter
// here: with SiLU and bf16 conversion the kernel is compute-bound per core.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("avx,avx2,fma,f16c,prfchw,avx512f,avx512bw,avx512vl,avx512dq")
// See causal_conv1d_avx2.cpp: sleef.h keys its declarations on these.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define KV_ISA_NS avx512
#include "causal_conv1d_kernel.h"
#endif
