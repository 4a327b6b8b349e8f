// The avx2 build of the roofline floor (floor_kernel.h), like causal_conv1d_avx2.cpp.
#include "isa_avx2.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_ISA_NS floor_avx2
#include "floor_kernel.h"
#endif
