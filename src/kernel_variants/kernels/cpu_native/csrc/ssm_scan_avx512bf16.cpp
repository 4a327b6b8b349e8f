// AVX-512 + AVX512-BF16 build, serving bf16 x only (kv_cpu::per_dtype_builds): y is narrowed
// with one vcvtneps2bf16 per 16 values. The state keeps the software round-to-nearest-even
// (denormals kept), so a bf16 pool holds what torch's rounding of the fp32 state gives.
// See isa.h for why this is a separate TU.
#include "isa_avx512bf16.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_SSM_AVX512_BF16 1
#define KV_SSM_ISA_NS avx512bf16
#include "ssm_scan_kernel.h"
#endif
