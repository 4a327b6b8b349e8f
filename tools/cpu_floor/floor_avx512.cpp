// The avx512 build of the roofline floor (floor_kernel.h), like causal_conv1d_avx512.cpp.
#include "isa_avx512.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_ISA_NS floor_avx512
#include "floor_kernel.h"
#endif
