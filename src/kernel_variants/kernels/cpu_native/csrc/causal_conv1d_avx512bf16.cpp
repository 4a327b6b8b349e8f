// AVX-512 + AVX512-BF16 build, bf16 data only (KV_BF16_ONLY): a single
// vcvtne2ps2bf16 replaces the ~15-instruction software round-to-nearest-even
// per 32 outputs, which matters because the bf16 kernel is compute-bound.
// See causal_conv1d_avx2.cpp for why this is a separate TU.
// Note: the instruction treats fp32 denormals as zero (bf16 outputs below
// ~1e-38 become 0), unlike the software path.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("avx,avx2,fma,f16c,prfchw,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
// See causal_conv1d_avx2.cpp: sleef.h keys its declarations on these.
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
#define KV_AVX512_BF16 1
#define KV_BF16_ONLY 1
#define KV_ISA_NS avx512bf16
#include "causal_conv1d_kernel.h"
#endif
