// RMSNorm (optionally preceded by a residual add) over rows of D channels:
//   out = s * rsqrt(mean(s[:V]^2) + eps) * (offset + weight), in fp32,
// where s = x, or s = round_to_T(x + residual) (also written out); offset is
// 1 for Gemma's (1 + w) and 0 for plain RMSNorm, V the channels that make the
// mean (D, or vLLM's variance_size). Gated RMSNorm (vLLM's RMSNormGated) is the
// same kernel with a gate and groups: s = x * act(z) before the norm, or the
// output times act(z) after it (act: SiLU or the sigmoid, in fp32), and each
// group of channels normalised by its own mean.
//
// Compiled once per ISA, like causal_conv1d_kernel.h: the including TU
// defines KV_GRMS_ISA_NS (and, for SIMD builds, CPU_CAPABILITY /
// CPU_CAPABILITY_<ISA> plus a matching `#pragma GCC target`, from
// isa_<isa>.h) first. ATen's
// Vectorized<> then resolves to that ISA inside at::vec::CPU_CAPABILITY and
// everything else here lives in kv_grms::<isa>::(anonymous), so the copies
// never collide at link time.
//
// Per row, two passes over D (a row is at most a few tens of KiB, so the
// second pass hits L1/L2): (1) load x (+ residual, sum, round to T, store
// residual_sum), accumulate s^2 in four fp32 vector accumulators (bf16 x
// without residual on AVX512-BF16: vdpbf16ps straight from memory);
// (2) re-read s (x, or the residual_sum just written), scale by
// rsqrt(mean + eps) and (1 + w), convert and store. With at least
// KV_GRMS_W1_ROWS rows in a work range, (1 + w) is converted once into an
// fp32 stack buffer when that saves a per-row conversion.
// bf16 in the AVX2 / AVX-512 builds works in even/odd lane order (see
// IO<BFloat16>): measured ~20% faster than widening with vpmovzxwd.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>

#include "gemma_rms_norm_params.h"

#ifndef KV_GRMS_ISA_NS
#error "define KV_GRMS_ISA_NS before including gemma_rms_norm_kernel.h"
#endif

#ifndef KV_GRMS_INLINE
#if defined(__GNUC__)
#define KV_GRMS_INLINE inline __attribute__((always_inline))
#else
#define KV_GRMS_INLINE inline
#endif
#endif

// Ranges with at least this many rows convert (1 + weight) to an fp32
// buffer first (rows up to kW1Max channels); shorter ones convert inline.
#ifndef KV_GRMS_W1_ROWS
#define KV_GRMS_W1_ROWS 4
#endif

// bf16 in the SIMD builds: lanes in even/odd order (see IO<BFloat16>).
#ifndef KV_GRMS_BF16_EO
#define KV_GRMS_BF16_EO 1
#endif
// AVX512-BF16 build: sum of squares of a bf16 x with vdpbf16ps.
#ifndef KV_GRMS_DPBF16
#define KV_GRMS_DPBF16 1
#endif

namespace kv_grms {
namespace KV_GRMS_ISA_NS {

void norm_range(const Params& p, int64_t begin, int64_t end);

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int VF = static_cast<int>(fVec::size());
constexpr int VW = 2 * VF;  // channels per load group
constexpr int64_t kW1Rows = KV_GRMS_W1_ROWS;
constexpr int64_t kW1Max = 8192;  // 32 KiB of stack

// ---------------------------------------------------------------- I/O
// VW channels of T <-> two fp32 vectors (natural channel order).
//   load:        T -> fp32
//   store:       fp32 -> T (the normalised output; any correct rounding)
//   round_store: fp32 -> T, stored, and a/b replaced by the T values in
//                fp32. Must round exactly like torch's `x + residual`
//                (to nearest even), since residual_sum is compared
//                bit for bit.
template <typename T>
struct IO {  // bf16 / fp16 through ATen's conversions (portable build)
  using V = at::vec::Vectorized<T>;
  static_assert(V::size() == VW, "16-bit vector must hold 2*VF lanes");
  static constexpr bool kEO = false;
  static KV_GRMS_INLINE void load(const T* p, fVec& a, fVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(V::loadu(p));
  }
  static KV_GRMS_INLINE void store(T* p, const fVec& a, const fVec& b) {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
  static KV_GRMS_INLINE void round_store(T* p, fVec& a, fVec& b) {
    const V v = at::vec::convert_from_float<T>(a, b);
    v.store(p);
    std::tie(a, b) = at::vec::convert_to_float<T>(v);
  }
};

template <>
struct IO<float> {
  static constexpr bool kEO = false;
  static KV_GRMS_INLINE void load(const float* p, fVec& a, fVec& b) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + VF);
  }
  static KV_GRMS_INLINE void store(float* p, const fVec& a, const fVec& b) {
    a.store(p);
    b.store(p + VF);
  }
  static KV_GRMS_INLINE void round_store(float* p, fVec& a, fVec& b) {
    store(p, a, b);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// bf16, KV_GRMS_BF16_EO: a group's two vectors hold its even channels
// (0, 2, ..., 30) and its odd ones (1, 3, ..., 31). Those are the 32-bit
// lanes of one plain 64-byte load shifted left by 16 / masked to the high
// half, so neither loads nor the software narrowing need a cross-lane
// shuffle. Everything a group meets (x, residual, weight, the fp32 (1 + w)
// buffer, the stores) uses that order, and the sum of squares ignores it.
template <>
struct IO<c10::BFloat16> {
  using T = c10::BFloat16;
  static constexpr bool kEO = KV_GRMS_BF16_EO;
  static KV_GRMS_INLINE __m512i hi_mask() {
    return _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  }
  // fp32 bits of v rounded to bf16 (nearest even; NaN -> 0xffff, as ATen's
  // vectorised conversion, which torch's bf16 add uses), low half zero.
  static KV_GRMS_INLINE __m512i rne(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    __m512i t = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    t = _mm512_add_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(0x7fff)), u);
    t = _mm512_and_si512(t, hi_mask());
    const __mmask16 ord = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    return _mm512_mask_blend_epi32(ord, hi_mask(), t);
  }
#if KV_GRMS_BF16_EO
  static KV_GRMS_INLINE void load(const T* p, fVec& a, fVec& b) {
    const __m512i u = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(u, hi_mask()));
  }
  // 32 fp32 values (weights) into the same even/odd order.
  static KV_GRMS_INLINE void load_f32(const float* p, fVec& a, fVec& b) {
    const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    a = _mm512_permutex2var_ps(lo, ie, hi);
    b = _mm512_permutex2var_ps(lo, io, hi);
  }
  // Rounded even / odd fp32 bits -> the 32 bf16 in channel order.
  static KV_GRMS_INLINE __m512i join(__m512i re, __m512i ro) {
    return _mm512_or_si512(_mm512_srli_epi32(re, 16), ro);
  }
#if defined(KV_GRMS_AVX512_BF16)
  // vcvtne2ps2bf16 + one vpermw (fp32 denormals become 0: fine for the
  // normalised output, which only has to be within tolerance; the sum
  // keeps the software rounding).
  static KV_GRMS_INLINE __m512i narrow(const fVec& a, const fVec& b) {
    const __m512i c = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
    const __m512i idx = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, c);
  }
#endif
#else   // natural channel order
  static KV_GRMS_INLINE __m512 widen(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static KV_GRMS_INLINE void load(const T* p, fVec& a, fVec& b) {
    a = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
  static KV_GRMS_INLINE void load_f32(const float* p, fVec& a, fVec& b) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + VF);
  }
  // Rounded fp32 bits -> the 32 bf16 in channel order: the high halves of
  // the 32 fp32 lanes of (lo, hi), in order: one vpermt2w.
  static KV_GRMS_INLINE __m512i join(__m512i lo, __m512i hi) {
    const __m512i idx = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(lo, idx, hi);
  }
#if defined(KV_GRMS_AVX512_BF16)
  static KV_GRMS_INLINE __m512i narrow(const fVec& a, const fVec& b) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  }
#endif
#endif  // KV_GRMS_BF16_EO
#if !defined(KV_GRMS_AVX512_BF16)
  static KV_GRMS_INLINE __m512i narrow(const fVec& a, const fVec& b) {
    return join(rne(a), rne(b));
  }
#endif
  static KV_GRMS_INLINE void store(T* p, const fVec& a, const fVec& b) {
    _mm512_storeu_si512(p, narrow(a, b));
  }
  static KV_GRMS_INLINE void round_store(T* p, fVec& a, fVec& b) {
    const __m512i ra = rne(a), rb = rne(b);
    _mm512_storeu_si512(p, join(ra, rb));
    a = _mm512_castsi512_ps(ra);
    b = _mm512_castsi512_ps(rb);
  }
};

template <>
struct IO<c10::Half> {
  using T = c10::Half;
  static constexpr bool kEO = false;
  static constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  static KV_GRMS_INLINE void load(const T* p, fVec& a, fVec& b) {
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
  }
  static KV_GRMS_INLINE void store(T* p, const fVec& a, const fVec& b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a, kRound));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), _mm512_cvtps_ph(b, kRound));
  }
  static KV_GRMS_INLINE void round_store(T* p, fVec& a, fVec& b) {
    const __m256i ha = _mm512_cvtps_ph(a, kRound), hb = _mm512_cvtps_ph(b, kRound);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ha);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), hb);
    a = _mm512_cvtph_ps(ha);
    b = _mm512_cvtph_ps(hb);
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
// bf16: see the AVX-512 version (even/odd order with KV_GRMS_BF16_EO).
template <>
struct IO<c10::BFloat16> {
  using T = c10::BFloat16;
  static constexpr bool kEO = KV_GRMS_BF16_EO;
  static KV_GRMS_INLINE __m256i hi_mask() {
    return _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  }
  static KV_GRMS_INLINE __m256i rne(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    __m256i t = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    t = _mm256_add_epi32(_mm256_add_epi32(t, _mm256_set1_epi32(0x7fff)), u);
    t = _mm256_and_si256(t, hi_mask());
    const __m256 ord = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
    return _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(hi_mask()), _mm256_castsi256_ps(t), ord));
  }
#if KV_GRMS_BF16_EO
  static KV_GRMS_INLINE void load(const T* p, fVec& a, fVec& b) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(u, hi_mask()));
  }
  static KV_GRMS_INLINE void load_f32(const float* p, fVec& a, fVec& b) {
    const __m256 lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
    // [0 2 8 10 | 4 6 12 14] -> 64-bit units (0, 2, 1, 3) -> 0 2 4 ... 14.
    const __m256 e = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 o = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    a = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8));
    b = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8));
  }
  static KV_GRMS_INLINE __m256i join(__m256i re, __m256i ro) {
    return _mm256_or_si256(_mm256_srli_epi32(re, 16), ro);
  }
#else   // natural channel order
  static KV_GRMS_INLINE __m256 widen(const T* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static KV_GRMS_INLINE void load(const T* p, fVec& a, fVec& b) {
    a = widen(p);
    b = widen(p + 8);
  }
  static KV_GRMS_INLINE void load_f32(const float* p, fVec& a, fVec& b) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + VF);
  }
  static KV_GRMS_INLINE __m256i join(__m256i lo, __m256i hi) {
    const __m256i v = _mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16));
    return _mm256_permute4x64_epi64(v, 0xD8);
  }
#endif  // KV_GRMS_BF16_EO
  static KV_GRMS_INLINE void store(T* p, const fVec& a, const fVec& b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), join(rne(a), rne(b)));
  }
  static KV_GRMS_INLINE void round_store(T* p, fVec& a, fVec& b) {
    const __m256i ra = rne(a), rb = rne(b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), join(ra, rb));
    a = _mm256_castsi256_ps(ra);
    b = _mm256_castsi256_ps(rb);
  }
};

template <>
struct IO<c10::Half> {
  using T = c10::Half;
  static constexpr bool kEO = false;
  static constexpr int kRound = _MM_FROUND_TO_NEAREST_INT;
  static KV_GRMS_INLINE void load(const T* p, fVec& a, fVec& b) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  }
  static KV_GRMS_INLINE void store(T* p, const fVec& a, const fVec& b) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a, kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(b, kRound));
  }
  static KV_GRMS_INLINE void round_store(T* p, fVec& a, fVec& b) {
    const __m128i ha = _mm256_cvtps_ph(a, kRound), hb = _mm256_cvtps_ph(b, kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ha);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), hb);
    a = _mm256_cvtph_ps(ha);
    b = _mm256_cvtph_ps(hb);
  }
};
#endif

// Ragged last group (n < VW channels): through a zero-padded stack buffer,
// so padding lanes are 0 (they add nothing to the sum of squares).
template <typename T>
KV_GRMS_INLINE void load_n(const T* p, fVec& a, fVec& b, int n) {
  alignas(64) T buf[VW];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, sizeof(T) * n);
  IO<T>::load(buf, a, b);
}
template <typename T>
KV_GRMS_INLINE void store_n(T* p, const fVec& a, const fVec& b, int n) {
  alignas(64) T buf[VW];
  IO<T>::store(buf, a, b);
  std::memcpy(static_cast<void*>(p), buf, sizeof(T) * n);
}
template <typename T>
KV_GRMS_INLINE void round_store_n(T* p, fVec& a, fVec& b, int n) {
  alignas(64) T buf[VW];
  IO<T>::round_store(buf, a, b);
  std::memcpy(static_cast<void*>(p), buf, sizeof(T) * n);
}

// VW weights of type WT in the lane order of T's vectors.
template <typename T, typename WT>
KV_GRMS_INLINE void load_w(const WT* p, fVec& a, fVec& b) {
  if constexpr (IO<T>::kEO && std::is_same_v<WT, float>)
    IO<T>::load_f32(p, a, b);
  else
    IO<WT>::load(p, a, b);
}
template <typename T, typename WT>
KV_GRMS_INLINE void load_w_n(const WT* p, fVec& a, fVec& b, int n) {
  alignas(64) WT buf[VW];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, sizeof(WT) * n);
  load_w<T, WT>(buf, a, b);
}

// s for VW channels at offset c: x, or round_T(x + residual) (stored to sum).
template <typename T, bool RES>
KV_GRMS_INLINE void load_s(const T* x, const T* r, T* s, int64_t c, fVec& a, fVec& b) {
  IO<T>::load(x + c, a, b);
  if constexpr (RES) {
    fVec ra, rb;
    IO<T>::load(r + c, ra, rb);
    a = a + ra;
    b = b + rb;
    IO<T>::round_store(s + c, a, b);
  }
}

template <typename T, bool RES>
KV_GRMS_INLINE void load_s_n(const T* x, const T* r, T* s, int64_t c, fVec& a, fVec& b, int n) {
  load_n(x + c, a, b, n);
  if constexpr (RES) {
    fVec ra, rb;
    load_n(r + c, ra, rb, n);
    a = a + ra;
    b = b + rb;
    round_store_n(s + c, a, b, n);
  }
}

// Pass 1: sum of s^2 over the row (s stored to `s` when RES).
template <typename T, bool RES>
KV_GRMS_INLINE float sum_squares(const T* x, const T* r, T* s, int64_t D) {
#if defined(KV_GRMS_AVX512_BF16) && KV_GRMS_DPBF16
  if constexpr (!RES && std::is_same_v<T, c10::BFloat16>) {
    // vdpbf16ps: 32 bf16 squares (exact in fp32) summed pairwise into 16
    // fp32 lanes per instruction, no conversion at all.
    __m512 q0 = _mm512_setzero_ps(), q1 = q0, q2 = q0, q3 = q0;
    auto dp = [](__m512 acc, __m512i u) {
      const __m512bh h = reinterpret_cast<__m512bh>(u);
      return _mm512_dpbf16_ps(acc, h, h);
    };
    int64_t c = 0;
    for (; c + 128 <= D; c += 128) {
      q0 = dp(q0, _mm512_loadu_si512(x + c));
      q1 = dp(q1, _mm512_loadu_si512(x + c + 32));
      q2 = dp(q2, _mm512_loadu_si512(x + c + 64));
      q3 = dp(q3, _mm512_loadu_si512(x + c + 96));
    }
    for (; c + 32 <= D; c += 32) q0 = dp(q0, _mm512_loadu_si512(x + c));
    if (c < D)
      q1 = dp(q1, _mm512_maskz_loadu_epi16(
                      static_cast<__mmask32>((uint64_t{1} << (D - c)) - 1), x + c));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(q0, q1), _mm512_add_ps(q2, q3)));
  }
#endif
  fVec acc0(0.f), acc1(0.f), acc2(0.f), acc3(0.f);
  int64_t c = 0;
  for (; c + 2 * VW <= D; c += 2 * VW) {
    fVec a0, b0, a1, b1;
    load_s<T, RES>(x, r, s, c, a0, b0);
    load_s<T, RES>(x, r, s, c + VW, a1, b1);
    acc0 = at::vec::fmadd(a0, a0, acc0);
    acc1 = at::vec::fmadd(b0, b0, acc1);
    acc2 = at::vec::fmadd(a1, a1, acc2);
    acc3 = at::vec::fmadd(b1, b1, acc3);
  }
  if (c + VW <= D) {
    fVec a, b;
    load_s<T, RES>(x, r, s, c, a, b);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
    c += VW;
  }
  if (c < D) {
    fVec a, b;
    load_s_n<T, RES>(x, r, s, c, a, b, static_cast<int>(D - c));
    acc2 = at::vec::fmadd(a, a, acc2);
    acc3 = at::vec::fmadd(b, b, acc3);
  }
  const fVec acc = (acc0 + acc1) + (acc2 + acc3);
  return at::vec::vec_reduce_all<float>([](fVec& u, fVec& v) { return u + v; }, acc);
}

// act(z) for one vector of gates: SiLU (z * sigmoid(z)) or the sigmoid, from
// e = exp(-|z|) in (0, 1], which never overflows whatever z: sigmoid(z) is
// 1 / (1 + e) for z >= 0 and e / (1 + e) below (|z| > 20 included: e
// vanishes, never inf / inf). NaN stays NaN (exp_u20 clamps its argument,
// which would make it a number).
KV_GRMS_INLINE fVec gate_act(const fVec& z, bool sigmoid) {
  const fVec one(1.f);
  const fVec e = (fVec(0.f) - z.abs()).exp_u20();
  const fVec sig = fVec::blendv(e, one, z >= fVec(0.f)) / (one + e);
  return fVec::blendv(sigmoid ? sig : z * sig, z, z.isnan());
}

// Pass 1 of a gate before the norm: s = x * act(z) for n channels, stored
// in fp32 to `s` (in T's lane order, padded to whole groups: the pads are 0),
// and the sum of s^2.
template <typename T>
KV_GRMS_INLINE float gated_squares(const T* x, const T* z, float* s, int64_t n, bool sigmoid) {
  fVec acc0(0.f), acc1(0.f);
  for (int64_t c = 0; c < n; c += VW) {
    fVec a, b, za, zb;
    if (c + VW <= n) {
      IO<T>::load(x + c, a, b);
      IO<T>::load(z + c, za, zb);
    } else {
      load_n(x + c, a, b, static_cast<int>(n - c));
      load_n(z + c, za, zb, static_cast<int>(n - c));
    }
    a = a * gate_act(za, sigmoid);
    b = b * gate_act(zb, sigmoid);
    a.store(s + c);
    b.store(s + c + VF);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  return at::vec::vec_reduce_all<float>([](fVec& u, fVec& v) { return u + v; }, acc0 + acc1);
}

// Pass 2 over n channels: o = ((s * rstd) * w1) [* act(z) for a gate after
// the norm], where s is x, or (a gate before the norm) the fp32 buffer `sf`
// that pass 1 filled. RAW: w1 = offset + w, w the weight (WT); else w is the
// fp32 (offset + weight) buffer, already in T's lane order and padded to
// whole groups.
template <typename T, typename WT, bool RAW, Gate G>
KV_GRMS_INLINE void scale_row(const T* s, const float* sf, const T* z, const WT* w, T* o, float rstd,
                              float offset, int64_t D, bool sigmoid) {
  const fVec rv(rstd);
  const fVec off(offset);
  int64_t c = 0;
  auto group = [&](int n) {  // n: the channels of this group, VW but for a ragged last one
    fVec a, b, wa, wb;
    if constexpr (G == Gate::In)
      IO<float>::load(sf + c, a, b);
    else if (n == VW)
      IO<T>::load(s + c, a, b);
    else
      load_n(s + c, a, b, n);
    if constexpr (RAW) {
      if (n == VW)
        load_w<T, WT>(w + c, wa, wb);
      else
        load_w_n<T, WT>(w + c, wa, wb, n);
      wa = wa + off;
      wb = wb + off;
    } else {
      IO<float>::load(w + c, wa, wb);
    }
    a = (a * rv) * wa;
    b = (b * rv) * wb;
    if constexpr (G == Gate::Out) {
      fVec za, zb;
      if (n == VW)
        IO<T>::load(z + c, za, zb);
      else
        load_n(z + c, za, zb, n);
      a = a * gate_act(za, sigmoid);
      b = b * gate_act(zb, sigmoid);
    }
    if (n == VW)
      IO<T>::store(o + c, a, b);
    else
      store_n(o + c, a, b, n);
  };
  for (; c + VW <= D; c += VW) group(VW);
  if (c < D) group(static_cast<int>(D - c));
}

// fp32 (offset + w) in T's lane order, padded to whole groups (w1 holds
// round_up(D, VW) floats).
template <typename T, typename WT>
void fill_w1(const WT* w, float* w1, float offset, int64_t D) {
  const fVec off(offset);
  int64_t c = 0;
  fVec a, b;
  for (; c + VW <= D; c += VW) {
    load_w<T, WT>(w + c, a, b);
    (a + off).store(w1 + c);
    (b + off).store(w1 + c + VF);
  }
  if (c < D) {
    load_w_n<T, WT>(w + c, a, b, static_cast<int>(D - c));
    (a + off).store(w1 + c);
    (b + off).store(w1 + c + VF);
  }
}

// Rows [begin, end). Each row is D / group groups of `group` channels, each
// normalised by the mean of squares of its first var_dim channels (a
// residual comes with one group only). The weight buffer and the fp32 buffer
// of a gate before the norm hold each group padded to whole load groups (gp
// floats), so every group starts in T's lane order.
template <typename T, typename WT, bool RES, Gate G>
void rows_t(const Params& p, int64_t begin, int64_t end) {
  const int64_t D = p.dim;
  const T* X = static_cast<const T*>(p.x);
  const T* R = static_cast<const T*>(p.res);
  const T* Z = static_cast<const T*>(p.gate);
  const WT* W = static_cast<const WT*>(p.weight);
  T* O = static_cast<T*>(p.out);
  T* S = static_cast<T*>(p.sum);
  const int64_t V = p.var_dim;
  const int64_t GS = p.group;
  const int64_t gp = (GS + VW - 1) / VW * VW;
  const int64_t ngroups = D / GS;
  const float fV = static_cast<float>(V);
  const float eps = p.eps;
  const bool sigmoid = p.sigmoid;
  // A gate before the norm: x * act(z) of one group, kept in fp32 between the passes.
  std::unique_ptr<float[]> gated(G == Gate::In ? new float[gp] : nullptr);

  auto rstd_of = [&](float ss) { return 1.f / std::sqrt(ss / fV + eps); };
  // Passes 1 and 2 of one group at channel c0 of row r (no residual).
  auto norm_group = [&](int64_t r, int64_t c0, auto w, auto raw) {
    constexpr bool kRaw = decltype(raw)::value;
    const T* x = X + r * p.x_rs + c0;
    const T* z = G != Gate::None ? Z + r * p.g_rs + c0 : nullptr;
    const float ss = G == Gate::In ? gated_squares<T>(x, z, gated.get(), V, sigmoid)
                                   : sum_squares<T, false>(x, nullptr, nullptr, V);
    using W_t = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    scale_row<T, W_t, kRaw, G>(x, gated.get(), z, w, O + r * D + c0, rstd_of(ss), p.offset, GS, sigmoid);
  };
  auto row_rstd = [&](int64_t r) {
    const T* x = X + r * p.x_rs;
    const T* rr = RES ? R + r * p.r_rs : nullptr;
    T* s = RES ? S + r * D : nullptr;
    const float ss = sum_squares<T, RES>(x, rr, s, V);
    // The channels past V still need their sum written; their squares are not wanted.
    if (RES && V < D) (void)sum_squares<T, RES>(x + V, rr + V, s + V, D - V);
    return rstd_of(ss);
  };

  // The buffer saves a conversion (16-bit or reordered weights) per group
  // and row; plain fp32 weights only save the + 1, not worth a pass.
  constexpr bool kConvertW = !std::is_same_v<WT, float> || IO<T>::kEO;
  if (kConvertW && end - begin >= kW1Rows && (ngroups - 1) * gp + GS <= kW1Max) {
    alignas(64) float w1[kW1Max + VW];
    for (int64_t g = 0; g < ngroups; ++g) fill_w1<T, WT>(W + g * GS, w1 + g * gp, p.offset, GS);
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (RES) {
        const float rstd = row_rstd(r);
        scale_row<T, float, false, G>(S + r * D, nullptr, nullptr, w1, O + r * D, rstd, p.offset, D, sigmoid);
      } else {
        for (int64_t g = 0; g < ngroups; ++g)
          norm_group(r, g * GS, static_cast<const float*>(w1 + g * gp), std::false_type{});
      }
    }
  } else {
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (RES) {
        const float rstd = row_rstd(r);
        scale_row<T, WT, true, G>(S + r * D, nullptr, nullptr, W, O + r * D, rstd, p.offset, D, sigmoid);
      } else {
        for (int64_t g = 0; g < ngroups; ++g) norm_group(r, g * GS, W + g * GS, std::true_type{});
      }
    }
  }
}

template <typename T, typename WT>
KV_GRMS_INLINE void dispatch_res(const Params& p, int64_t b, int64_t e) {
  if (p.res)
    rows_t<T, WT, true, Gate::None>(p, b, e);
  else if (p.gate_at == Gate::In)
    rows_t<T, WT, false, Gate::In>(p, b, e);
  else if (p.gate_at == Gate::Out)
    rows_t<T, WT, false, Gate::Out>(p, b, e);
  else
    rows_t<T, WT, false, Gate::None>(p, b, e);
}

template <typename T>
KV_GRMS_INLINE void dispatch_w(const Params& p, int64_t b, int64_t e) {
  if constexpr (std::is_same_v<T, float>) {
    dispatch_res<float, float>(p, b, e);
  } else {
    if (p.wdtype == DType::F32)
      dispatch_res<T, float>(p, b, e);
    else
      dispatch_res<T, T>(p, b, e);
  }
}

}  // namespace

// KV_GRMS_BF16_ONLY: the AVX512-BF16 build only differs for bf16 data; the
// binding never routes other dtypes to it.
void norm_range(const Params& p, int64_t begin, int64_t end) {
  switch (p.dtype) {
#if !defined(KV_GRMS_BF16_ONLY)
    case DType::F32:
      dispatch_w<float>(p, begin, end);
      break;
    case DType::F16:
      dispatch_w<c10::Half>(p, begin, end);
      break;
#endif
    case DType::BF16:
      dispatch_w<c10::BFloat16>(p, begin, end);
      break;
    default:
      break;
  }
}

}  // namespace KV_GRMS_ISA_NS
}  // namespace kv_grms
