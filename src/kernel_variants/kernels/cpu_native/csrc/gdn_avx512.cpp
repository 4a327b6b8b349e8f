// AVX-512 (F/BW/VL/DQ) build of the kernel in gdn_kernel.h: 16 fp32 lanes along V, column tiles
// of 4 vectors, masked loads and stores for 16-bit rows. See isa.h for why this is a separate TU.
#include "isa_avx512.h"  // first: its target pragma and ISA macros precede every other include
#if KV_X86_BUILDS
#define KV_GDN_ISA_NS avx512
#include "gdn_kernel.h"
#endif
