// The compute floor of cpu_native's causal_conv1d on one ISA build: per channel group the
// kernel's own load and conversion to fp32 (IO<T>), W=4 FMAs with the bias, its SiLU and its
// conversion and store (store_group), streamed once over a contiguous buffer with none of the
// convolution's logic (no halo, no window, no tiles, no taps from memory). Built per ISA like
// the kernel: the including file includes the ISA header first and defines KV_ISA_NS.
// Bench-only (tools/bench_cpu_roofline.py builds it); nothing in the package loads it.
#pragma once

#define KV_CCONV_PRIMITIVES_ONLY 1
#include "causal_conv1d_kernel.h"

namespace kv_cconv {
namespace KV_ISA_NS {
namespace {

template <typename T, bool SILU>
void floor_t(const void* xv, void* ov, int64_t n, const float* w /* [4][32] */,
             const float* b /* [VW] */) {
  const T* x = static_cast<const T*>(xv);
  T* out = static_cast<T*>(ov);
  fVec wr[4][2];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    wr[k][0] = fVec::loadu(w + k * 32);
    wr[k][1] = fVec::loadu(w + k * 32 + VF);
  }
  const fVec b0 = fVec::loadu(b), b1 = fVec::loadu(b + VF);
  // Four groups per iteration, like the kernel's blocks of four rows: independent chains.
#pragma GCC unroll 4
  for (int64_t i = 0; i + VW <= n; i += VW) {
    fVec xa, xb;
    load_group<T, true>(x + i, xa, xb, VW);
    // The kernel's chain: the newest row's tap fused with the bias, then the W-1 others (here
    // the same input: the floor has no window).
    fVec a0 = at::vec::fmadd(wr[3][0], xa, b0);
    fVec a1 = at::vec::fmadd(wr[3][1], xb, b1);
#pragma GCC unroll 4
    for (int k = 0; k < 3; ++k) {
      a0 = at::vec::fmadd(wr[k][0], xa, a0);
      a1 = at::vec::fmadd(wr[k][1], xb, a1);
    }
    store_group<T, SILU, true>(out + i, a0, a1, VW);
  }
}

}  // namespace

// dtype: 0 fp32, 1 bf16, 2 fp16 (the kernel's DType order); n: a multiple of VW (<= 32);
// w: [4][32] taps, b: [32] bias (the first VW lanes of each are used).
void floor_run(int dtype, bool silu, const void* x, void* out, int64_t n, const float* w,
               const float* b) {
  switch (dtype) {
#define KV_FLOOR_CASE(I, T)             \
  case I:                               \
    if (silu)                           \
      floor_t<T, true>(x, out, n, w, b);  \
    else                                \
      floor_t<T, false>(x, out, n, w, b); \
    break;
#if !defined(KV_BF16_ONLY)
    KV_FLOOR_CASE(0, float)
    KV_FLOOR_CASE(2, c10::Half)
#endif
    KV_FLOOR_CASE(1, c10::BFloat16)
#undef KV_FLOOR_CASE
    default:
      break;
  }
}

static_assert(VW <= 32, "the taps' rows hold 32 lanes");
int floor_lanes() { return VW; }

}  // namespace KV_ISA_NS
}  // namespace kv_cconv
