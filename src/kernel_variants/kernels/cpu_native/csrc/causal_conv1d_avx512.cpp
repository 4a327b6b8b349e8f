// AVX-512 (F/BW/VL/DQ, the set ATen's AVX512 kernels use) build of the
// kernel in causal_conv1d_kernel.h. See isa.h for why this is a separate TU
// with a target pragma. Twice the lanes of AVX2 matter
// here: with SiLU and bf16 conversion the kernel is compute-bound per core.
#include "isa_avx512.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_ISA_NS avx512
#include "causal_conv1d_kernel.h"
#endif
