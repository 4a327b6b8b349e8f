// AVX-512 (F/BW/VL/DQ, the set ATen's AVX512 kernels use) build of the
// kernel in gemma_rms_norm_kernel.h. See isa.h for why
// this is a separate TU with a target pragma.
#include "isa_avx512.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_GRMS_ISA_NS avx512
#include "gemma_rms_norm_kernel.h"
#endif
