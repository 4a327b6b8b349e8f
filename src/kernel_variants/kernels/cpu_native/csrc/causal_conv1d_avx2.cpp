// AVX2+FMA build of the kernel in causal_conv1d_kernel.h. See isa.h for why
// this is a separate TU with a target pragma.
#include "isa_avx2.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_ISA_NS avx2
#include "causal_conv1d_kernel.h"
#endif
