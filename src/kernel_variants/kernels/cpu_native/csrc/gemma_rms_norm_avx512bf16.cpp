// AVX-512 + AVX512-BF16 build, bf16 data only (KV_GRMS_BF16_ONLY): the
// normalised output is narrowed with one vcvtne2ps2bf16 per 32 values
// instead of the software round-to-nearest-even. (residual_sum keeps the
// software rounding: it must equal torch's x + residual bit for bit, and the
// instruction flushes fp32 denormals to zero.)
// See isa.h for why this is a separate TU.
#include "isa_avx512bf16.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_GRMS_AVX512_BF16 1
#define KV_GRMS_BF16_ONLY 1
#define KV_GRMS_ISA_NS avx512bf16
#include "gemma_rms_norm_kernel.h"
#endif
