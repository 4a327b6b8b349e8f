// AVX-512 + AVX512-BF16 build, bf16 data only (KV_GRMS_BF16_ONLY): the
// normalised output is narrowed with one vcvtne2ps2bf16 per 32 values
// instead of the software round-to-nearest-even. (residual_sum keeps the
// software rounding: it must equal torch's x + residual bit for bit, and the
// instruction flushes fp32 denormals to zero.)
// See gemma_rms_norm_avx2.cpp for why this is a separate TU.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("avx,avx2,fma,f16c,prfchw,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define CPU_CAPABILITY AVX512BF16  // distinct inline namespace at::vec::AVX512BF16
#define CPU_CAPABILITY_AVX512
#define KV_GRMS_AVX512_BF16 1
#define KV_GRMS_BF16_ONLY 1
#define KV_GRMS_ISA_NS avx512bf16
#include "gemma_rms_norm_kernel.h"
#endif
