// The AVX2+FMA (+F16C) build's target and ATen CPU_CAPABILITY (see isa.h). An ISA file
// includes this first: the pragma and the macros must precede every other include.
#pragma once

#include "isa.h"

#if KV_X86_BUILDS
#pragma GCC target("avx,avx2,fma,f16c")
// GCC's target pragma does not define the ISA macros; sleef.h (pulled in by
// ATen's vec headers) needs them to declare its AVX2 entry points.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
