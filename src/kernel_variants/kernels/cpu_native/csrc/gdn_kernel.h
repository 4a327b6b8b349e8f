// The gated delta rule (Qwen3-Next's GDN linear attention) for one (sequence, v head) work item,
// token by token, in fp32:
//   S = S * alpha;  u = beta * (v - Sᵀk);  S = S + k ⊗ u;  o = Sᵀq
// with alpha = exp(g), q and k optionally L2-normalised, q scaled.
//
// Compiled once per ISA, like ssm_scan_kernel.h: the including TU defines KV_GDN_ISA_NS (and, for
// SIMD builds, the target pragma and CPU_CAPABILITY macros from isa_<isa>.h) first.
//
// Layout and schedule. The state S [K, V] is kept as in the pool and vectorised along V, so both
// products need no horizontal sums: Sᵀk and Sᵀq are FMAs of whole rows by a broadcast k[i] / q[i].
// The columns of S evolve independently (k, q, alpha, beta are shared by all of them), so the
// head's state is cut into column tiles of up to 4 vectors (32 KiB of fp32 at K = 128 on AVX-512)
// that stay in L1 while a block of up to kBlock tokens runs through them. Per token one pass over
// the tile does the decay and the rank-1 update (load, mul, FMA, store), o += S[i] q[i], and the
// NEXT token's Sᵀk (the decay of that token is applied to the sum: (alpha S)ᵀk = alpha (Sᵀk)), so
// the tile is read and written once per token; only a block's first token takes a separate Sᵀk
// pass. The head's state is read from its slot once and written back once per sequence: in place
// for an fp32 pool, else through an fp32 copy rounded once at the end (what torch's .to gives).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gdn_params.h"

#ifndef KV_GDN_ISA_NS
#error "define KV_GDN_ISA_NS before including gdn_kernel.h"
#endif

#if defined(__GNUC__)
#define KV_GDN_INLINE inline __attribute__((always_inline))
#else
#define KV_GDN_INLINE inline
#endif

namespace kv_gdn {
namespace KV_GDN_ISA_NS {

void run_range(const Params& p, int64_t begin, int64_t end);

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int VF = static_cast<int>(fVec::size());
using bf16 = c10::BFloat16;
using f16 = c10::Half;

// Tokens per block: their fp32 q, k, v and o rows (~96 KiB at K = V = 128) stay in L2 while
// every column tile of the state runs through them.
constexpr int64_t kBlock = 64;
// Vectors per column tile: enough independent FMA chains to cover the FMA latency, few enough
// for the registers (the AVX-512 pair pass keeps six accumulators and weights per vector).
constexpr int kTile = 2;
// A one-token item's tiles (a decode step, memory-bound): wider ones stream the slot in fewer,
// longer runs (~1.3x faster at 4 vectors than at 2 for 16 sequences on Zen 5, 8 about as 4).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kTileOne = 8;
#else
constexpr int kTileOne = 4;
#endif

// ------------------------------------------------------------- I/O: VF elements <-> fVec
// Partial forms (n < VF) zero the lanes past n. Portable: through a float buffer.
template <class T>
struct Io {
  static KV_GDN_INLINE fVec load(const T* p, int n = VF) {
    alignas(64) float b[VF] = {};
    for (int i = 0; i < n; ++i) b[i] = static_cast<float>(p[i]);
    return fVec::loadu(b);
  }
  static KV_GDN_INLINE void store(T* p, const fVec& v, int n = VF) {
    alignas(64) float b[VF];
    v.store(b);
    for (int i = 0; i < n; ++i) p[i] = static_cast<T>(b[i]);
  }
};

template <>
struct Io<float> {
  static KV_GDN_INLINE fVec load(const float* p) { return fVec::loadu(p); }
  static KV_GDN_INLINE fVec load(const float* p, int n) { return fVec::loadu(p, n); }
  static KV_GDN_INLINE void store(float* p, const fVec& v) { v.store(p); }
  static KV_GDN_INLINE void store(float* p, const fVec& v, int n) { v.store(p, n); }
};

#if defined(CPU_CAPABILITY_AVX512)
KV_GDN_INLINE __mmask16 lanes(int n) { return static_cast<__mmask16>((1u << n) - 1); }
// fp32 -> bf16 bits rounded to nearest even with denormals kept, NaN -> 0x7fc0 (torch's .to),
// in the low 16 bits of each 32-bit lane.
KV_GDN_INLINE __m512i bf16_rne(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), r);
}
template <>
struct Io<bf16> {
  static KV_GDN_INLINE fVec widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static KV_GDN_INLINE fVec load(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static KV_GDN_INLINE fVec load(const bf16* p, int n) { return widen(_mm256_maskz_loadu_epi16(lanes(n), p)); }
  static KV_GDN_INLINE void store(bf16* p, const fVec& v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_rne(v)));
  }
  static KV_GDN_INLINE void store(bf16* p, const fVec& v, int n) {
    _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(bf16_rne(v)));
  }
};
template <>
struct Io<f16> {
  static KV_GDN_INLINE fVec load(const f16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static KV_GDN_INLINE fVec load(const f16* p, int n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(n), p)); }
  static KV_GDN_INLINE void store(f16* p, const fVec& v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static KV_GDN_INLINE void store(f16* p, const fVec& v, int n) {
    _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
KV_GDN_INLINE __m128i bf16_rne(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), _mm256_castsi256_ps(r),
                                           _mm256_cmp_ps(v, v, _CMP_ORD_Q)));
  // 32 -> 16 bits: packus works within 128-bit lanes; the qword permute brings lanes 0 and 2 together.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}
template <>
struct Io<bf16> {
  static KV_GDN_INLINE fVec widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static KV_GDN_INLINE fVec load(const bf16* p) { return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static KV_GDN_INLINE fVec load(const bf16* p, int n) {
    alignas(16) uint16_t b[8] = {};
    std::memcpy(b, p, sizeof(uint16_t) * n);
    return widen(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
  }
  static KV_GDN_INLINE void store(bf16* p, const fVec& v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_rne(v)); }
  static KV_GDN_INLINE void store(bf16* p, const fVec& v, int n) {
    alignas(16) uint16_t b[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(b), bf16_rne(v));
    std::memcpy(p, b, sizeof(uint16_t) * n);
  }
};
template <>
struct Io<f16> {
  static KV_GDN_INLINE fVec load(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static KV_GDN_INLINE fVec load(const f16* p, int n) {
    alignas(16) uint16_t b[8] = {};
    std::memcpy(b, p, sizeof(uint16_t) * n);
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
  }
  static KV_GDN_INLINE void store(f16* p, const fVec& v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static KV_GDN_INLINE void store(f16* p, const fVec& v, int n) {
    alignas(16) uint16_t b[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(b), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    std::memcpy(p, b, sizeof(uint16_t) * n);
  }
};
#endif

// n elements of T -> fp32, zeros up to npad.
template <class T>
KV_GDN_INLINE void to_f32(const T* s, float* d, int64_t n, int64_t npad) {
  int64_t i = 0;
  for (; i + VF <= n; i += VF) Io<T>::load(s + i).store(d + i);
  if (i < n) Io<T>::load(s + i, static_cast<int>(n - i)).store(d + i, static_cast<int>(n - i));
  if (npad > n) std::memset(d + n, 0, sizeof(float) * (npad - n));
}
KV_GDN_INLINE void row_f32(const void* s, DType t, float* d, int64_t n, int64_t npad) {
  switch (t) {
    case DType::F32: to_f32(static_cast<const float*>(s), d, n, npad); break;
    case DType::BF16: to_f32(static_cast<const bf16*>(s), d, n, npad); break;
    case DType::F16: to_f32(static_cast<const f16*>(s), d, n, npad); break;
  }
}
// n fp32 elements -> T, rounded to nearest even (the pool's rounding: torch's .to, denormals kept).
template <class T>
KV_GDN_INLINE void from_f32(const float* s, T* d, int64_t n) {
  int64_t i = 0;
  for (; i + VF <= n; i += VF) Io<T>::store(d + i, fVec::loadu(s + i));
  if (i < n) Io<T>::store(d + i, fVec::loadu(s + i, n - i), static_cast<int>(n - i));
}
KV_GDN_INLINE void row_from_f32(const float* s, void* d, DType t, int64_t n) {
  switch (t) {
    case DType::F32: std::memcpy(d, s, sizeof(float) * n); break;
    case DType::BF16: from_f32(s, static_cast<bf16*>(d), n); break;
    case DType::F16: from_f32(s, static_cast<f16*>(d), n); break;
  }
}
// The output's rounding. The AVX512-BF16 build narrows with vcvtneps2bf16 (one instruction per 16
// values; it flushes fp32 denormals, well within bf16's tolerance for o); the pool keeps the exact
// software rounding, since a bf16 pool must hold what torch's .to of the fp32 state gives.
KV_GDN_INLINE void out_from_f32(const float* s, void* d, DType t, int64_t n) {
#if defined(KV_GDN_AVX512_BF16)
  if (t == DType::BF16) {
    bf16* o = static_cast<bf16*>(d);
    int64_t i = 0;
    for (; i + VF <= n; i += VF)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(fVec::loadu(s + i))));
    if (i < n)
      _mm256_mask_storeu_epi16(o + i, lanes(static_cast<int>(n - i)),
                               reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(fVec::loadu(s + i, n - i))));
    return;
  }
#endif
  row_from_f32(s, d, t, n);
}
KV_GDN_INLINE float scalar_f32(const void* s, DType t, int64_t i) {
  switch (t) {
    case DType::BF16: return static_cast<float>(static_cast<const bf16*>(s)[i]);
    case DType::F16: return static_cast<float>(static_cast<const f16*>(s)[i]);
    default: return static_cast<const float*>(s)[i];
  }
}

KV_GDN_INLINE float sum_sq(const float* x, int64_t n) {
  fVec a(0.f);
  int64_t i = 0;
  for (; i + VF <= n; i += VF) {
    const fVec v = fVec::loadu(x + i);
    a = at::vec::fmadd(v, v, a);
  }
  if (i < n) {
    const fVec v = fVec::loadu(x + i, n - i);
    a = at::vec::fmadd(v, v, a);
  }
  return at::vec::vec_reduce_all<float>([](const fVec& l, const fVec& r) { return l + r; }, a);
}
KV_GDN_INLINE float dot(const float* x, const float* y, int64_t n) {
  fVec a(0.f);
  int64_t i = 0;
  for (; i + VF <= n; i += VF) a = at::vec::fmadd(fVec::loadu(x + i), fVec::loadu(y + i), a);
  if (i < n) a = at::vec::fmadd(fVec::loadu(x + i, n - i), fVec::loadu(y + i, n - i), a);
  return at::vec::vec_reduce_all<float>([](const fVec& l, const fVec& r) { return l + r; }, a);
}
KV_GDN_INLINE void scale_row(float* x, int64_t n, float s) {
  const fVec vs(s);
  int64_t i = 0;
  for (; i + VF <= n; i += VF) (fVec::loadu(x + i) * vs).store(x + i);
  if (i < n) (fVec::loadu(x + i, n - i) * vs).store(x + i, static_cast<int>(n - i));
}

inline int64_t round_up(int64_t n) { return (n + VF - 1) / VF * VF; }

// One block of a work item's tokens, in fp32.
struct Blk {
  const float* kf;     // [n, K]
  const float* qf;     // [n, K], normalised and scaled
  const float* vf;     // [n, Vr], zero past V
  float* of;           // [n, Vr]
  const float* alpha;  // [n] exp(g)
  const float* beta;   // [n]
  const float* kk;     // [n] k_t · k_{t+1} (the last: 0)
  const float* kq;     // [n] k_t · q_t
  int64_t n, K, Vr;
};

// acc[j] = sum_i S[i, j-th vector] * k[i]. Two row sets: one FMA per vector per row would
// otherwise wait on the last one's latency.
template <int NV>
KV_GDN_INLINE void st_k(const float* S, int64_t ld, int64_t K, const float* k, fVec* acc) {
  fVec a0[NV], a1[NV];
  for (int j = 0; j < NV; ++j) a0[j] = a1[j] = fVec(0.f);
  int64_t i = 0;
  for (; i + 2 <= K; i += 2) {
    const fVec k0(k[i]), k1(k[i + 1]);
    const float* r0 = S + i * ld;
    const float* r1 = r0 + ld;
    for (int j = 0; j < NV; ++j) {
      a0[j] = at::vec::fmadd(fVec::loadu(r0 + j * VF), k0, a0[j]);
      a1[j] = at::vec::fmadd(fVec::loadu(r1 + j * VF), k1, a1[j]);
    }
  }
  if (i < K) {
    const fVec k0(k[i]);
    for (int j = 0; j < NV; ++j) a0[j] = at::vec::fmadd(fVec::loadu(S + i * ld + j * VF), k0, a0[j]);
  }
  for (int j = 0; j < NV; ++j) acc[j] = a0[j] + a1[j];
}

// One token's pass over the tile's rows: S[i] = S[i] * alpha + k[i] u (kDecay; else S[i] + k[i] u);
// o += S[i] q[i]; and, with kNext, an += S[i] kn[i] (the next token's Sᵀk before its decay).
template <int NV, bool kNext, bool kDecay>
KV_GDN_INLINE void rank1(float* S, int64_t ld, int64_t K, const float* k, const float* q, const float* kn,
                         const fVec& va, const fVec* u, fVec* o, fVec* an) {
  constexpr int NR = NV >= 4 ? 1 : 2;  // row sets: independent chains for o and an
  fVec oa[NR][NV], aa[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NV; ++j) oa[r][j] = aa[r][j] = fVec(0.f);
  int64_t i = 0;
  for (; i + NR <= K; i += NR) {
    for (int r = 0; r < NR; ++r) {
      float* row = S + (i + r) * ld;
      const fVec ki(k[i + r]), qi(q[i + r]);
      const fVec kni(kNext ? kn[i + r] : 0.f);
      for (int j = 0; j < NV; ++j) {
        const fVec s = kDecay ? at::vec::fmadd(fVec::loadu(row + j * VF), va, ki * u[j])
                             : at::vec::fmadd(ki, u[j], fVec::loadu(row + j * VF));
        s.store(row + j * VF);
        oa[r][j] = at::vec::fmadd(s, qi, oa[r][j]);
        if (kNext) aa[r][j] = at::vec::fmadd(s, kni, aa[r][j]);
      }
    }
  }
  for (; i < K; ++i) {
    float* row = S + i * ld;
    const fVec ki(k[i]), qi(q[i]);
    const fVec kni(kNext ? kn[i] : 0.f);
    for (int j = 0; j < NV; ++j) {
      const fVec s = kDecay ? at::vec::fmadd(fVec::loadu(row + j * VF), va, ki * u[j])
                             : at::vec::fmadd(ki, u[j], fVec::loadu(row + j * VF));
      s.store(row + j * VF);
      oa[0][j] = at::vec::fmadd(s, qi, oa[0][j]);
      if (kNext) aa[0][j] = at::vec::fmadd(s, kni, aa[0][j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    o[j] = oa[0][j];
    if (kNext) an[j] = aa[0][j];
    for (int r = 1; r < NR; ++r) {
      o[j] = o[j] + oa[r][j];
      if (kNext) an[j] = an[j] + aa[r][j];
    }
  }
}

// Bounds of the lazy decay's scale c (below): past them the token folds c into the state.
constexpr float kScaleLo = 1e-18f, kScaleHi = 1e18f;

// A block's tokens through an NV-vector column tile: S points at its first column (rows ld
// apart), c is its column in the block's v and o rows.
//
// The decay is lazy: the tile holds S / c for a running scalar c (the product of the alphas since
// c was last folded in), so a token's pass is three FMAs per vector (S/c += k[i] (u / c), then the
// o and next-Sᵀk sums, scaled by c afterwards) instead of a mul and three FMAs. The block's last
// token, and any token that would take c out of [kScaleLo, kScaleHi] (alpha = 0 included), applies
// c * alpha to the state instead and resets c to 1, so the tile holds S itself between blocks.
template <int NV>
void tile(float* S, int64_t ld, const Blk& b, int64_t c) {
  const int64_t K = b.K;
  fVec acc[NV], u[NV], o[NV];
  st_k<NV>(S, ld, K, b.kf, acc);
  float scale = 1.f;  // c
  for (int64_t t = 0; t < b.n; ++t) {
    const float cn = scale * b.alpha[t];
    const fVec vcn(cn), vb(b.beta[t]);
    const float* vt = b.vf + t * b.Vr + c;
    // u = beta (v - alpha Sᵀk) with Sᵀk = c acc.
    for (int j = 0; j < NV; ++j) u[j] = vb * (fVec::loadu(vt + j * VF) - vcn * acc[j]);
    const float* kt = b.kf + t * K;
    const float* qt = b.qf + t * K;
    const bool next = t + 1 < b.n;
    if (!next || !(cn >= kScaleLo && cn <= kScaleHi)) {
      if (next) rank1<NV, true, true>(S, ld, K, kt, qt, kt + K, vcn, u, o, acc);
      else rank1<NV, false, true>(S, ld, K, kt, qt, nullptr, vcn, u, o, nullptr);
      scale = 1.f;
    } else {
      const fVec inv(1.f / cn);
      for (int j = 0; j < NV; ++j) u[j] = u[j] * inv;
      rank1<NV, true, false>(S, ld, K, kt, qt, kt + K, vcn, u, o, acc);
      for (int j = 0; j < NV; ++j) o[j] = o[j] * vcn;
      scale = cn;
    }
    float* ot = b.of + t * b.Vr + c;
    for (int j = 0; j < NV; ++j) o[j].store(ot + j * VF);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// Token pairs (AVX-512). A 512-bit store takes two cycles on current x86 cores (Zen 4/5 and
// Intel alike: one store port of 512 bits every other cycle, or one of 256 bits), so the one-token
// pass above (three FMAs, one store per vector) waits on its stores. Two tokens per pass halve
// them: with S0 the state before tokens 1 and 2 (scaled by c0, see tile) and S0ᵀk1, S0ᵀk2 from
// the pass before,
//   u1 = beta1 (v1 - alpha1 S0ᵀk1);   S1ᵀk2 = alpha1 S0ᵀk2 + (k1·k2) u1;   u2 = beta2 (v2 - alpha2 S1ᵀk2)
//   S2 = alpha1 alpha2 S0 + k1 (alpha2 u1)ᵀ + k2 u2ᵀ;   o1 = alpha1 S0ᵀq1 + (k1·q1) u1;   o2 = S2ᵀq2
// and the pass over S0 forms S0ᵀq1, S2 (two FMAs with the decay lazy), S2ᵀq2 and the next pair's
// S2ᵀk3, S2ᵀk4: six FMAs and one store per vector per two tokens.

// a1 = Sᵀk1 and, with NK = 2, a2 = Sᵀk2.
template <int NV, int NK>
KV_GDN_INLINE void st_k2(const float* S, int64_t ld, int64_t K, const float* k1, const float* k2, fVec* a1, fVec* a2) {
  fVec x0[NV], x1[NV], y0[NV], y1[NV];
  for (int j = 0; j < NV; ++j) x0[j] = x1[j] = y0[j] = y1[j] = fVec(0.f);
  int64_t i = 0;
#pragma GCC unroll 2
  for (; i + 2 <= K; i += 2) {
    const float* r0 = S + i * ld;
    const float* r1 = r0 + ld;
    for (int j = 0; j < NV; ++j) {
      const fVec s0 = fVec::loadu(r0 + j * VF), s1 = fVec::loadu(r1 + j * VF);
      x0[j] = at::vec::fmadd(s0, fVec(k1[i]), x0[j]);
      x1[j] = at::vec::fmadd(s1, fVec(k1[i + 1]), x1[j]);
      if (NK == 2) {
        y0[j] = at::vec::fmadd(s0, fVec(k2[i]), y0[j]);
        y1[j] = at::vec::fmadd(s1, fVec(k2[i + 1]), y1[j]);
      }
    }
  }
  for (; i < K; ++i)
    for (int j = 0; j < NV; ++j) {
      const fVec s0 = fVec::loadu(S + i * ld + j * VF);
      x0[j] = at::vec::fmadd(s0, fVec(k1[i]), x0[j]);
      if (NK == 2) y0[j] = at::vec::fmadd(s0, fVec(k2[i]), y0[j]);
    }
  for (int j = 0; j < NV; ++j) {
    a1[j] = x0[j] + x1[j];
    if (NK == 2) a2[j] = y0[j] + y1[j];
  }
}

// One token with its decay applied (the state is S itself before and after): S = alpha S + k u;
// o = Sᵀq; the next pair's Sᵀk1, Sᵀk2 (kNext = 2) or nothing.
template <int NV, int kNext>
KV_GDN_INLINE void one_pass(float* S, int64_t ld, int64_t K, const float* k, const float* q, const float* kn1,
                            const float* kn2, const fVec& va, const fVec* u, fVec* o, fVec* an1, fVec* an2) {
  fVec oa[NV], x[NV], y[NV];
  for (int j = 0; j < NV; ++j) oa[j] = x[j] = y[j] = fVec(0.f);
#pragma GCC unroll 4
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * ld;
    const fVec ki(k[i]), qi(q[i]);
    for (int j = 0; j < NV; ++j) {
      const fVec s = at::vec::fmadd(fVec::loadu(row + j * VF), va, ki * u[j]);
      s.store(row + j * VF);
      oa[j] = at::vec::fmadd(s, qi, oa[j]);
      if (kNext == 2) {
        x[j] = at::vec::fmadd(s, fVec(kn1[i]), x[j]);
        y[j] = at::vec::fmadd(s, fVec(kn2[i]), y[j]);
      }
    }
  }
  for (int j = 0; j < NV; ++j) {
    o[j] = oa[j];
    if (kNext == 2) {
      an1[j] = x[j];
      an2[j] = y[j];
    }
  }
}

// Two tokens' pass (above): dq = S0ᵀq1; S2 = S0 + k1 w1 + k2 w2 (lazy) or c2 S0 + k1 w1 + k2 w2
// (kDecay); o2 = S2ᵀq2; with kNext = 2 the next pair's S2ᵀk3, S2ᵀk4.
template <int NV, int kNext, bool kDecay>
KV_GDN_INLINE void pair_pass(float* S, int64_t ld, int64_t K, const float* k1, const float* k2, const float* q1,
                             const float* q2, const float* kn1, const float* kn2, const fVec& vc2, const fVec* w1,
                             const fVec* w2, fVec* dq, fVec* o2, fVec* an1, fVec* an2) {
  fVec d[NV], o[NV], x[NV], y[NV];
  for (int j = 0; j < NV; ++j) d[j] = o[j] = x[j] = y[j] = fVec(0.f);
  // Four rows per iteration (here and in one_pass; two row pairs in st_k2): one row's twelve FMAs
  // sit behind a load -> FMA -> FMA -> store chain, and rolled one row at a time the passes ran at
  // about half the FMA peak. Unrolled: 8-10% faster at 16-32 tokens, 4-8% from 128 (Intel Xeon
  // family 6 model 167, Hv=32, K=V=128, alternating runs; 8 rows measured as 4).
#pragma GCC unroll 4
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * ld;
    const fVec ki1(k1[i]), ki2(k2[i]), qi1(q1[i]), qi2(q2[i]);
    for (int j = 0; j < NV; ++j) {
      const fVec s0 = fVec::loadu(row + j * VF);
      d[j] = at::vec::fmadd(s0, qi1, d[j]);
      const fVec s = kDecay ? at::vec::fmadd(s0, vc2, at::vec::fmadd(ki2, w2[j], ki1 * w1[j]))
                            : at::vec::fmadd(ki2, w2[j], at::vec::fmadd(ki1, w1[j], s0));
      s.store(row + j * VF);
      o[j] = at::vec::fmadd(s, qi2, o[j]);
      if (kNext == 2) {
        x[j] = at::vec::fmadd(s, fVec(kn1[i]), x[j]);
        y[j] = at::vec::fmadd(s, fVec(kn2[i]), y[j]);
      }
    }
  }
  for (int j = 0; j < NV; ++j) {
    dq[j] = d[j];
    o2[j] = o[j];
    if (kNext == 2) {
      an1[j] = x[j];
      an2[j] = y[j];
    }
  }
}

// A block's tokens through an NV-vector tile in pairs: an odd block's first token alone (with
// its decay), then pairs, each pass forming the next pair's Sᵀk. The decay is lazy as in tile():
// the tile holds S / c; the block's last pair, and a pair that would take c (or c alpha1) out of
// [kScaleLo, kScaleHi], fold c into the state.
template <int NV>
void tile_pairs(float* S, int64_t ld, const Blk& b, int64_t c) {
  const int64_t K = b.K, n = b.n;
  fVec a1[NV], a2[NV], u1[NV], u2[NV], w1[NV], w2[NV], dq[NV], o1[NV], o2[NV];
  int64_t t = 0;
  if (n % 2) {
    st_k2<NV, 1>(S, ld, K, b.kf, nullptr, a1, nullptr);
    const fVec va(b.alpha[0]), vb(b.beta[0]);
    for (int j = 0; j < NV; ++j) u1[j] = vb * (fVec::loadu(b.vf + c + j * VF) - va * a1[j]);
    if (n > 1) one_pass<NV, 2>(S, ld, K, b.kf, b.qf, b.kf + K, b.kf + 2 * K, va, u1, o1, a1, a2);
    else one_pass<NV, 0>(S, ld, K, b.kf, b.qf, nullptr, nullptr, va, u1, o1, nullptr, nullptr);
    for (int j = 0; j < NV; ++j) o1[j].store(b.of + c + j * VF);
    t = 1;
  } else {
    st_k2<NV, 2>(S, ld, K, b.kf, b.kf + K, a1, a2);
  }
  float scale = 1.f;  // c
  for (; t < n; t += 2) {
    const float c1 = scale * b.alpha[t], c2 = c1 * b.alpha[t + 1];
    const fVec vc1(c1), vc2(c2), va2(b.alpha[t + 1]), vb1(b.beta[t]), vb2(b.beta[t + 1]);
    const fVec vkk(b.kk[t]), vkq(b.kq[t]);
    const float* v1 = b.vf + t * b.Vr + c;
    const float* v2 = v1 + b.Vr;
    for (int j = 0; j < NV; ++j) {
      u1[j] = vb1 * (fVec::loadu(v1 + j * VF) - vc1 * a1[j]);
      u2[j] = vb2 * (fVec::loadu(v2 + j * VF) - va2 * at::vec::fmadd(vkk, u1[j], vc1 * a2[j]));
    }
    const float* k1 = b.kf + t * K;
    const float* q1 = b.qf + t * K;
    const bool last = t + 2 >= n;
    if (!last && c1 >= kScaleLo && c1 <= kScaleHi && c2 >= kScaleLo && c2 <= kScaleHi) {
      const fVec i1(1.f / c1), i2(1.f / c2);
      for (int j = 0; j < NV; ++j) {
        w1[j] = u1[j] * i1;
        w2[j] = u2[j] * i2;
      }
      pair_pass<NV, 2, false>(S, ld, K, k1, k1 + K, q1, q1 + K, k1 + 2 * K, k1 + 3 * K, vc2, w1, w2, dq, o2, a1, a2);
      for (int j = 0; j < NV; ++j) o2[j] = o2[j] * vc2;
      scale = c2;
    } else {
      for (int j = 0; j < NV; ++j) {
        w1[j] = u1[j] * va2;
        w2[j] = u2[j];
      }
      if (last) pair_pass<NV, 0, true>(S, ld, K, k1, k1 + K, q1, q1 + K, nullptr, nullptr, vc2, w1, w2, dq, o2, a1, a2);
      else pair_pass<NV, 2, true>(S, ld, K, k1, k1 + K, q1, q1 + K, k1 + 2 * K, k1 + 3 * K, vc2, w1, w2, dq, o2, a1, a2);
      scale = 1.f;
    }
    float* ot = b.of + t * b.Vr + c;
    for (int j = 0; j < NV; ++j) {
      at::vec::fmadd(vkq, u1[j], vc1 * dq[j]).store(ot + j * VF);
      o2[j].store(ot + b.Vr + j * VF);
    }
  }
}
#endif

// A 64-byte aligned fp32 scratch, one per work range (thread).
struct Scratch {
  float* base = nullptr;
  explicit Scratch(size_t n) {
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    base = static_cast<float*>(std::aligned_alloc(64, bytes ? bytes : 64));
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

KV_GDN_INLINE size_t elsize(DType t) { return t == DType::F32 ? 4 : 2; }

// The scratch's layout: the fp32 state (K x Vr, tile-major), then q, k, v, o, alpha, beta of a block of up
// to `rows` tokens.
struct Layout {
  int64_t K, Vr, Kr, rows;
  size_t kf() const { return static_cast<size_t>(K * Vr); }
  size_t qf() const { return kf() + static_cast<size_t>(rows * Kr); }
  size_t vf() const { return qf() + static_cast<size_t>(rows * Kr); }
  size_t of() const { return vf() + static_cast<size_t>(rows * Vr); }
  size_t alpha() const { return of() + static_cast<size_t>(rows * Vr); }
  size_t beta() const { return alpha() + static_cast<size_t>(rows); }
  size_t kk() const { return beta() + static_cast<size_t>(rows); }
  size_t kq() const { return kk() + static_cast<size_t>(rows); }
  size_t total() const { return kq() + static_cast<size_t>(rows); }
};

// Token t's q or k row (head hk) into d [K] in fp32, L2-normalised as the reference
// (x * rsqrt(sum(x^2) + 1e-6)) and scaled.
KV_GDN_INLINE void qk_row(const Params& p, const void* base, int64_t st, int64_t sh, int64_t t, int64_t hk, float* d,
                          float scale) {
  const char* row = static_cast<const char*>(base) + (t * st + hk * sh) * elsize(p.qdtype);
  row_f32(row, p.qdtype, d, p.K, p.K);
  if (p.l2norm) scale_row(d, p.K, 1.f / std::sqrt(sum_sq(d, p.K) + 1e-6f));
  if (scale != 1.f) scale_row(d, p.K, scale);
}

// alpha = exp(g) and beta of token t, head h.
KV_GDN_INLINE void gating(const Params& p, int64_t t, int64_t h, float* alpha, float* beta) {
  const float x = scalar_f32(p.ga, p.gdtype, t * p.ga_st + h * p.ga_sh);
  const float y = scalar_f32(p.gb, p.gdtype, t * p.gb_st + h * p.gb_sh);
  if (!p.fused) {
    *alpha = std::exp(x);
    *beta = y;
    return;
  }
  // torch's softplus: x where beta * x passes the threshold, else log1p(exp(beta * x)) / beta.
  const float z = x + p.dt_bias[h], bz = p.sp_beta * z;
  const float sp = bz > p.sp_threshold ? z : std::log1p(std::exp(bz)) / p.sp_beta;
  *alpha = std::exp(-std::exp(p.A_log[h]) * sp);
  *beta = 1.f / (1.f + std::exp(-y));
}

// Tokens ahead whose rows are prefetched while a block's inputs are converted.
constexpr int64_t kAhead = 8;

KV_GDN_INLINE void prefetch_row(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
    if (write) __builtin_prefetch(c + i, 1, 3);
    else __builtin_prefetch(c + i, 0, 3);
  }
}

void zero_rows(const Params& p, const Seq& q, int64_t h) {
  char* out = static_cast<char*>(p.out);
  const size_t es = elsize(p.vdtype);
  for (int64_t t = 0; t < q.n; ++t) std::memset(out + ((q.t0 + t) * p.o_st + h * p.o_sh) * es, 0, es * p.V);
}

// Where a work item's state lives while its tokens run.
enum class Home {
  kSlot,       // the fp32 pool slot itself (rows V apart), for a sequence of one block: a copy
               // would cost two passes more than the L1 set conflicts of rows 2^k bytes apart do
               // (T = 2: 2x, T = 8: 1.3x faster in place; even from 32 tokens)
  kTileCopy,   // per column tile, a dense fp32 copy of the slot's tile: read before the block,
               // rounded back after it (a sequence of one block, so the state is rounded once)
  kTileMajor,  // the whole state in fp32, tile after tile, each tile dense: read before the first
               // block and rounded back after the last (or zeros, and nothing kept, without a slot)
};

// Column tiles: from vector c, the largest power of two of vectors up to tv (the item's tile
// width: kTile, or kTileOne for one token) that the Vr / VF along V still hold. A tile's
// rows are kept dense (tw floats apart) where it is copied: at the pool's row stride (V floats,
// often a multiple of 512 bytes) its rows would fall in a few L1 sets and evict each other every
// token.
KV_GDN_INLINE int tile_vectors(int64_t Vr, int64_t c, int tv) {
  const int64_t left = Vr / VF - c;
  int nv = tv;
  while (nv > left) nv /= 2;
  return nv;
}

// A dense [K, tw] fp32 tile <-> columns [col, col + cols) of a pool slot (rows V apart).
void tile_in(const Params& p, float* T, int64_t tw, const char* slot, int64_t col, int64_t cols, bool init) {
  const size_t es = elsize(p.sdtype);
  if (!init) {
    std::memset(T, 0, sizeof(float) * p.K * tw);
    return;
  }
  for (int64_t i = 0; i < p.K; ++i) row_f32(slot + (i * p.V + col) * es, p.sdtype, T + i * tw, cols, tw);
}
void tile_out(const Params& p, const float* T, int64_t tw, char* slot, int64_t col, int64_t cols) {
  const size_t es = elsize(p.sdtype);
  for (int64_t i = 0; i < p.K; ++i) row_from_f32(T + i * tw, slot + (i * p.V + col) * es, p.sdtype, cols);
}

// The whole state, tile-major in w, from a slot (or zeros), or back to it.
void state_in(const Params& p, float* w, int64_t Vr, int tv, const char* slot, bool init) {
  for (int64_t c = 0, nv = 0; c * VF < Vr; c += nv) {
    nv = tile_vectors(Vr, c, tv);
    const int64_t col = c * VF, tw = nv * VF;
    tile_in(p, w + p.K * col, tw, slot, col, std::min<int64_t>(tw, p.V - col), init && slot);
  }
}
void state_out(const Params& p, const float* w, int64_t Vr, int tv, char* slot) {
  for (int64_t c = 0, nv = 0; c * VF < Vr; c += nv) {
    nv = tile_vectors(Vr, c, tv);
    const int64_t col = c * VF, tw = nv * VF;
    tile_out(p, w + p.K * col, tw, slot, col, std::min<int64_t>(tw, p.V - col));
  }
}

// The block's tokens through every column tile of the state (tiles of up to tv vectors; see Home;
// w: the scratch's state).
void run_tiles(const Params& p, const Blk& blk, int tv, Home home, float* w, char* slot, bool init) {
  for (int64_t c = 0, nv = 0; c * VF < blk.Vr; c += nv) {
    nv = tile_vectors(blk.Vr, c, tv);
    const int64_t col = c * VF, tw = nv * VF, cols = std::min<int64_t>(tw, p.V - col);
    float* T = home == Home::kSlot ? reinterpret_cast<float*>(slot) + col : home == Home::kTileMajor ? w + p.K * col : w;
    const int64_t ld = home == Home::kSlot ? p.V : tw;
    if (home == Home::kTileCopy) tile_in(p, T, tw, slot, col, cols, init);
#if defined(CPU_CAPABILITY_AVX512)
    if (blk.n > 1) {
      if (nv == 2) tile_pairs<2>(T, ld, blk, col);
      else tile_pairs<1>(T, ld, blk, col);
    } else
#endif
    {
      switch (nv) {
#if defined(CPU_CAPABILITY_AVX512)
        case 8: tile<8>(T, ld, blk, col); break;
#endif
        case 4: tile<4>(T, ld, blk, col); break;
        case 2: tile<2>(T, ld, blk, col); break;
        default: tile<1>(T, ld, blk, col); break;
      }
    }
    if (home == Home::kTileCopy) tile_out(p, T, tw, slot, col, cols);
  }
}

// Which q/k head's rows the scratch holds (kf, qf, kk, kq): consecutive items of a sequence that
// fits one block share them when their v heads read the same q/k head (Qwen3-Next: pairs).
struct QkHeld {
  int64_t b = -1, hk = -1;
};

void run_item(const Params& p, const Layout& L, float* w, int64_t b, int64_t h, QkHeld& held) {
  const Seq& q = p.seqs[b];
  if (q.pad) {
    zero_rows(p, q, h);
    return;
  }
  const int64_t K = p.K, V = p.V, Vr = L.Vr;
  const int64_t hk = h / (p.Hv / p.Hk);
  const size_t es = elsize(p.sdtype);
  char* slot = p.state && q.slot >= 0 ? static_cast<char*>(p.state) + (q.slot * p.state_ss + h * K * V) * es : nullptr;
  if (q.n == 0) {  // an empty sequence writes its initial state: zeros unless it starts from the slot
    if (slot && !q.init) std::memset(slot, 0, es * K * V);  // zero bits are 0.0 in every dtype
    return;
  }
  const Home home = !slot || q.n > kBlock                  ? Home::kTileMajor
                    : p.sdtype == DType::F32 && Vr == V ? Home::kSlot
                                                         : Home::kTileCopy;
  if (home == Home::kSlot && !q.init) std::memset(slot, 0, sizeof(float) * K * V);
  const int tv = q.n == 1 ? kTileOne : kTile;  // as run_tiles
  if (home == Home::kTileMajor) state_in(p, w, Vr, tv, slot, q.init);
  float* kf = w + L.kf();
  float* qf = w + L.qf();
  float* vf = w + L.vf();
  float* of = w + L.of();
  float* alpha = w + L.alpha();
  float* beta = w + L.beta();
  float* kk = w + L.kk();
  float* kq = w + L.kq();
  const size_t ves = elsize(p.vdtype);
  const char* vin = static_cast<const char*>(p.v);
  char* out = static_cast<char*>(p.out);
  const bool reuse = q.n <= kBlock && held.b == b && held.hk == hk;
  held = q.n <= kBlock ? QkHeld{b, hk} : QkHeld{};
  for (int64_t t0 = 0; t0 < q.n; t0 += kBlock) {
    const int64_t n = std::min(kBlock, q.n - t0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t tt = q.t0 + t0 + t;
      // A head's rows of consecutive tokens lie a token's whole row apart (8 KiB for bf16 q, k at
      // Qwen3-Next's widths), on another page each: the hardware prefetchers do not follow them.
      if (t0 + t + kAhead < q.n) {
        const int64_t ta = tt + kAhead;
        const size_t qes = elsize(p.qdtype);
        prefetch_row(static_cast<const char*>(p.q) + (ta * p.q_st + hk * p.q_sh) * qes, K * qes, false);
        prefetch_row(static_cast<const char*>(p.k) + (ta * p.k_st + hk * p.k_sh) * qes, K * qes, false);
        prefetch_row(vin + (ta * p.v_st + h * p.v_sh) * ves, V * ves, false);
        prefetch_row(out + (ta * p.o_st + h * p.o_sh) * ves, V * ves, true);
      }
      if (!reuse) {
        qk_row(p, p.k, p.k_st, p.k_sh, tt, hk, kf + t * K, 1.f);
        qk_row(p, p.q, p.q_st, p.q_sh, tt, hk, qf + t * K, p.scale);
      }
      row_f32(vin + (tt * p.v_st + h * p.v_sh) * ves, p.vdtype, vf + t * Vr, V, Vr);
      gating(p, tt, h, alpha + t, beta + t);
    }
    // The pair passes' scalars (tile_pairs).
    for (int64_t t = 0; t < n && !reuse; ++t) {
      kk[t] = t + 1 < n ? dot(kf + t * K, kf + (t + 1) * K, K) : 0.f;
      kq[t] = dot(kf + t * K, qf + t * K, K);
    }
    run_tiles(p, Blk{kf, qf, vf, of, alpha, beta, kk, kq, n, K, Vr}, tv, home, w, slot, q.init);
    for (int64_t t = 0; t < n; ++t)
      out_from_f32(of + t * Vr, out + ((q.t0 + t0 + t) * p.o_st + h * p.o_sh) * ves, p.vdtype, V);
  }
  if (home == Home::kTileMajor && slot) state_out(p, w, Vr, tv, slot);
}

}  // namespace

void run_range(const Params& p, int64_t begin, int64_t end) {
  // Block rows for the longest sequence in the range: a decode step's scratch stays small (a
  // fresh mmap'd multi-100-KiB buffer per call costs its page faults every call).
  int64_t rows = 1;
  for (int64_t b = begin / p.Hv; b < (end + p.Hv - 1) / p.Hv; ++b) rows = std::max(rows, std::min(kBlock, p.seqs[b].n));
  const Layout L{p.K, round_up(p.V), round_up(p.K), rows};
  Scratch w(L.total());
  QkHeld held;
  for (int64_t i = begin; i < end; ++i) run_item(p, L, w.base, i / p.Hv, i % p.Hv, held);
}

}  // namespace KV_GDN_ISA_NS
}  // namespace kv_gdn
