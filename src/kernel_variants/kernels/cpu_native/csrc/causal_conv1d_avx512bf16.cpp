// AVX-512 + AVX512-BF16 build, bf16 data only (KV_BF16_ONLY): a single
// vcvtne2ps2bf16 replaces the ~15-instruction software round-to-nearest-even
// per 32 outputs, which matters because the bf16 kernel is compute-bound.
// See isa.h for why this is a separate TU.
// Note: the instruction treats fp32 denormals as zero (bf16 outputs below
// ~1e-38 become 0), unlike the software path.
#include "isa_avx512bf16.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_AVX512_BF16 1
#define KV_BF16_ONLY 1
#define KV_ISA_NS avx512bf16
#include "causal_conv1d_kernel.h"
#endif
