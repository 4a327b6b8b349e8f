// The AVX-512 + AVX512-BF16 build's target: the AVX-512 one plus avx512bf16, in its own
// inline namespace at::vec::AVX512BF16 (see isa_avx512.h). Included first, like it.
#pragma once

#define KV_ISA_AVX512BF16 1
#include "isa_avx512.h"
