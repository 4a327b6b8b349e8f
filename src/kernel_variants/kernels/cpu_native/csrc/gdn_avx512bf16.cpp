// AVX-512 + AVX512-BF16 build, serving bf16 v only (kv_cpu::per_dtype_builds): o is narrowed with
// one vcvtneps2bf16 per 16 values. The pool keeps the software round-to-nearest-even (denormals
// kept), so a bf16 pool holds what torch's rounding of the fp32 state gives. See isa.h for why
// this is a separate TU.
#include "isa_avx512bf16.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_GDN_AVX512_BF16 1
#define KV_GDN_ISA_NS avx512bf16
#include "gdn_kernel.h"
#endif
