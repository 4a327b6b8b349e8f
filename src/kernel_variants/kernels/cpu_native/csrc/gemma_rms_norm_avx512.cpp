// AVX-512 (F/BW/VL/DQ, the set ATen's AVX512 kernels use) build of the
// kernel in gemma_rms_norm_kernel.h. See gemma_rms_norm_avx2.cpp for why
// this is a separate TU with a target pragma.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("avx,avx2,fma,f16c,prfchw,avx512f,avx512bw,avx512vl,avx512dq")
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
#define KV_GRMS_ISA_NS avx512
#include "gemma_rms_norm_kernel.h"
#endif
