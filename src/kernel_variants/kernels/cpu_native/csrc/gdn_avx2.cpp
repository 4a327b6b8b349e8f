// AVX2+FMA build of the kernel in gdn_kernel.h (see isa.h for why each ISA is its own TU with a
// target pragma: the binding TU stays baseline x86-64 and the module imports anywhere).
#include "isa_avx2.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_GDN_ISA_NS avx2
#include "gdn_kernel.h"
#endif
