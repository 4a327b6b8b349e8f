// Depthwise causal conv1d (+ optional SiLU) over channel-last data.
//
// This header is compiled once per ISA: the including TU defines KV_ISA_NS
// (and, for SIMD builds, CPU_CAPABILITY / CPU_CAPABILITY_<ISA> plus a
// matching `#pragma GCC target`, from isa_<isa>.h) before including it. ATen's Vectorized<>
// resolves to the ISA's implementation inside the inline namespace
// at::vec::CPU_CAPABILITY, so the copies never collide at link time.
//
// Work decomposition (fwd): item = (sequence, time chunk, channel tile).
// Inside an item, rows are walked in blocks of kTimeBlock; for each block
// every 2*VF-channel group runs the time loop with the W-1 previous input
// rows held in registers (fp32). Between blocks the window is parked in a
// small stack buffer. Short blocks over wide tiles keep the memory access
// close to a row-major stream (hardware prefetch friendly; measured 1.3-1.8x
// faster than long per-group time runs once data leaves L2) while still
// converting each input element to fp32 exactly once.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "causal_conv1d_params.h"

#ifndef KV_ISA_NS
#error "define KV_ISA_NS before including causal_conv1d_kernel.h"
#endif

// The hot helpers must inline: an out-of-line call forces the register
// window and taps through the stack (all vector registers are caller-saved).
#ifndef KV_INLINE
#if defined(__GNUC__)
#define KV_INLINE inline __attribute__((always_inline))
#else
#define KV_INLINE inline
#endif
#endif

namespace kv_cconv {
namespace KV_ISA_NS {

void fwd_range(const Params& p, int64_t begin, int64_t end);
void update_range(const Params& p, int64_t begin, int64_t end);

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int VF = static_cast<int>(fVec::size());
constexpr int VW = 2 * VF;  // channels per register group
#ifndef KV_TIME_BLOCK
#define KV_TIME_BLOCK 4
#endif
constexpr int64_t kTimeBlock = KV_TIME_BLOCK;
// The block path's first block runs on the window, so it must cover the W-1 <= 3 halo rows
// that may be history (fwd_item).
static_assert(kTimeBlock >= 3, "kTimeBlock must cover the largest halo (W=4)");
#ifndef KV_PF_ROWS
#define KV_PF_ROWS 8
#endif
// Rows are short strided runs per channel group, which the hardware stream
// prefetchers track poorly when a 4 KiB page holds more than one row (e.g.
// D=1024 bf16 ran ~1.6x slower than D=2048 from DRAM); prefetch explicitly
// this many rows ahead.
constexpr int64_t kPrefetchRows = KV_PF_ROWS;
static_assert(kTileC % VW == 0, "tile must hold whole channel groups");
static_assert(kTileAlign % VW == 0, "an equalised tile must start on a channel group");

// ---------------------------------------------------------------- SiLU
// The kernel is compute-bound per core (SiLU + dtype conversion), so SiLU is
// a short polynomial exp2 and an approximate reciprocal, with accuracy tiered
// by the output dtype (the result is rounded to it anyway):
//   fp32: degree-5 exp2 (rel. err 2e-7) + Newton-refined reciprocal,
//   fp16: degree-4 (3e-6), no refinement,
//   bf16: degree-2 (1.7e-3, under half a bf16 ulp; one FMA less per vector
//         than degree 3 in a loop bound by its FMA-port ops).
// (An exact divide alone has a 5-10 cycle throughput on a single port.)
template <typename T>
struct Prec;
template <>
struct Prec<float> {
  static constexpr int kDeg = 5;
  static constexpr bool kRefine = true;
};
template <>
struct Prec<c10::Half> {
  static constexpr int kDeg = 4;
  static constexpr bool kRefine = false;
};
template <>
struct Prec<c10::BFloat16> {
  static constexpr int kDeg = 2;
  static constexpr bool kRefine = false;
};

// Relative-minimax fits of 2^f: *Floor on f in [0, 1), *Round on [-.5, .5].
template <int DEG>
struct Exp2Poly;
template <>
struct Exp2Poly<2> {
  static constexpr float kFloor[3] = {1.001724720e+00f, 6.576362848e-01f,
                                      3.371894360e-01f};
  static constexpr float kRound[3] = {1.000443101e+00f, 7.034479976e-01f,
                                      2.384289652e-01f};
};
template <>
struct Exp2Poly<3> {
  static constexpr float kFloor[4] = {9.999236065e-01f, 6.958683035e-01f,
                                      2.259651005e-01f, 7.809657091e-02f};
  static constexpr float kRound[4] = {9.999275515e-01f, 6.932516123e-01f,
                                      2.426153772e-01f, 5.522261488e-02f};
};
template <>
struct Exp2Poly<4> {
  static constexpr float kFloor[5] = {1.000002640e+00f, 6.930021186e-01f,
                                      2.414521426e-01f, 5.199550912e-02f,
                                      1.354249423e-02f};
  static constexpr float kRound[5] = {9.999993049e-01f, 6.931217224e-01f,
                                      2.402459972e-01f, 5.591835610e-02f,
                                      9.575989504e-03f};
};
template <>
struct Exp2Poly<5> {
  static constexpr float kFloor[6] = {9.999999239e-01f, 6.931531379e-01f,
                                      2.401530556e-01f, 5.582798548e-02f,
                                      8.987348053e-03f, 1.878401422e-03f};
  static constexpr float kRound[6] = {1.000000072e+00f, 6.931469781e-01f,
                                      2.402211850e-01f, 5.550695258e-02f,
                                      9.675590711e-03f, 1.328230382e-03f};
};

constexpr float kNegLog2e = -1.44269504088896341f;
// The exponential's argument is clamped to x in [kClampLo, kClampHi]. Above, exp(-x) stays a
// normal float (no denormal assists) and 1 + exp(-x) rounds to 1: SiLU is x. Below, exp(-x)
// is made exactly +inf, so its reciprocal is exactly 0 and SiLU is x * 0: -0 for any finite x,
// NaN for -inf (the reference's -inf / inf), never x * exp(-87), which for |x| near fp32's
// largest is not small (-3e38 gave -4.9). kClampLo differs per build: the AVX2 exponent trick
// gives 2^128 = inf for n = round(-x log2e) = 128 (x in [-89.06, -88.37]; n = 129 would
// wrap into the sign bit), vscalefps gives inf for floor(-x log2e) >= 128 (x <= -88.73).
constexpr float kClampHi = 87.0f;
constexpr float kClampLo2 = -88.5f;    // AVX2: n = 128
constexpr float kClampLo512 = -89.5f;  // AVX-512: floor = 129
constexpr float kMagic = 12582912.f + 127.f;  // 1.5 * 2^23 + exponent bias
// The Newton step's d * rc is inf * 0 = NaN where d is inf: it takes d capped at fp32's largest
// (then rc = 0 gives the step 2, and SiLU x * 0 as above).
constexpr float kFltMax = 3.40282347e+38f;

#if defined(CPU_CAPABILITY_AVX512)
template <int DEG>
KV_INLINE __m512 exp2_poly512(__m512 f) {
  __m512 q = _mm512_set1_ps(Exp2Poly<DEG>::kFloor[DEG]);
#pragma GCC unroll 8
  for (int i = DEG - 1; i >= 0; --i)
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(Exp2Poly<DEG>::kFloor[i]));
  return q;
}
template <typename T>
KV_INLINE fVec silu(const fVec& xv) {
  using P = Prec<T>;
  const __m512 x = xv;
  // Without the Newton step no clamp is needed for correctness: exp(-x)
  // overflowing to inf gives rcp14 = 0 and y = -0; underflow gives y = x.
  __m512 xc = x;
  if constexpr (P::kRefine)
    xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kClampLo512)),
                       _mm512_set1_ps(kClampHi));
  // exp(-x) = 2^t = 2^floor(t) * 2^frac(t): vreduceps gives frac(t) and
  // vscalefps applies floor(t) in one instruction each.
  const __m512 t = _mm512_mul_ps(xc, _mm512_set1_ps(kNegLog2e));
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 e = _mm512_scalef_ps(exp2_poly512<P::kDeg>(f), t);
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.f));
  const __m512 rc = _mm512_rcp14_ps(d);
  if constexpr (P::kRefine) {
    const __m512 nr = _mm512_fnmadd_ps(_mm512_min_ps(d, _mm512_set1_ps(kFltMax)), rc,
                                       _mm512_set1_ps(2.f));
    return fVec(_mm512_mul_ps(_mm512_mul_ps(x, rc), nr));
  } else {
    return fVec(_mm512_mul_ps(x, rc));
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
template <typename T>
KV_INLINE fVec silu(const fVec& xv) {
  using P = Prec<T>;
  constexpr int DEG = P::kDeg;
  const __m256 x = xv;
  // x NaN: max returns kClampLo2 (its second operand), and x * rc below is NaN.
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kClampLo2)),
                                  _mm256_set1_ps(kClampHi));
  // Round-to-int by adding 1.5*2^23 (+127) to t = -x log2e, fused into the
  // multiply: the low mantissa bits of f then hold n+127, so f<<23 is the
  // float 2^n (2^128 = inf for n = 128), and r = t - n comes from one more FMA
  // (exact up to its one rounding, no rounded t in between).
  const __m256 nl2e = _mm256_set1_ps(kNegLog2e);
  const __m256 f = _mm256_fmadd_ps(xc, nl2e, _mm256_set1_ps(kMagic));
  const __m256 r = _mm256_fmsub_ps(xc, nl2e, _mm256_sub_ps(f, _mm256_set1_ps(kMagic)));
  __m256 q = _mm256_set1_ps(Exp2Poly<DEG>::kRound[DEG]);
#pragma GCC unroll 8
  for (int i = DEG - 1; i >= 0; --i)
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(Exp2Poly<DEG>::kRound[i]));
  const __m256 p2 =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(f), 23));
  const __m256 d = _mm256_fmadd_ps(q, p2, _mm256_set1_ps(1.f));
  // rcp_ps is only 12-bit accurate: refine for everything but bf16.
  const __m256 rc = _mm256_rcp_ps(d);
  if constexpr (DEG >= 4) {
    const __m256 nr = _mm256_fnmadd_ps(_mm256_min_ps(d, _mm256_set1_ps(kFltMax)), rc,
                                       _mm256_set1_ps(2.f));
    return fVec(_mm256_mul_ps(_mm256_mul_ps(x, rc), nr));
  } else {
    return fVec(_mm256_mul_ps(x, rc));
  }
}
#else
// Portable build: the same algorithm in ATen's generic vector ops (exact
// divide), which the compiler vectorises for the baseline ISA.
template <typename T>
KV_INLINE fVec silu(const fVec& x) {
  constexpr int DEG = 5;
  const fVec xc = at::vec::minimum(at::vec::maximum(x, fVec(kClampLo2)),
                                   fVec(kClampHi));
  const fVec t = xc * fVec(kNegLog2e);
  const fVec f = t + fVec(kMagic);
  const fVec r = t - (f - fVec(kMagic));
  fVec q(Exp2Poly<DEG>::kRound[DEG]);
  for (int i = DEG - 1; i >= 0; --i)
    q = at::vec::fmadd(q, r, fVec(Exp2Poly<DEG>::kRound[i]));
  using iVec = at::vec::Vectorized<int32_t>;
  const fVec p2 = at::vec::cast<float>(at::vec::cast<int32_t>(f) << iVec(23));
  return x / at::vec::fmadd(q, p2, fVec(1.f));
}
#endif

// ---------------------------------------------------------------- I/O
// Load/store 2*VF channels of T as two fp32 vectors (natural channel order);
// the `n` overloads handle the ragged last group (n < VW). The generic
// versions (AtenIO) use ATen's conversions; the SIMD builds use the cheapest direct
// instruction sequences (zero-extend+shift for bf16 loads, F16C for fp16,
// AVX512-BF16 vcvtne2ps2bf16 for bf16 stores where the build has it).
template <typename T>
struct AtenIO {  // bf16 / fp16, ATen conversions
  using V = at::vec::Vectorized<T>;
  static_assert(V::size() == VW, "16-bit vector must hold 2*VF lanes");
  static KV_INLINE void load(const T* p, fVec& a, fVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(V::loadu(p));
  }
  static KV_INLINE void load(const T* p, fVec& a, fVec& b, int n) {
    std::tie(a, b) = at::vec::convert_to_float<T>(V::loadu(p, n));
  }
  static KV_INLINE void store(T* p, const fVec& a, const fVec& b) {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
  static KV_INLINE void store(T* p, const fVec& a, const fVec& b, int n) {
    at::vec::convert_from_float<T>(a, b).store(p, n);
  }
};

template <typename T>
struct IO : AtenIO<T> {};

template <>
struct IO<float> {
  static KV_INLINE void load(const float* p, fVec& a, fVec& b) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + VF);
  }
  static KV_INLINE void load(const float* p, fVec& a, fVec& b, int n) {
    a = fVec::loadu(p, std::min(n, VF));
    b = n > VF ? fVec::loadu(p + VF, n - VF) : fVec(0.f);
  }
  static KV_INLINE void store(float* p, const fVec& a, const fVec& b) {
    a.store(p);
    b.store(p + VF);
  }
  static KV_INLINE void store(float* p, const fVec& a, const fVec& b, int n) {
    a.store(p, std::min(n, VF));
    if (n > VF) b.store(p + VF, n - VF);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
template <>
struct IO<c10::BFloat16> {
  using T = c10::BFloat16;
  static KV_INLINE __m512 widen(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static KV_INLINE void load(const T* p, fVec& a, fVec& b) {
    a = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
  static KV_INLINE void load(const T* p, fVec& a, fVec& b, int n) {
    const __m512i v = _mm512_maskz_loadu_epi16(
        static_cast<__mmask32>((uint64_t{1} << n) - 1), p);
    a = widen(_mm512_castsi512_si256(v));
    b = widen(_mm512_extracti64x4_epi64(v, 1));
  }
#if defined(KV_AVX512_BF16)
  static KV_INLINE __m512i narrow(const fVec& a, const fVec& b) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  }
#else
  static KV_INLINE __m512i narrow(const fVec& a, const fVec& b) {
    return at::vec::convert_from_float<T>(a, b);
  }
#endif
  static KV_INLINE void store(T* p, const fVec& a, const fVec& b) {
    _mm512_storeu_si512(p, narrow(a, b));
  }
  static KV_INLINE void store(T* p, const fVec& a, const fVec& b, int n) {
    _mm512_mask_storeu_epi16(p, static_cast<__mmask32>((uint64_t{1} << n) - 1),
                             narrow(a, b));
  }
};

template <>
struct IO<c10::Half> {
  using T = c10::Half;
  static KV_INLINE void load(const T* p, fVec& a, fVec& b) {
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
  static KV_INLINE void load(const T* p, fVec& a, fVec& b, int n) {
    const __m512i v = _mm512_maskz_loadu_epi16(
        static_cast<__mmask32>((uint64_t{1} << n) - 1), p);
    a = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
    b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
  }
  static KV_INLINE __m256i half(const fVec& v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static KV_INLINE void store(T* p, const fVec& a, const fVec& b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half(a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), half(b));
  }
  static KV_INLINE void store(T* p, const fVec& a, const fVec& b, int n) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(half(a)),
                                         half(b), 1);
    _mm512_mask_storeu_epi16(p, static_cast<__mmask32>((uint64_t{1} << n) - 1),
                             v);
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
// The full groups directly; the ragged last group (n < VW) through ATen's conversions.
template <>
struct IO<c10::BFloat16> : AtenIO<c10::BFloat16> {
  using T = c10::BFloat16;
  using AtenIO<T>::load;
  using AtenIO<T>::store;
  static KV_INLINE __m256 widen(const T* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        16));
  }
  static KV_INLINE void load(const T* p, fVec& a, fVec& b) {
    a = widen(p);
    b = widen(p + 8);
  }
  // fp32 -> bf16 rounded to nearest even, in integer adds: (v + 0x7fff + bit 16 of v) >> 16.
  // Overflow rounds to inf, inf stays inf. ATen's conversion also tests every lane for NaN
  // (an ordered compare and a blend, 20% of this SiLU loop's time on AVX2): a NaN whose bits
  // 16-22 are all set and whose low half is >= 0x8000 would carry into the sign (-0). No NaN
  // that reaches here has such a low half: data (x, states) is widened bf16 (low half 0), the
  // arithmetic's own NaN is 0xffc00000, and an input NaN keeps its payload; the taps, the
  // one fp32 input of another dtype, have their NaNs made canonical (load_taps, kCanonNaN).
  static KV_INLINE __m256i rne16(const fVec& v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  }
  static KV_INLINE void store(T* p, const fVec& a, const fVec& b) {
    // packus interleaves the 128-bit halves; the permute puts them back in channel order.
    const __m256i v = _mm256_permute4x64_epi64(_mm256_packus_epi32(rne16(a), rne16(b)), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
};

template <>
struct IO<c10::Half> : AtenIO<c10::Half> {
  using T = c10::Half;
  using AtenIO<T>::load;
  using AtenIO<T>::store;
  static KV_INLINE void load(const T* p, fVec& a, fVec& b) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  }
  static KV_INLINE void store(T* p, const fVec& a, const fVec& b) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8),
                     _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT));
  }
};
#endif

// A channel group of T: whole (FULL) or its first n < VW channels (the ragged last group).
template <typename T, bool FULL>
KV_INLINE void load_group(const T* p, fVec& a, fVec& b, int n) {
  if constexpr (FULL) {
    IO<T>::load(p, a, b);
  } else {
    IO<T>::load(p, a, b, n);
  }
}

// A group's outputs a, b: through SiLU if SILU (in place: a copy changes the
// register allocation of the callers' loops), then stored like load_group reads.
template <typename T, bool SILU, bool FULL>
KV_INLINE void store_group(T* p, fVec& a, fVec& b, int n) {
  if constexpr (SILU) {
    a = silu<T>(a);
    b = silu<T>(b);
  }
  if constexpr (FULL) {
    IO<T>::store(p, a, b);
  } else {
    IO<T>::store(p, a, b, n);
  }
}

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// Row of `n` channels (element stride `sd`) -> fp32 buffer.
template <typename T>
inline void row_to_f32(const T* src, int64_t sd, float* dst, int64_t n) {
  if (sd == 1) {
    int64_t c = 0;
    for (; c + VW <= n; c += VW) {
      fVec a, b;
      IO<T>::load(src + c, a, b);
      a.store(dst + c);
      b.store(dst + c + VF);
    }
    for (; c < n; ++c) dst[c] = to_f(src[c]);
  } else {
    for (int64_t c = 0; c < n; ++c) dst[c] = to_f(src[c * sd]);
  }
}

// fp32 buffer -> row of T (values are exact T values, so no rounding).
template <typename T>
inline void f32_to_row(const float* src, T* dst, int64_t sd, int64_t n) {
  if (sd == 1) {
    int64_t c = 0;
    for (; c + VW <= n; c += VW)
      IO<T>::store(dst + c, fVec::loadu(src + c), fVec::loadu(src + c + VF));
    for (; c < n; ++c) dst[c] = static_cast<T>(src[c]);
  } else {
    for (int64_t c = 0; c < n; ++c) dst[c * sd] = static_cast<T>(src[c]);
  }
}

template <typename T>
inline void copy_row(const T* src, int64_t ssd, T* dst, int64_t dsd,
                     int64_t n) {
  if (ssd == 1 && dsd == 1) {
    std::memmove(dst, src, static_cast<size_t>(n) * sizeof(T));
  } else {
    for (int64_t c = 0; c < n; ++c) dst[c * dsd] = src[c * ssd];
  }
}

// Taps -> fp32 [W][kTileC]. The contiguous [D, W] case has compile-time
// strides so the compiler vectorises the de-interleave; it runs once per
// tile a thread meets, which is most of the fixed cost of a decode step.
template <int W, typename WT>
inline void fill_taps(const WT* w, int64_t sd, int64_t sk, int64_t c0,
                      int64_t n, float* wt /* [W][kTileC] */) {
  if (sd == W && sk == 1) {
    const WT* wc = w + c0 * W;
    for (int64_t c = 0; c < n; ++c)
#pragma GCC unroll 8
      for (int k = 0; k < W; ++k) wt[k * kTileC + c] = to_f(wc[c * W + k]);
    return;
  }
  for (int k = 0; k < W; ++k)
    for (int64_t c = 0; c < n; ++c)
      wt[k * kTileC + c] = to_f(w[(c0 + c) * sd + k * sk]);
}

template <typename WT>
inline void fill_bias(const WT* b, int64_t sd, int64_t c0, int64_t n,
                      float* bt) {
  for (int64_t c = 0; c < n; ++c) bt[c] = to_f(b[(c0 + c) * sd]);
}

// Whether data of type T is stored by a conversion that needs NaN taps made canonical
// (IO<bf16>::rne16 on AVX2).
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
template <typename T>
constexpr bool kCanonNaN = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kCanonNaN = false;
#endif

// Every NaN among v[0, n) made the quiet NaN 0x7fc00000: its low 16 bits are 0.
inline void canonical_nans(float* v, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    if (v[c] != v[c]) v[c] = std::numeric_limits<float>::quiet_NaN();
}

// Transposed fp32 taps [W][kTileC] and bias [kTileC] for channels
// [c0, c0+n); the tail up to the next group boundary is zeroed so ragged
// groups compute on defined values. For data T whose stores need it (kCanonNaN), NaNs in
// taps of a dtype wider than bf16 are made canonical (bf16 taps widen with a low half of 0).
template <int W, typename T>
inline void load_taps(const Params& p, int64_t c0, int64_t n, float* wt,
                      float* bt) {
  const int64_t npad = std::min<int64_t>(kTileC, (n + VW - 1) / VW * VW);
  switch (p.wdtype) {
    case DType::F32:
      fill_taps<W>(static_cast<const float*>(p.weight), p.w_sd, p.w_sk, c0, n,
                   wt);
      break;
    case DType::BF16:
      fill_taps<W>(static_cast<const c10::BFloat16*>(p.weight), p.w_sd, p.w_sk,
                   c0, n, wt);
      break;
    case DType::F16:
      fill_taps<W>(static_cast<const c10::Half*>(p.weight), p.w_sd, p.w_sk, c0,
                   n, wt);
      break;
  }
  if constexpr (kCanonNaN<T>) {
    if (p.wdtype != DType::BF16)
      for (int k = 0; k < W; ++k) canonical_nans(wt + k * kTileC, n);
  }
  for (int k = 0; k < W; ++k)
    for (int64_t c = n; c < npad; ++c) wt[k * kTileC + c] = 0.f;
  if (p.bias == nullptr) {
    for (int64_t c = 0; c < npad; ++c) bt[c] = 0.f;
    return;
  }
  switch (p.bdtype) {
    case DType::F32:
      fill_bias(static_cast<const float*>(p.bias), p.b_sd, c0, n, bt);
      break;
    case DType::BF16:
      fill_bias(static_cast<const c10::BFloat16*>(p.bias), p.b_sd, c0, n, bt);
      break;
    case DType::F16:
      fill_bias(static_cast<const c10::Half*>(p.bias), p.b_sd, c0, n, bt);
      break;
  }
  if constexpr (kCanonNaN<T>) {
    if (p.bdtype != DType::BF16) canonical_nans(bt, n);
  }
  for (int64_t c = n; c < npad; ++c) bt[c] = 0.f;
}

// ---------------------------------------------------------------- core
// Runs rows [0, nrows) of one channel group. `win` holds the W-1 previous
// input rows (fp32, stride kTileC) and is updated to the last W-1 rows.
template <typename T, int W, bool SILU, bool FULL>
KV_INLINE void run_group(const T* xp, int64_t x_rs, T* op, int64_t o_rs,
                      int64_t nrows, const float* wt, const float* bt,
                      float* win, int n) {
  constexpr int H = W - 1;
  fVec w[W][2], h[H][2];
#pragma GCC unroll 8
  for (int k = 0; k < W; ++k) {
    w[k][0] = fVec::loadu(wt + k * kTileC);
    w[k][1] = fVec::loadu(wt + k * kTileC + VF);
  }
  const fVec b0 = fVec::loadu(bt), b1 = fVec::loadu(bt + VF);
#pragma GCC unroll 8
  for (int j = 0; j < H; ++j) {
    h[j][0] = fVec::loadu(win + j * kTileC);
    h[j][1] = fVec::loadu(win + j * kTileC + VF);
  }
  for (int64_t t = 0; t < nrows; ++t, xp += x_rs, op += o_rs) {
    if constexpr (FULL && kPrefetchRows > 0) {
      // Prefetching is harmless past the end of x / out (never faults).
      constexpr int kLines = (VW * sizeof(T) + 63) / 64;
#pragma GCC unroll 4
      for (int l = 0; l < kLines; ++l) {
        __builtin_prefetch(reinterpret_cast<const char*>(xp + kPrefetchRows * x_rs) + 64 * l, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char*>(op + kPrefetchRows * o_rs) + 64 * l, 1, 3);
      }
    }
    fVec xa, xb;
    load_group<T, FULL>(xp, xa, xb, n);
    fVec a0 = at::vec::fmadd(w[H][0], xa, b0);
    fVec a1 = at::vec::fmadd(w[H][1], xb, b1);
#pragma GCC unroll 8
    for (int k = 0; k < H; ++k) {
      a0 = at::vec::fmadd(w[k][0], h[k][0], a0);
      a1 = at::vec::fmadd(w[k][1], h[k][1], a1);
    }
#pragma GCC unroll 8
    for (int k = 0; k + 1 < H; ++k) {
      h[k][0] = h[k + 1][0];
      h[k][1] = h[k + 1][1];
    }
    h[H - 1][0] = xa;
    h[H - 1][1] = xb;
    store_group<T, SILU, FULL>(op, a0, a1, n);
  }
#pragma GCC unroll 8
  for (int j = 0; j < H; ++j) {
    h[j][0].store(win + j * kTileC);
    h[j][1].store(win + j * kTileC + VF);
  }
}

// Rows [0, nrows) for all groups of a tile of `nc` channels, in time
// blocks so each block's rows are swept left to right.
template <typename T, int W, bool SILU>
inline void run_tile(const T* x, int64_t x_rs, T* out, int64_t o_rs,
                     int64_t nrows, int64_t nc, const float* wt,
                     const float* bt, float* win) {
  for (int64_t tb = 0; tb < nrows; tb += kTimeBlock) {
    const int64_t nb = std::min(kTimeBlock, nrows - tb);
    const T* xb = x + tb * x_rs;
    T* ob = out + tb * o_rs;
    int64_t c = 0;
    for (; c + VW <= nc; c += VW)
      run_group<T, W, SILU, true>(xb + c, x_rs, ob + c, o_rs, nb, wt + c,
                                  bt + c, win + c, VW);
    if (c < nc)
      run_group<T, W, SILU, false>(xb + c, x_rs, ob + c, o_rs, nb, wt + c,
                                   bt + c, win + c, static_cast<int>(nc - c));
  }
}

// ------------------------------------------------- alias-safe block path
// With power-of-two row strides every row of x and of out falls on the same
// 4 KiB page offsets, and a load whose address matches an in-flight store's
// in bits 11:0 stalls on the store ("4K aliasing"; measured 3-4x slower for
// D=4096 fp32 when out sits at x's page offset). This path keeps every load
// out of the way of the stores still in the store buffer:
//  * a block of kTimeBlock rows x one channel group loads ALL its inputs
//    (the W-1 halo rows are re-read from x) before storing any output;
//  * groups are walked in the direction that moves the loads away from the
//    block's earlier stores, chosen from (out - x) mod 4 KiB;
//  * the taps and bias are laid out so that a group's tap vectors sit at
//    x's page offsets of that same group (one array per tap and vector half,
//    each advancing sizeof(T)*VF bytes per half-group, like x), placed in a
//    stack buffer at x's offset modulo 4 KiB.
// It needs x intact behind the block (not in place) and whole groups, and
// is only chosen for cache-sized calls (Params::block_path): its narrow
// sub-tiles stream worse from DRAM than the row-wise window path, which
// prefetches, and a large call is bound by DRAM, not by aliasing.
constexpr int64_t kPage = 4096;
constexpr int64_t kBandRows = 16;  // 8..32 measured; 16 and 32 best
// Float offset of tap k, half h, group g in the split tap buffer.
// Arrays (and, for 16-bit data, halves) sit one cache line apart modulo
// 4 KiB, so the W+1 tap rows don't compete for one L1 set.
constexpr int64_t kTapStride = kTileC + 32;
template <typename T>
constexpr int64_t kTapHalf = sizeof(T) == 4 ? VF : kTileC / 2 + 16;
template <typename T>
constexpr int64_t kTapGroup = sizeof(T) == 4 ? VW : VF;
template <int W>
constexpr int64_t kSplitTapFloats = (W + 1) * kTapStride + kPage / sizeof(float);

template <typename T, int W>
inline void split_taps(const float* wt, const float* bt, int64_t nc,
                       float* dst) {
  for (int k = 0; k <= W; ++k) {
    const float* src = k < W ? wt + k * kTileC : bt;
    float* d = dst + k * kTapStride;
    for (int64_t g = 0; g * VW < nc; ++g)
      for (int h = 0; h < 2; ++h)
        std::memcpy(d + h * kTapHalf<T> + g * kTapGroup<T>,
                    src + g * VW + h * VF, VF * sizeof(float));
  }
}

template <typename T, int W, bool SILU, int TB>
KV_INLINE void block_group(const T* xp, int64_t x_rs, T* op, int64_t o_rs,
                           const float* tp) {
  constexpr int H = W - 1;
  fVec v[H + TB][2];
#pragma GCC unroll 16
  for (int j = 0; j < H + TB; ++j)
    IO<T>::load(xp + (j - H) * x_rs, v[j][0], v[j][1]);
  fVec w[W + 1][2];
#pragma GCC unroll 8
  for (int k = 0; k <= W; ++k) {
    w[k][0] = fVec::loadu(tp + k * kTapStride);
    w[k][1] = fVec::loadu(tp + k * kTapStride + kTapHalf<T>);
  }
  fVec a[TB][2];
#pragma GCC unroll 16
  for (int j = 0; j < TB; ++j) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      fVec s = at::vec::fmadd(w[H][h], v[j + H][h], w[W][h]);
#pragma GCC unroll 8
      for (int k = 0; k < H; ++k) s = at::vec::fmadd(w[k][h], v[j + k][h], s);
      if constexpr (SILU) s = silu<T>(s);
      a[j][h] = s;
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < TB; ++j) IO<T>::store(op + j * o_rs, a[j][0], a[j][1]);
}

template <typename T, int W, bool SILU, int TB>
KV_INLINE void block_row(const T* x, int64_t x_rs, T* out, int64_t o_rs,
                         int64_t ng, bool down, const float* tp) {
  if (down) {
    for (int64_t g = ng - 1; g >= 0; --g)
      block_group<T, W, SILU, TB>(x + g * VW, x_rs, out + g * VW, o_rs,
                                  tp + g * kTapGroup<T>);
  } else {
    for (int64_t g = 0; g < ng; ++g)
      block_group<T, W, SILU, TB>(x + g * VW, x_rs, out + g * VW, o_rs,
                                  tp + g * kTapGroup<T>);
  }
}

// Rows [0, nrows) of a tile of nc (multiple of VW) channels; rows -H..-1
// must be valid rows of x. The tile is swept in sub-tiles of kSubBytes per
// row over all rows, so the halo rows a block re-reads and the sub-tile's
// taps stay in L1; with out at x's page offset, a load of row t+1 also comes
// a whole sub-tile row of stores after the store of row t at the same page
// offset, by when that store has mostly left the store buffer.
constexpr int64_t kSubBytes = 1024;  // 512..8192 measured; 1024 best
template <typename T, int W, bool SILU>
inline void run_tile_blocks(const T* x, int64_t x_rs, T* out, int64_t o_rs,
                            int64_t nrows, int64_t nc, const float* tp) {
  constexpr int64_t kSubG = std::max<int64_t>(1, kSubBytes / int64_t(sizeof(T) * VW));
  const int64_t ng = nc / VW;
  const uintptr_t d = (reinterpret_cast<uintptr_t>(out) -
                       reinterpret_cast<uintptr_t>(x)) % kPage;
  const bool down = d != 0 && d <= kPage / 2;
  const int64_t nsub = (ng + kSubG - 1) / kSubG;
  // Bands of rows keep the sweep close to a row-major stream (what the
  // hardware prefetchers follow once x leaves the caches).
  for (int64_t r0 = 0; r0 < nrows; r0 += kBandRows) {
    const int64_t r1 = std::min(nrows, r0 + kBandRows);
    for (int64_t si = 0; si < nsub; ++si) {
      const int64_t sub = down ? nsub - 1 - si : si;
      const int64_t g0 = sub * kSubG, sg = std::min(kSubG, ng - g0);
      const T* xs = x + g0 * VW;
      T* os = out + g0 * VW;
      const float* ts = tp + g0 * kTapGroup<T>;
      int64_t t = r0;
      for (; t + kTimeBlock <= r1; t += kTimeBlock)
        block_row<T, W, SILU, kTimeBlock>(xs + t * x_rs, x_rs, os + t * o_rs,
                                          o_rs, sg, down, ts);
      for (; t < r1; ++t)
        block_row<T, W, SILU, 1>(xs + t * x_rs, x_rs, os + t * o_rs, o_rs,
                                 sg, down, ts);
    }
  }
}

template <typename T>
inline void zero_rows(T* out, int64_t o_rs, int64_t t0, int64_t t1,
                      int64_t c0, int64_t nc) {
  for (int64_t t = t0; t < t1; ++t)
    std::memset(out + t * o_rs + c0, 0, static_cast<size_t>(nc) * sizeof(T));
}

// Split-tap buffer of a thread: where its taps sit and for which tile.
struct SplitTaps {
  float* buf;         // kSplitTapFloats<W> floats
  float* base = nullptr;
  int64_t tile = -1;
};

// wt / bt: this tile's taps and bias, converted by the caller (kept across
// its items of the same tile).

template <typename T, int W, bool SILU>
void fwd_item(const Params& p, const Seq& sq, int64_t chunk, int64_t tile,
              const float* wt, const float* bt, SplitTaps& sp) {
  constexpr int H = W - 1;
  const int64_t c0 = tile * p.tile_c;
  const int64_t nc = std::min(p.dim, c0 + p.tile_c) - c0;
  const int64_t L = sq.len;
  const int64_t t0 = chunk * p.chunk_t;
  const int64_t t1 = std::min(L, t0 + p.chunk_t);
  T* out = static_cast<T*>(p.out) + sq.out_off;
  if (sq.pad) {
    zero_rows(out, p.out_rs, t0, t1, c0, nc);
    return;
  }
  const T* x = static_cast<const T*>(p.x) + sq.x_off;
  T* st = (p.state != nullptr && sq.slot >= 0)
              ? static_cast<T*>(p.state) + sq.slot * p.st_sn + c0 * p.st_sd
              : nullptr;

  alignas(64) float win[H * kTileC];

  // Halo: the H input rows before t0, from x or (first chunk) the history.
  for (int j = 0; j < H; ++j) {
    const int64_t i = t0 - H + j;
    float* wr = win + j * kTileC;
    if (i >= 0) {
      row_to_f32(x + i * p.x_rs + c0, 1, wr, nc);
    } else if (st != nullptr && sq.init) {
      row_to_f32(st + (p.st_rows + i) * p.st_ss, p.st_sd, wr, nc);
    } else {
      std::fill(wr, wr + nc, 0.f);
    }
    std::fill(wr + nc, wr + kTileC, 0.f);
  }

  // The first rows run on the window (their halo may be history); the rest
  // on the alias-safe blocks when x stays intact and the groups are whole.
  const bool blocks = p.block_path && nc % VW == 0 && t1 - t0 > kTimeBlock;
  const int64_t head = blocks ? std::min<int64_t>(t1 - t0, kTimeBlock) : t1 - t0;
  run_tile<T, W, SILU>(x + t0 * p.x_rs + c0, p.x_rs, out + t0 * p.out_rs + c0,
                       p.out_rs, head, nc, wt, bt, win);
  if (blocks) {
    const T* xr = x + (t0 + head) * p.x_rs + c0;
    // A sub-tile's x rows cover page offsets [0, S) from xr, its out rows
    // [d, d + S): put the taps in the gap, clear of both (L1 sets and
    // in-flight stores).
    T* orow = out + (t0 + head) * p.out_rs + c0;
    const uintptr_t d = (reinterpret_cast<uintptr_t>(orow) -
                         reinterpret_cast<uintptr_t>(xr)) % kPage;
    const uintptr_t shift = d >= kPage / 2 ? kSubBytes : d + kSubBytes;
    const uintptr_t want = (reinterpret_cast<uintptr_t>(xr) + shift) % kPage;
    const uintptr_t have = reinterpret_cast<uintptr_t>(sp.base) % kPage;
    if (sp.tile != tile || sp.base == nullptr || have / 4 != want / 4) {
      const uintptr_t b = reinterpret_cast<uintptr_t>(sp.buf);
      sp.base = sp.buf + ((want - b % kPage + kPage) % kPage) / sizeof(float);
      split_taps<T, W>(wt, bt, nc, sp.base);
      sp.tile = tile;
    }
    run_tile_blocks<T, W, SILU>(xr, p.x_rs, out + (t0 + head) * p.out_rs + c0,
                                p.out_rs, t1 - t0 - head, nc, sp.base);
  }

  // Only the first chunk reads the history, so it alone writes the new
  // state, after its reads. If it is also the last chunk, the window now
  // holds exactly the final H rows of history ++ x (this covers L < H).
  if (chunk == 0 && st != nullptr) {
    for (int j = 0; j < H; ++j) {
      T* dst = st + (p.st_rows - H + j) * p.st_ss;
      if (t1 == L && !blocks) {
        f32_to_row(win + j * kTileC, dst, p.st_sd, nc);
      } else {
        copy_row(x + (L - H + j) * p.x_rs + c0, 1, dst, p.st_sd, nc);
      }
    }
  }
}

// Raw copy of one channel group (no conversion). Inline vector moves for
// full groups: a libc call per group and row broke up the decode loop.
template <typename T, bool FULL>
KV_INLINE void copy_group(const T* src, T* dst, int n) {
  if constexpr (FULL) {
    if constexpr (std::is_same_v<T, float>) {
      fVec::loadu(src).store(dst);
      fVec::loadu(src + VF).store(dst + VF);
    } else {
      at::vec::Vectorized<T>::loadu(src).store(dst);
    }
  } else {
    std::memmove(dst, src, static_cast<size_t>(n) * sizeof(T));
  }
}

// Single-token decode with a channel-contiguous slot (the common case):
// history rows are read straight from the state and each group's slot rows
// are shifted right after its outputs, skipping the fp32 window buffer and
// the per-row tile passes of the general path. With L == 1 the shift is
// always one row (num_accepted_tokens, if given, must be 1).
template <typename T, int W, bool SILU, bool FULL>
KV_INLINE void decode_group(const T* x, T* out, T* st, int64_t st_ss,
                            int64_t S, int64_t hist_row, const float* wt,
                            const float* bt, int n) {
  constexpr int H = W - 1;
  fVec a0 = fVec::loadu(bt), a1 = fVec::loadu(bt + VF);
#pragma GCC unroll 8
  for (int k = 0; k < W; ++k) {
    const T* src = k < H ? st + (hist_row + k) * st_ss : x;
    fVec v0, v1;
    load_group<T, FULL>(src, v0, v1, n);
    a0 = at::vec::fmadd(fVec::loadu(wt + k * kTileC), v0, a0);
    a1 = at::vec::fmadd(fVec::loadu(wt + k * kTileC + VF), v1, a1);
  }
  // The slot shift (which copies x) comes before the output store: `out` may be `x` itself
  // (in-place update), and the history it overwrites is already in registers.
  for (int64_t r = 0; r + 1 < S; ++r)
    copy_group<T, FULL>(st + (r + 1) * st_ss, st + r * st_ss, n);
  copy_group<T, FULL>(x, st + (S - 1) * st_ss, n);
  store_group<T, SILU, FULL>(out, a0, a1, n);
}

template <typename T, int W, bool SILU>
void decode_row(const Params& p, const Seq& sq, int64_t c0, int64_t nc,
                const float* wt, const float* bt) {
  const T* x = static_cast<const T*>(p.x) + sq.x_off + c0;
  T* out = static_cast<T*>(p.out) + sq.out_off + c0;
  T* st = static_cast<T*>(p.state) + sq.slot * p.st_sn + c0;
  int64_t c = 0;
  for (; c + VW <= nc; c += VW)
    decode_group<T, W, SILU, true>(x + c, out + c, st + c, p.st_ss, p.st_rows,
                                   sq.hist_row, wt + c, bt + c, VW);
  if (c < nc)
    decode_group<T, W, SILU, false>(x + c, out + c, st + c, p.st_ss,
                                    p.st_rows, sq.hist_row, wt + c, bt + c,
                                    static_cast<int>(nc - c));
}

template <typename T, int W, bool SILU>
void fwd_range_t(const Params& p, int64_t begin, int64_t end) {
  // Each tile's taps are converted once per range: a tile-major range mostly stays in one
  // tile (one set on the stack, converted again when the tile changes); a chunk-major range
  // visits every tile in turn and keeps each tile's set, converted at its first item.
  const Seq* seqs = p.seqs;
  const int64_t per_tile = p.items_per_tile;
  constexpr int64_t kTapSet = (W + 1) * kTileC;  // [W][kTileC] taps, then [kTileC] bias
  alignas(64) float one[kTapSet];
  std::vector<float> kept;
  std::vector<uint8_t> converted;
  if (p.chunk_major) {
    kept.resize(static_cast<size_t>(p.n_tiles * kTapSet));
    converted.assign(static_cast<size_t>(p.n_tiles), 0);
  }
  int64_t taps_tile = -1;
  int64_t s = -1;
  alignas(64) float split_buf[kSplitTapFloats<W>];
  SplitTaps sp{split_buf};
  for (int64_t it = begin; it < end; ++it) {
    const int64_t tile = p.chunk_major ? it % p.n_tiles : it / per_tile;
    const int64_t r = p.chunk_major ? it / p.n_tiles : it % per_tile;
    if (s < 0 || r < seqs[s].item0) {
      // Last sequence whose first item is <= r.
      s = std::upper_bound(seqs, seqs + p.nseq, r,
                           [](int64_t v, const Seq& q) { return v < q.item0; }) -
          seqs - 1;
    }
    while (s + 1 < p.nseq && seqs[s + 1].item0 <= r) ++s;
    const Seq& sq = seqs[s];
    float* wt = p.chunk_major ? kept.data() + tile * kTapSet : one;
    const bool need = p.chunk_major ? converted[tile] == 0 : tile != taps_tile;
    if (!sq.pad && need) {
      const int64_t c0 = tile * p.tile_c;
      load_taps<W, T>(p, c0, std::min(p.dim, c0 + p.tile_c) - c0, wt, wt + W * kTileC);
      if (p.chunk_major) {
        converted[tile] = 1;
      } else {
        taps_tile = tile;
      }
    }
    fwd_item<T, W, SILU>(p, sq, r - sq.item0, tile, wt, wt + W * kTileC, sp);
  }
}

template <typename T, int W, bool SILU>
void update_range_t(const Params& p, int64_t begin, int64_t end) {
  // Item = (batch chunk of chunk_t rows, channel tile), batch-major: a thread
  // streams whole slot rows. The taps are converted at an item's first row
  // that is not a pad and kept while the tile stays: with one tile
  // (D <= kTileC) a thread converts them once, not once per item (B=32
  // D=2048: 1.05x at 1 thread, 1.09x at 2); per row, they dominated
  // small-batch decode.
  constexpr int H = W - 1;
  const int64_t S = p.st_rows;
  alignas(64) float wt[W * kTileC];
  alignas(64) float bt[kTileC];
  alignas(64) float win[H * kTileC];
  int64_t taps_tile = -1;
  for (int64_t it = begin; it < end; ++it) {
    const int64_t b0 = (it / p.n_tiles) * p.chunk_t;
    const int64_t b1 = std::min(p.nseq, b0 + p.chunk_t);
    const int64_t tile = it % p.n_tiles;
    const int64_t c0 = tile * p.tile_c;
    const int64_t nc = std::min(p.dim, c0 + p.tile_c) - c0;
    for (int64_t b = b0; b < b1; ++b) {
      const Seq& sq = p.seqs[b];
      const int64_t L = sq.len;
      T* out = static_cast<T*>(p.out) + sq.out_off;
      if (sq.pad) {
        zero_rows(out, p.out_rs, 0, L, c0, nc);
        continue;
      }
      if (taps_tile != tile) {
        load_taps<W, T>(p, c0, nc, wt, bt);
        taps_tile = tile;
      }
      if (L == 1 && p.st_sd == 1) {
        decode_row<T, W, SILU>(p, sq, c0, nc, wt, bt);
        continue;
      }
      const T* x = static_cast<const T*>(p.x) + sq.x_off;
      T* st = static_cast<T*>(p.state) + sq.slot * p.st_sn + c0 * p.st_sd;
      for (int j = 0; j < H; ++j) {
        float* wr = win + j * kTileC;
        row_to_f32(st + (sq.hist_row + j) * p.st_ss, p.st_sd, wr, nc);
        std::fill(wr + nc, wr + kTileC, 0.f);
      }

      // Shift the slot once the history sits in `win`, and before the outputs: they may
      // overwrite x (out is x), whose rows the shift copies. Row r takes old row r+shift
      // (ascending r only reads rows not yet overwritten) or x.
      const int64_t keep = std::max<int64_t>(S - L, 0);
      for (int64_t r = 0; r < S; ++r) {
        T* dst = st + r * p.st_ss;
        if (r < keep) {
          copy_row(st + (r + sq.shift) * p.st_ss, p.st_sd, dst, p.st_sd, nc);
        } else {
          copy_row(x + (L - S + r) * p.x_rs + c0, 1, dst, p.st_sd, nc);
        }
      }

      run_tile<T, W, SILU>(x + c0, p.x_rs, out + c0, p.out_rs, L, nc, wt, bt,
                           win);
    }
  }
}

template <typename T, bool SILU>
void dispatch_w(const Params& p, int64_t b, int64_t e, bool upd) {
  switch (p.width) {
#define KV_CASE(W)                                 \
  case W:                                          \
    if (upd)                                       \
      update_range_t<T, W, SILU>(p, b, e);         \
    else                                           \
      fwd_range_t<T, W, SILU>(p, b, e);            \
    break;
    KV_CASE(2)
    KV_CASE(3)
    KV_CASE(4)
#undef KV_CASE
    default:
      break;  // rejected by the binding
  }
}

template <typename T>
void dispatch_act(const Params& p, int64_t b, int64_t e, bool upd) {
  if (p.silu)
    dispatch_w<T, true>(p, b, e, upd);
  else
    dispatch_w<T, false>(p, b, e, upd);
}

// KV_BF16_ONLY: the AVX512-BF16 build only differs for bf16 data; the
// binding never routes other dtypes to it, so don't instantiate them.
inline void dispatch(const Params& p, int64_t b, int64_t e, bool upd) {
  switch (p.dtype) {
#if !defined(KV_BF16_ONLY)
    case DType::F32:
      dispatch_act<float>(p, b, e, upd);
      break;
    case DType::F16:
      dispatch_act<c10::Half>(p, b, e, upd);
      break;
#endif
    case DType::BF16:
      dispatch_act<c10::BFloat16>(p, b, e, upd);
      break;
    default:
      break;
  }
}

}  // namespace

// KV_CCONV_PRIMITIVES_ONLY: a bench-only build (tools/bench_cpu_roofline.py's floor) that uses
// the loads, stores and SiLU above without compiling the whole kernel again.
#if !defined(KV_CCONV_PRIMITIVES_ONLY)
void fwd_range(const Params& p, int64_t begin, int64_t end) {
  dispatch(p, begin, end, false);
}

void update_range(const Params& p, int64_t begin, int64_t end) {
  dispatch(p, begin, end, true);
}
#endif

}  // namespace KV_ISA_NS
}  // namespace kv_cconv
