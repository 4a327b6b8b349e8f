// The avx512bf16 build of the roofline floor (floor_kernel.h), like causal_conv1d_avx512bf16.cpp.
#include "isa_avx512bf16.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_AVX512_BF16 1
#define KV_BF16_ONLY 1
#define KV_ISA_NS floor_avx512bf16
#include "floor_kernel.h"
#endif
