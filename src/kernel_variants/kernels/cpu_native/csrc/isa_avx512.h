// The AVX-512 builds' target and ATen CPU_CAPABILITY (see isa.h): F/BW/VL/DQ, the set ATen's
// AVX512 kernels use, plus AVX512-BF16 where the file includes isa_avx512bf16.h. An ISA file
// includes this first: the pragma and the macros must precede every other include.
#pragma once

#include "isa.h"

#if KV_X86_BUILDS
#if defined(KV_ISA_AVX512BF16)
#pragma GCC target("avx,avx2,fma,f16c,prfchw,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define CPU_CAPABILITY AVX512BF16  // distinct inline namespace at::vec::AVX512BF16
#else
#pragma GCC target("avx,avx2,fma,f16c,prfchw,avx512f,avx512bw,avx512vl,avx512dq")
#define CPU_CAPABILITY AVX512
#endif
// See isa_avx2.h: sleef.h keys its declarations on these.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define CPU_CAPABILITY_AVX512
#endif
