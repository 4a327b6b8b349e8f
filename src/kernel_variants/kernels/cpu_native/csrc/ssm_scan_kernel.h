// Mamba2's selective scan (tied per-head A) for one (sequence, head) work item, token by token:
//   d  = dt (+ dt_bias), softplus, clamp;  dA = exp(d * A[h])
//   state[p, s] = state[p, s] * dA + d * x[p] * B[g, s]
//   y[p] = sum_s state[p, s] * C[g, s] (+ D[h] * x[p]), gated by silu(z[p]), rounded to x's dtype.
//
// Compiled once per ISA, like gemma_rms_norm_kernel.h: the including TU defines KV_SSM_ISA_NS
// (and, for SIMD builds, the target pragma and CPU_CAPABILITY macros from isa_<isa>.h) first.
//
// Layout: the state is kept [P, S] as in the pool and vectorised along S. One token updates row
// p with one load, one mul, one FMA (state * dA + d * x[p] * B) and one store per vector, and
// accumulates y[p] with one more FMA; B and C (the same for the whole token) sit in registers
// when S is a compile-time size (64, 128, 256). The VF row sums of a block of rows are formed
// together by a transpose-and-add tree (hsum_rows), so y costs ~1 op per row instead of a
// horizontal reduction each. The head's P x S fp32 state (32 KiB at 64 x 128) stays in L1/L2
// across the whole sequence: read from the pool (converted) by the first token, written back
// (rounded) by the last, in place when the pool is fp32. A one-token update of a 16-bit pool is
// one pass: load, convert, update, round, store.
//
// The scan also runs in the chunked (SSD) form (Params::chunk > 0; see run_item_chunked): per
// chunk of Q tokens three register-blocked products of GEMM shape instead of the token steps,
// ~2 multiply-adds per state element per token instead of 3 vector ops; the same dt processing,
// epilogue, pads and slots.
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
#include <limits>
#include <memory>
#include <type_traits>

#include "ssm_scan_params.h"

#ifndef KV_SSM_ISA_NS
#error "define KV_SSM_ISA_NS before including ssm_scan_kernel.h"
#endif

#if defined(__GNUC__)
#define KV_SSM_INLINE inline __attribute__((always_inline))
#else
#define KV_SSM_INLINE inline
#endif

namespace kv_ssm {
namespace KV_SSM_ISA_NS {

void run_range(const Params& p, int64_t begin, int64_t end);

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int VF = static_cast<int>(fVec::size());
using bf16 = c10::BFloat16;
using f16 = c10::Half;

// ---------------------------------------------------------------- I/O: VF elements <-> fVec
// Partial forms (n < VF) zero the lanes past n. Portable: through a float buffer.
template <class T>
struct Io {
  static KV_SSM_INLINE fVec load(const T* p, int n = VF) {
    alignas(64) float b[VF] = {};
    for (int i = 0; i < n; ++i) b[i] = static_cast<float>(p[i]);
    return fVec::loadu(b);
  }
  static KV_SSM_INLINE void store(T* p, const fVec& v, int n = VF) {
    alignas(64) float b[VF];
    v.store(b);
    for (int i = 0; i < n; ++i) p[i] = static_cast<T>(b[i]);
  }
};

template <>
struct Io<float> {
  static KV_SSM_INLINE fVec load(const float* p) { return fVec::loadu(p); }
  static KV_SSM_INLINE fVec load(const float* p, int n) {
    alignas(64) float b[VF] = {};
    std::memcpy(b, p, sizeof(float) * n);
    return fVec::loadu(b);
  }
  static KV_SSM_INLINE void store(float* p, const fVec& v) { v.store(p); }
  static KV_SSM_INLINE void store(float* p, const fVec& v, int n) { v.store(p, n); }
};

#if defined(CPU_CAPABILITY_AVX512)
// fp32 -> bf16 bits, round to nearest even (torch's rounding, denormals kept; NaN -> 0x7fc0),
// in the low 16 bits of each 32-bit lane.
KV_SSM_INLINE __m512i bf16_rne(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  __m512i t = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(0x7fff)), u), 16);
  const __mmask16 ord = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  return _mm512_mask_blend_epi32(ord, _mm512_set1_epi32(0x7fc0), t);
}
template <>
struct Io<bf16> {
  static KV_SSM_INLINE fVec widen(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static KV_SSM_INLINE fVec load(const bf16* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static KV_SSM_INLINE fVec load(const bf16* p, int n) {
    return widen(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
  }
  static KV_SSM_INLINE void store(bf16* p, const fVec& v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_rne(v)));
  }
  static KV_SSM_INLINE void store(bf16* p, const fVec& v, int n) {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), _mm512_cvtepi32_epi16(bf16_rne(v)));
  }
};
template <>
struct Io<f16> {
  static KV_SSM_INLINE fVec load(const f16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static KV_SSM_INLINE fVec load(const f16* p, int n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
  }
  static KV_SSM_INLINE void store(f16* p, const fVec& v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static KV_SSM_INLINE void store(f16* p, const fVec& v, int n) {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1),
                             _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

// Output (y) rounding. The AVX512-BF16 build narrows with one vcvtneps2bf16 (it flushes fp32
// denormals, fine for y within bf16's tolerance); the state keeps the exact software rounding,
// since a bf16 pool must hold what torch's .to(bfloat16) of the fp32 state would.
template <class T>
KV_SSM_INLINE void store_y(T* p, const fVec& v, int n) {
  if (n == VF) Io<T>::store(p, v); else Io<T>::store(p, v, n);
}
#if defined(KV_SSM_AVX512_BF16)
template <>
KV_SSM_INLINE void store_y<bf16>(bf16* p, const fVec& v, int n) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  if (n == VF) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  else _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), h);
}
#endif

// Lane i of the result = the sum of the lanes of a[i], i < 16: four levels of transpose-and-add
// (256-bit halves, 128-bit quarters, pairs, singles), 15 shuffles pairs and 15 adds for 16 rows.
// The tree leaves row 4k + i's sum in lane 4i + k for input slot 4k + i, so slots are filled
// from a[4 * (j % 4) + j / 4] to come out in row order.
KV_SSM_INLINE fVec hsum_rows(const fVec* a) {
  __m512 v[16];
  for (int j = 0; j < 16; ++j) v[j] = a[4 * (j % 4) + j / 4];
  __m512 r[8];
  for (int k = 0; k < 8; ++k)
    r[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  __m512 s[4];
  for (int k = 0; k < 4; ++k)
    s[k] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 t[2];
  for (int k = 0; k < 2; ++k)
    t[k] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * k], s[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * k], s[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#elif defined(CPU_CAPABILITY_AVX2)
KV_SSM_INLINE __m128i bf16_rne(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  __m256i t = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(t, _mm256_set1_epi32(0x7fff)), u), 16);
  const __m256 ord = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
  t = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)),
                                           _mm256_castsi256_ps(t), ord));
  // 32 -> 16 bits: packus works within 128-bit lanes; the qword permute gathers lanes 0 and 2.
  const __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(t, t), 0xD8);
  return _mm256_castsi256_si128(pk);
}
template <>
struct Io<bf16> {
  static KV_SSM_INLINE fVec widen(__m128i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
  static KV_SSM_INLINE fVec load(const bf16* p) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static KV_SSM_INLINE fVec load(const bf16* p, int n) {
    alignas(16) uint16_t b[8] = {};
    std::memcpy(b, p, sizeof(uint16_t) * n);
    return widen(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
  }
  static KV_SSM_INLINE void store(bf16* p, const fVec& v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_rne(v));
  }
  static KV_SSM_INLINE void store(bf16* p, const fVec& v, int n) {
    alignas(16) uint16_t b[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(b), bf16_rne(v));
    std::memcpy(p, b, sizeof(uint16_t) * n);
  }
};
template <>
struct Io<f16> {
  static KV_SSM_INLINE fVec load(const f16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static KV_SSM_INLINE fVec load(const f16* p, int n) {
    alignas(16) uint16_t b[8] = {};
    std::memcpy(b, p, sizeof(uint16_t) * n);
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
  }
  static KV_SSM_INLINE void store(f16* p, const fVec& v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static KV_SSM_INLINE void store(f16* p, const fVec& v, int n) {
    alignas(16) uint16_t b[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(b), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    std::memcpy(p, b, sizeof(uint16_t) * n);
  }
};
template <class T>
KV_SSM_INLINE void store_y(T* p, const fVec& v, int n) {
  if (n == VF) Io<T>::store(p, v); else Io<T>::store(p, v, n);
}

// Lane i = the sum of the lanes of a[i], i < 8 (see the AVX-512 version: row 2k + h's sum lands
// in lane 4h + k, so slot j takes a[4 * (j % 2) + j / 2]).
KV_SSM_INLINE fVec hsum_rows(const fVec* a) {
  __m256 v[8];
  for (int j = 0; j < 8; ++j) v[j] = a[4 * (j % 2) + j / 2];
  __m256 r[4];
  for (int k = 0; k < 4; ++k)
    r[k] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));
  __m256 t[2];
  for (int k = 0; k < 2; ++k)
    t[k] = _mm256_add_ps(_mm256_shuffle_ps(r[2 * k], r[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(r[2 * k], r[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#else  // portable
template <class T>
KV_SSM_INLINE void store_y(T* p, const fVec& v, int n) {
  Io<T>::store(p, v, n);
}
KV_SSM_INLINE fVec hsum_rows(const fVec* a) {
  alignas(64) float out[VF];
  for (int i = 0; i < VF; ++i) {
    alignas(64) float b[VF];
    a[i].store(b);
    float s = 0.f;
    for (int l = 0; l < VF; ++l) s += b[l];
    out[i] = s;
  }
  return fVec::loadu(out);
}
#endif

// n elements of T -> fp32 (vectorised, with a partial tail).
template <class T>
KV_SSM_INLINE void to_f32(const T* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + VF <= n; i += VF) Io<T>::load(s + i).store(d + i);
  if (i < n) Io<T>::load(s + i, static_cast<int>(n - i)).store(d + i, static_cast<int>(n - i));
}
KV_SSM_INLINE void row_f32(const void* s, DType t, float* d, int64_t n) {
  switch (t) {
    case DType::F32: to_f32(static_cast<const float*>(s), d, n); break;
    case DType::BF16: to_f32(static_cast<const bf16*>(s), d, n); break;
    case DType::F16: to_f32(static_cast<const f16*>(s), d, n); break;
  }
}
KV_SSM_INLINE float scalar_f32(const void* s, DType t, int64_t i) {
  switch (t) {
    case DType::BF16: return static_cast<float>(static_cast<const bf16*>(s)[i]);
    case DType::F16: return static_cast<float>(static_cast<const f16*>(s)[i]);
    default: return static_cast<const float*>(s)[i];
  }
}
// n elements of fp32 -> T (the state's rounding).
template <class T>
KV_SSM_INLINE void from_f32(const float* s, T* d, int64_t n) {
  int64_t i = 0;
  for (; i + VF <= n; i += VF) Io<T>::store(d + i, fVec::loadu(s + i));
  if (i < n) Io<T>::store(d + i, Io<float>::load(s + i, static_cast<int>(n - i)), static_cast<int>(n - i));
}

// One token's inputs for one head, in fp32. B, C are zero past S (to a whole vector) so a partial
// last vector adds nothing to y; the P-long rows are padded to whole vectors too.
struct Tok {
  float dA;
  const float* dx;  // [P] d * x
  const float* B;   // [S]
  const float* C;   // [S]
};

// One token's update of rows [0, P) of a head's [P, S] state, read from src and written to dst
// (the same rows, or another buffer: the first token reads the pool, the last writes it), and
// y [P] (whole vectors). NV: S / VF when S is one of the compiled sizes (B, C held in
// registers), 0 otherwise (any S, a partial last vector).
template <class Src, class Dst, int NV>
void step(const Src* src, Dst* dst, const Tok& k, int64_t P, int64_t S, float* y) {
  // src and dst may be the same rows (an in-place update): each element is read by the
  // iteration that then writes it, so no restrict here.
  const int64_t nv = NV ? NV : S / VF;
  const int tail = NV ? 0 : static_cast<int>(S % VF);
  const fVec vdA(k.dA);
  constexpr int NR = NV ? NV : 1;
  fVec vb[NR], vc[NR];
  if (NV)
    for (int j = 0; j < NR; ++j) {
      vb[j] = fVec::loadu(k.B + j * VF);
      vc[j] = fVec::loadu(k.C + j * VF);
    }
  fVec accs[VF];
  for (int64_t p0 = 0; p0 < P; p0 += VF) {
    const int rows = static_cast<int>(std::min<int64_t>(VF, P - p0));
    for (int r = 0; r < rows; ++r) {
      const int64_t p = p0 + r;
      const Src* si = src + p * S;
      Dst* so = dst + p * S;
      const fVec vdx(k.dx[p]);
      // Two accumulators halve the dependent FMA chain of a row.
      fVec acc0(0.f), acc1(0.f);
      if (NV) {
#pragma GCC unroll 16
        for (int j = 0; j < NR; ++j) {
          const fVec s = at::vec::fmadd(Io<Src>::load(si + j * VF), vdA, vdx * vb[j]);
          Io<Dst>::store(so + j * VF, s);
          if (j % 2) acc1 = at::vec::fmadd(s, vc[j], acc1); else acc0 = at::vec::fmadd(s, vc[j], acc0);
        }
      } else {
        int64_t j = 0;
        for (; j < nv; ++j) {
          const fVec s = at::vec::fmadd(Io<Src>::load(si + j * VF), vdA, vdx * fVec::loadu(k.B + j * VF));
          Io<Dst>::store(so + j * VF, s);
          acc0 = at::vec::fmadd(s, fVec::loadu(k.C + j * VF), acc0);
        }
        if (tail) {
          const fVec s = at::vec::fmadd(Io<Src>::load(si + j * VF, tail), vdA, vdx * fVec::loadu(k.B + j * VF));
          Io<Dst>::store(so + j * VF, s, tail);
          acc1 = at::vec::fmadd(s, fVec::loadu(k.C + j * VF), acc1);
        }
      }
      accs[r] = acc0 + acc1;
    }
    for (int r = rows; r < VF; ++r) accs[r] = fVec(0.f);
    hsum_rows(accs).store(y + p0);
  }
}

// The compiled sizes of S: 64, 128, 256 (Mamba2's dstate values), else the generic loop.
template <class Src, class Dst>
void step_any(const Src* src, Dst* dst, const Tok& k, int64_t P, int64_t S, float* y) {
  switch (S) {
    case 4 * VF: step<Src, Dst, 4>(src, dst, k, P, S, y); break;
    case 8 * VF: step<Src, Dst, 8>(src, dst, k, P, S, y); break;
    case 16 * VF: step<Src, Dst, 16>(src, dst, k, P, S, y); break;
    default: step<Src, Dst, 0>(src, dst, k, P, S, y); break;
  }
}

// Pool element type T; `first`/`last`: whether src / dst are the pool's rows (else the fp32 work).
template <class T>
void step_pool(const void* src, bool src_pool, void* dst, bool dst_pool, const Tok& k, int64_t P, int64_t S,
               float* y) {
  if (src_pool && dst_pool)
    step_any(static_cast<const T*>(src), static_cast<T*>(dst), k, P, S, y);
  else if (src_pool)
    step_any(static_cast<const T*>(src), static_cast<float*>(dst), k, P, S, y);
  else if (dst_pool)
    step_any(static_cast<const float*>(src), static_cast<T*>(dst), k, P, S, y);
  else
    step_any(static_cast<const float*>(src), static_cast<float*>(dst), k, P, S, y);
}

inline int64_t round_up(int64_t n) { return (n + VF - 1) / VF * VF; }

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

KV_SSM_INLINE size_t elsize(DType t) { return t == DType::F32 ? 4 : 2; }

template <class XT>
void zero_rows(const Params& p, const Seq& q, int64_t b, int64_t h) {
  XT* out = static_cast<XT*>(p.out);
  for (int64_t t = 0; t < q.n; ++t)
    std::memset(out + b * p.o_sb + (q.t0 + t) * p.o_st + h * p.o_sh, 0, sizeof(XT) * p.P);
}

// d and dA = exp(d * A) of a head's tokens [t, t + n): dt (+ bias), softplus (torch's, threshold
// 20), clamp, a vector of tokens at a time (as per-token scalars, softplus's expf and log1pf and
// the exp were ~3% of the AVX2 build's chunked prefill at 64 heads). d, dA: whole vectors (room for
// round_up(n)); the lanes past n hold d = 0, dA = 1.
KV_SSM_INLINE void dt_chunk(const Params& p, const Seq& q, int64_t b, int64_t t, int64_t n, int64_t h, float A,
                            float* d, float* dA) {
  const float bias = p.dt_bias ? p.dt_bias[h] : 0.f;
  const int64_t at = b * p.dt_sb + (q.t0 + t) * p.dt_st + h * p.dt_sh;
  for (int64_t i = 0; i < n; ++i) {
    float v = scalar_f32(p.dt, p.dtdtype, at + i * p.dt_st);
    if (p.dt_bias) v += bias;
    d[i] = v;
  }
  const int64_t nr = (n + VF - 1) / VF * VF;
  for (int64_t i = n; i < nr; ++i) d[i] = 0.f;
  const fVec thr(20.f), lo(p.dt_min), hi(p.dt_max), vA(A);
  for (int64_t i = 0; i < nr; i += VF) {
    fVec v = fVec::loadu(d + i);
    // torch's softplus: x > 20 ? x : log1p(exp(x)) (NaN stays NaN: the compare is false).
    if (p.softplus) v = fVec::blendv(v.exp().log1p(), v, v > thr);
    if (p.clamp) v = at::vec::minimum(at::vec::maximum(v, lo), hi);
    v.store(d + i);
    (v * vA).exp().store(dA + i);
  }
  for (int64_t i = n; i < nr; ++i) {
    d[i] = 0.f;
    dA[i] = 1.f;
  }
}

// One vector of y's epilogue, both forms': y + D x (x: the vector's fp32 x, or null without D),
// times silu(z) (z: the gate's vector, or null).
KV_SSM_INLINE fVec epilogue(fVec y, const fVec& vD, const float* x, const fVec* z) {
  if (x) y = at::vec::fmadd(vD, fVec::loadu(x), y);
  if (z) y = y * *z / (fVec(1.f) + (fVec(0.f) - *z).exp());
  return y;
}

// One token's epilogue over P: y (+ D * x), silu(z) gate, rounded to x's dtype into o. zrow:
// the token's z row or null; zf: fp32 room for it.
template <class XT>
KV_SSM_INLINE void finish_row(const Params& p, const float* y, const float* xf, const XT* zrow, float* zf, float Dh,
                              XT* o) {
  const int64_t P = p.P;
  if (zrow) to_f32(zrow, zf, P);
  const fVec vD(Dh);
  for (int64_t i = 0; i < P; i += VF) {
    const fVec zv = zrow ? fVec::loadu(zf + i) : fVec(0.f);
    const fVec yv = epilogue(fVec::loadu(y + i), vD, p.D ? xf + i : nullptr, zrow ? &zv : nullptr);
    store_y<XT>(o + i, yv, static_cast<int>(std::min<int64_t>(VF, P - i)));
  }
}

// Tokens ahead whose rows are prefetched: one token of one head is ~1000 cycles of work.
constexpr int64_t kAhead = 2;

KV_SSM_INLINE void prefetch_row(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
    if (write) __builtin_prefetch(c + i, 1, 3);
    else __builtin_prefetch(c + i, 0, 3);
  }
}

// One (sequence, head) item, x / z / out of type XT.
template <class XT>
void run_item(const Params& p, float* w, int64_t b, int64_t h) {
  const Seq& q = p.seqs[b];
  if (q.pad) {
    zero_rows<XT>(p, q, b, h);
    return;
  }
  const int64_t P = p.P, S = p.S, Pr = round_up(P), Sr = round_up(S);
  const int64_t g = h / (p.H / p.G);
  const size_t es = elsize(p.sdtype);
  char* pool = static_cast<char*>(p.state);
  const int64_t head_off = h * P * S;
  void* src = pool && q.src >= 0 ? pool + (q.src * p.state_ss + head_off) * es : nullptr;
  void* dst = pool && q.dst >= 0 ? pool + (q.dst * p.state_ss + head_off) * es : nullptr;
  // Scratch: the fp32 work state (unless it is the fp32 pool's dst rows), B, C, x, d*x, z, y.
  float* work = w;
  float* Bf = work + P * S;
  float* Cf = Bf + Sr;
  float* xf = Cf + Sr;
  float* dx = xf + Pr;
  float* zf = dx + Pr;
  float* y = zf + Pr;
  const bool f32_pool = p.sdtype == DType::F32;
  if (dst && f32_pool) work = static_cast<float*>(dst);
  // No initial state: the first token reads zeros from the work rows.
  const bool from_pool = src != nullptr;
  if (!from_pool && (q.n > 0 || dst)) std::memset(work, 0, sizeof(float) * P * S);
  if (q.n == 0) {  // an empty sequence writes its initial state to its slot
    if (dst && dst != src) {
      if (from_pool) std::memcpy(dst, src, es * P * S);
      else if (!f32_pool) std::memset(dst, 0, es * P * S);  // zero bits are 0.0 in every dtype
    }
    return;
  }
  std::fill(Bf + S, Bf + Sr, 0.f);
  std::fill(Cf + S, Cf + Sr, 0.f);
  const float A = p.A[h], Dh = p.D ? p.D[h] : 0.f;
  const XT* x = static_cast<const XT*>(p.x);
  const XT* z = static_cast<const XT*>(p.z);
  XT* out = static_cast<XT*>(p.out);
  const size_t bes = elsize(p.bdtype);
  const char* Bm = static_cast<const char*>(p.B);
  const char* Cm = static_cast<const char*>(p.C);
  alignas(64) float dv[VF], dAv[VF];  // d and exp(d A) of the vector of tokens t is in
  for (int64_t t = 0; t < q.n; ++t) {
    const int64_t tt = q.t0 + t;
    // A head's rows of consecutive tokens are H * P elements apart (8 KiB for bf16 at 64 x 64):
    // each on another page, which the hardware prefetchers do not follow; a long sequence's x,
    // z and out live in L3 or DRAM. Ask for token t + kAhead's rows now.
    if (t + kAhead < q.n) {
      const int64_t ta = tt + kAhead;
      prefetch_row(x + b * p.x_sb + ta * p.x_st + h * p.x_sh, P * sizeof(XT), false);
      if (z) prefetch_row(z + b * p.z_sb + ta * p.z_st + h * p.z_sh, P * sizeof(XT), false);
      prefetch_row(out + b * p.o_sb + ta * p.o_st + h * p.o_sh, P * sizeof(XT), true);
      prefetch_row(Bm + (b * p.b_sb + ta * p.b_st + g * p.b_sg) * bes, S * bes, false);
      prefetch_row(Cm + (b * p.c_sb + ta * p.c_st + g * p.c_sg) * bes, S * bes, false);
    }
    if (t % VF == 0) dt_chunk(p, q, b, t, std::min<int64_t>(VF, q.n - t), h, A, dv, dAv);
    const float d = dv[t % VF];
    to_f32(x + b * p.x_sb + tt * p.x_st + h * p.x_sh, xf, P);
    const fVec vd(d);
    for (int64_t i = 0; i < Pr; i += VF) (vd * fVec::loadu(xf + i)).store(dx + i);
    row_f32(Bm + (b * p.b_sb + tt * p.b_st + g * p.b_sg) * bes, p.bdtype, Bf, S);
    row_f32(Cm + (b * p.c_sb + tt * p.c_st + g * p.c_sg) * bes, p.bdtype, Cf, S);
    const Tok k{dAv[t % VF], dx, Bf, Cf};
    const bool first = t == 0, last = t == q.n - 1;
    // Source: the pool's rows for the first token (when there is an initial state), else the
    // work state; destination: the pool's rows for the last token, else the work state. With
    // an fp32 pool the work state is the destination slot itself.
    const bool src_pool = first && from_pool, dst_pool = last && dst;
    const void* s_ptr = src_pool ? src : work;
    void* d_ptr = dst_pool ? dst : work;
    switch (p.sdtype) {
      case DType::F32: step_any(static_cast<const float*>(s_ptr), static_cast<float*>(d_ptr), k, P, S, y); break;
      case DType::BF16: step_pool<bf16>(s_ptr, src_pool, d_ptr, dst_pool, k, P, S, y); break;
      case DType::F16: step_pool<f16>(s_ptr, src_pool, d_ptr, dst_pool, k, P, S, y); break;
    }
    finish_row<XT>(p, y, xf, z ? z + b * p.z_sb + tt * p.z_st + h * p.z_sh : nullptr, zf, Dh,
                   out + b * p.o_sb + tt * p.o_st + h * p.o_sh);
  }
}

// ---------------------------------------------------------------- the chunked (SSD) form
// A sequence in chunks of Q tokens. With dA_j = exp(d_j * A) and, inside a chunk, the decay from
// token k to token t L[t][k] = dA_{k+1} ... dA_t (1 on the diagonal), from the chunk's start
// din[t] = dA_0 ... dA_t and to its end tail[k] = dA_{k+1} ... dA_{q-1}, the state S0 the chunk
// starts from gives
//   y[t]  = din[t] * (C[t] . S0) + sum_{k<=t} (C[t] . B[k]) L[t][k] d_k x[k]
//   S_end = din[q-1] * S0 + sum_k tail[k] d_k x[k] B[k]^T
// three products of GEMM shape per chunk ([q x S][S x P], [q x q][q x P] below the diagonal,
// [S x q][q x P]) instead of three vector ops per state element per token. The decays are
// products of the fp32 dA (the reference's own factors, summed by no difference of prefix
// sums). C . B^T [q x q] is the same for all heads of a group: it is formed once per (sequence,
// group) and chunk and kept for the following heads of the range.
//
// Layout: the work state is kept transposed, ST [S x Pr], so all three products run along P:
// accumulators of MR rows x NB vectors of P, B operands broadcast one scalar at a time. It is
// transposed from the pool once per sequence and back once at the end.

constexpr int MR = 6;                   // rows of a register block
constexpr int NB = VF >= 16 ? 4 : 2;   // vectors of a register block: 24 (of 32) / 12 (of 16) registers
using Acc = fVec[MR][NB];

// acc[r][v] += sum_{k < K} A[r * lda + k * ak] * Bm[k * ldb + v * VF], r < R, v < NV.
template <int R, int NV>
KV_SSM_INLINE void mk(int64_t K, const float* A, int64_t lda, int64_t ak, const float* Bm, int64_t ldb, Acc& acc) {
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = Bm + k * ldb;
    const float* a = A + k * ak;
    fVec bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = fVec::loadu(bk + v * VF);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const fVec ar(a[r * lda]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(ar, bv[v], acc[r][v]);
    }
  }
}

template <int R, int NV>
KV_SSM_INLINE void acc_zero(Acc& acc) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = fVec(0.f);
}

template <int R, int NV>
KV_SSM_INLINE void acc_store(const Acc& acc, float* o, int64_t ld) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(o + r * ld + v * VF);
}

// Runs op.run<R, NV>(r0, v0) over rows [0, rows) in blocks of MR and vectors [0, nvec) in
// blocks of NB, the remainders with smaller blocks.
// A block of 1 or 2 rows of at most 2 vectors (the AVX2 build's blocks) has 2 or 4 accumulators,
// too few chains to cover the FMA latency: it runs at half rate or less (the 2 rows left of
// S = 128 or Q = 32 in blocks of 6 were ~9% of the AVX2 y product's time). Such a remainder
// takes the last full block with it, as 4 rows and 3 or 4.
template <int NV, class Op>
void rows_of(const Op& op, int64_t rows, int64_t v0) {
  int64_t r0 = 0;
  const int64_t rem = rows % MR;
  const int64_t full = NV <= 2 && rows > MR && rem > 0 && rem < 3 ? rows - MR - rem : rows;
  for (; r0 + MR <= full; r0 += MR) op.template run<MR, NV>(r0, v0);
  if (full != rows) {
    op.template run<4, NV>(r0, v0);
    r0 += 4;
  }
  switch (rows - r0) {
    case 1: op.template run<1, NV>(r0, v0); break;
    case 2: op.template run<2, NV>(r0, v0); break;
    case 3: op.template run<3, NV>(r0, v0); break;
    case 4: op.template run<4, NV>(r0, v0); break;
    case 5: op.template run<5, NV>(r0, v0); break;
    default: break;
  }
}
template <class Op>
void grid(const Op& op, int64_t rows, int64_t nvec) {
  int64_t v0 = 0;
  for (; v0 + NB <= nvec; v0 += NB) rows_of<NB>(op, rows, v0);
  switch (nvec - v0) {
    case 1: rows_of<1>(op, rows, v0); break;
    case 2: if constexpr (NB > 2) rows_of<2>(op, rows, v0); break;
    case 3: if constexpr (NB > 3) rows_of<3>(op, rows, v0); break;
    default: break;
  }
}

// CB[t][k] = C[t] . B[k] (rows of Qr), from Cf [q x S] and BT [S x Qr].
struct CbOp {
  const float* Cf;
  const float* BT;
  float* CB;
  int64_t S, Qr;
  template <int R, int NV>
  KV_SSM_INLINE void run(int64_t t0, int64_t v0) const {
    Acc acc;
    acc_zero<R, NV>(acc);
    mk<R, NV>(S, Cf + t0 * S, S, 1, BT + v0 * VF, Qr, acc);
    acc_store<R, NV>(acc, CB + t0 * Qr + v0 * VF, Qr);
  }
};

// The rows of token i of a head's next chunk (x, z, out, B, C: strided by H * P, which no hardware
// prefetcher follows), asked for a chunk's work (~Q x 500 cycles) ahead of their use, spread over
// the y products (a burst of them fills the miss buffers).
struct NextRows {
  const char *x, *z, *o, *B, *C;  // token 0's rows; null x: no next chunk, null B: B and C cached
  int64_t xs, zs, os, bs, cs;     // byte strides between tokens
  int64_t xbytes, sbytes, n;      // row sizes; tokens in the next chunk
  KV_SSM_INLINE void token(int64_t i) const {
    if (!x || i >= n) return;
    prefetch_row(x + i * xs, xbytes, false);
    if (z) prefetch_row(z + i * zs, xbytes, false);
    prefetch_row(o + i * os, xbytes, true);
    if (!B) return;
    prefetch_row(B + i * bs, sbytes, false);
    prefetch_row(C + i * cs, sbytes, false);
  }
};

// y[t] = din[t] * (C[t] . S0) + sum_{k <= t} M[t][k] dx[k] (M: C B^T times the decays, zero
// above the diagonal). Rows t of the block need k < t0 + R only. finish_row's epilogue is applied
// to the block in registers: y + D x, the silu(z) gate, rounded into out's rows (o, z: token 0's
// rows of the chunk, os, zs apart), with no fp32 y written and read back.
template <class XT>
struct YOp {
  const NextRows* next;
  const float* Cf;
  const float* ST;
  const float* M;
  const float* dx;
  const float* din;
  const float* xf;
  const XT* z;
  XT* o;
  int64_t zs, os;
  float Dh;
  bool hasD;
  int64_t S, P, Pr, Qr, q;
  bool state;  // S0 is not all zeros
  template <int R, int NV>
  KV_SSM_INLINE void run(int64_t t0, int64_t v0) const {
    if (v0 == 0)
      for (int r = 0; r < R; ++r) next->token(t0 + r);
    Acc acc;
    acc_zero<R, NV>(acc);
    const int64_t p0 = v0 * VF;
    if (state) {
      mk<R, NV>(S, Cf + t0 * S, S, 1, ST + p0, Pr, acc);
      for (int r = 0; r < R; ++r) {
        const fVec sc(din[t0 + r]);
        for (int v = 0; v < NV; ++v) acc[r][v] = acc[r][v] * sc;
      }
    }
    mk<R, NV>(std::min<int64_t>(t0 + R, q), M + t0 * Qr, Qr, 1, dx + p0, Pr, acc);
    const fVec vD(Dh);
    for (int r = 0; r < R; ++r) {
      const float* xr = xf + (t0 + r) * Pr;
      XT* orow = o + (t0 + r) * os;
      for (int v = 0; v < NV; ++v) {
        const int64_t i = p0 + v * VF;
        const int n = static_cast<int>(std::min<int64_t>(VF, P - i));
        const XT* zr = z ? z + (t0 + r) * zs + i : nullptr;
        const fVec zv = !zr ? fVec(0.f) : n == VF ? Io<XT>::load(zr) : Io<XT>::load(zr, n);
        store_y<XT>(orow + i, epilogue(acc[r][v], vD, hasD ? xr + i : nullptr, zr ? &zv : nullptr), n);
      }
    }
  }
};

// ST[s] = whole * ST[s] + sum_k B[k][s] dxt[k] (dxt[k] = tail[k] d_k x[k]).
struct StOp {
  const float* Bf;
  const float* dxt;
  float* ST;
  float whole;
  int64_t S, Pr, q;
  bool state;
  template <int R, int NV>
  KV_SSM_INLINE void run(int64_t s0, int64_t v0) const {
    Acc acc;
    const int64_t p0 = v0 * VF;
    float* o = ST + s0 * Pr + p0;
    if (state) {
      const fVec w(whole);
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = fVec::loadu(o + r * Pr + v * VF) * w;
    } else {
      acc_zero<R, NV>(acc);
    }
    mk<R, NV>(q, Bf + s0, 1, S, dxt + p0, Pr, acc);
    acc_store<R, NV>(acc, o, Pr);
  }
};

inline int64_t round_to(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The chunked path's fp32 buffers, one set per work range (thread).
struct ChunkWork {
  int64_t Q, Qr, Pr, S;
  float *ST, *tmp, *Bf, *Cf, *BT, *xf, *dx, *dxt, *M, *cb1, *Rw, *dA, *din, *dd;
  // Per chunk of the (sequence, group) below: its C B^T [Q x Qr] and (bc_cached) its B and C
  // [Q x S] in fp32, formed by the first head of the group and read by the others; or null.
  float* cache = nullptr;
  int64_t cache_chunks = 0;  // chunks it holds room for
  int64_t per_chunk = 0;     // floats per chunk
  int64_t cb_floats = 0;     // C B^T's part of them
  bool bc_cached = false;
  int64_t key_b = -1, key_g = -1;
  std::unique_ptr<Scratch> mem;

  ChunkWork(const Params& p, int64_t max_tokens) {
    Q = p.chunk;
    Qr = round_up(Q);
    Pr = round_up(p.P);
    S = p.S;
    const int64_t sizes[] = {S * Pr, p.P * S, Q * S, Q * S, S * Qr, Q * Pr, Q * Pr, Q * Pr,
                             Q * Qr, Q * Qr, Qr + VF, Qr, Qr, Qr};
    float** ptrs[] = {&ST, &tmp, &Bf, &Cf, &BT, &xf, &dx, &dxt, &M, &cb1, &Rw, &dA, &din, &dd};
    // Room for every chunk of the longest sequence, up to kCacheBytes: C B^T, B and C where they
    // fit (~1.3 KiB a token at Q = 32, S = 128), else C B^T alone (each head converts B and C),
    // else nothing (each head also forms its own C B^T, chunk by chunk).
    constexpr int64_t kCacheBytes = int64_t{8} << 20;
    const int64_t chunks = (max_tokens + Q - 1) / Q;
    cb_floats = round_to(Q * Qr, 16);
    const auto fits = [&](int64_t floats) { return chunks * floats * int64_t{4} <= kCacheBytes; };
    if (fits(cb_floats + 2 * round_to(Q * S, 16))) {
      per_chunk = cb_floats + 2 * round_to(Q * S, 16);
      bc_cached = true;
    } else if (fits(cb_floats)) {
      per_chunk = cb_floats;
    }
    cache_chunks = per_chunk ? chunks : 0;
    int64_t total = 0;
    for (int64_t n : sizes) total += round_to(n, 16);
    mem = std::make_unique<Scratch>(static_cast<size_t>(total + cache_chunks * per_chunk));
    std::memset(mem->base, 0, sizeof(float) * static_cast<size_t>(total));  // the pads past P, S, q stay 0
    float* at = mem->base;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
      *ptrs[i] = at;
      at += round_to(sizes[i], 16);
    }
    if (cache_chunks) cache = at;
  }
};

// src [M x N] (rows ld_src apart) -> dst [N x M] (rows ld_dst apart). ATen's AVX-512 build
// transposes 16 x 16 blocks at any M, N; its AVX2 one only a fixed 8 x 8 (its any-size form is
// the scalar loop), so the AVX2 build goes by 8 x 8 blocks and a scalar rim.
KV_SSM_INLINE void transpose(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t M, int64_t N) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  const int64_t M8 = M / 8 * 8, N8 = N / 8 * 8;
  for (int64_t i = 0; i < M8; i += 8)
    for (int64_t j = 0; j < N8; j += 8)
      at::vec::transpose_mxn<float, 8, 8>(src + i * ld_src + j, ld_src, dst + j * ld_dst + i, ld_dst);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = i < M8 ? N8 : 0; j < N; ++j) dst[j * ld_dst + i] = src[i * ld_src + j];
#else
  at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, static_cast<int>(M), static_cast<int>(N));
#endif
}

// Rows [t0, t0 + qn) of sequence b's B and C (group g) as fp32 [qn x S].
KV_SSM_INLINE void load_bc(const Params& p, const Seq& sq, int64_t b, int64_t g, int64_t t0, int64_t qn, float* Bf,
                           float* Cf) {
  const size_t bes = elsize(p.bdtype);
  const char* Bm = static_cast<const char*>(p.B);
  const char* Cm = static_cast<const char*>(p.C);
  for (int64_t i = 0; i < qn; ++i) {
    const int64_t tt = sq.t0 + t0 + i;
    row_f32(Bm + (b * p.b_sb + tt * p.b_st + g * p.b_sg) * bes, p.bdtype, Bf + i * p.S, p.S);
    row_f32(Cm + (b * p.c_sb + tt * p.c_st + g * p.c_sg) * bes, p.bdtype, Cf + i * p.S, p.S);
  }
}

// The chunk [t0, t0 + qn)'s B and C in fp32 into Bf, Cf [qn x S] and C . B^T into cb [qn x Qr].
void chunk_cb(const Params& p, const Seq& sq, int64_t b, int64_t g, int64_t t0, int64_t qn, ChunkWork& w, float* cb,
              float* Bf, float* Cf) {
  load_bc(p, sq, b, g, t0, qn, Bf, Cf);
  transpose(Bf, w.S, w.BT, w.Qr, qn, w.S);
  grid(CbOp{Cf, w.BT, cb, w.S, w.Qr}, qn, (qn + VF - 1) / VF);
}

// The pool's [P x S] rows (type T) -> ST [S x Pr] fp32, and back (rounded to T).
template <class T>
void state_in(const void* src, ChunkWork& w, int64_t P) {
  const float* rows = static_cast<const float*>(src);
  if constexpr (!std::is_same<T, float>::value) {
    to_f32(static_cast<const T*>(src), w.tmp, P * w.S);
    rows = w.tmp;
  }
  transpose(rows, w.S, w.ST, w.Pr, P, w.S);
}
template <class T>
void state_out(void* dst, ChunkWork& w, int64_t P) {
  if constexpr (std::is_same<T, float>::value) {
    transpose(w.ST, w.Pr, static_cast<float*>(dst), w.S, w.S, P);
  } else {
    transpose(w.ST, w.Pr, w.tmp, w.S, w.S, P);
    from_f32(w.tmp, static_cast<T*>(dst), P * w.S);
  }
}

// Below this many tokens a sequence goes token by token: the chunked form's set-up per head
// costs more than it saves. With an initial state (transposed in, and a first chunk that reads
// it) the crossover is ~10 tokens in the AVX-512 builds, ~25 in the AVX2 one (12 accumulators);
// from zeros the first chunk has no C . S0 product and the chunked form is ahead from 3 tokens
// (1.2x at 4, 1.5x at 8). Measured on Zen 5 at H = 64, P = 64, S = 128.
constexpr int64_t kMinChunkTokens = VF >= 16 ? 10 : 24;
constexpr int64_t kMinChunkTokensFromZeros = 3;

// One (sequence, head) item in the chunked form. Padded, empty and short sequences go token by
// token (which handles the first two: zero rows, the initial state copied).
template <class XT>
void run_item_chunked(const Params& p, float* wrec, ChunkWork& w, int64_t b, int64_t h) {
  const Seq& sq = p.seqs[b];
  const bool has_src = p.state && sq.src >= 0;
  if (sq.pad || sq.n < (has_src ? kMinChunkTokens : kMinChunkTokensFromZeros)) {
    run_item<XT>(p, wrec, b, h);
    return;
  }
  const int64_t P = p.P, S = p.S, Pr = w.Pr, Q = w.Q, Qr = w.Qr;
  const int64_t g = h / (p.H / p.G);
  const int64_t nch = (sq.n + Q - 1) / Q;
  const bool cached = nch <= w.cache_chunks, bc_cached = cached && w.bc_cached;
  if (cached && (w.key_b != b || w.key_g != g)) {
    for (int64_t c = 0; c < nch; ++c) {
      float* e = w.cache + c * w.per_chunk;
      float* Bf = w.bc_cached ? e + w.cb_floats : w.Bf;
      float* Cf = w.bc_cached ? Bf + round_to(Q * S, 16) : w.Cf;
      chunk_cb(p, sq, b, g, c * Q, std::min(Q, sq.n - c * Q), w, e, Bf, Cf);
    }
    w.key_b = b;
    w.key_g = g;
  }
  const size_t es = elsize(p.sdtype);
  char* pool = static_cast<char*>(p.state);
  const int64_t head_off = h * P * S;
  const void* src = pool && sq.src >= 0 ? pool + (sq.src * p.state_ss + head_off) * es : nullptr;
  void* dst = pool && sq.dst >= 0 ? pool + (sq.dst * p.state_ss + head_off) * es : nullptr;
  bool state = src != nullptr;
  if (state) {
    switch (p.sdtype) {
      case DType::F32: state_in<float>(src, w, P); break;
      case DType::BF16: state_in<bf16>(src, w, P); break;
      case DType::F16: state_in<f16>(src, w, P); break;
    }
  }
  const float A = p.A[h], Dh = p.D ? p.D[h] : 0.f;
  const XT* x = static_cast<const XT*>(p.x);
  const XT* z = static_cast<const XT*>(p.z);
  XT* out = static_cast<XT*>(p.out);
  const size_t bes = elsize(p.bdtype);
  const char* Bm = static_cast<const char*>(p.B);
  const char* Cm = static_cast<const char*>(p.C);
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t t0 = c * Q, qn = std::min(Q, sq.n - t0);
    const float *cb = w.cb1, *Bf = w.Bf, *Cf = w.Cf;
    if (cached) {
      cb = w.cache + c * w.per_chunk;
      if (w.bc_cached) {
        Bf = cb + w.cb_floats;
        Cf = Bf + round_to(Q * S, 16);
      } else {
        load_bc(p, sq, b, g, t0, qn, w.Bf, w.Cf);
      }
    } else {
      chunk_cb(p, sq, b, g, t0, qn, w, w.cb1, w.Bf, w.Cf);
    }
    NextRows next{};
    if (t0 + Q < sq.n) {
      const int64_t ta = sq.t0 + t0 + Q;
      const int64_t xe = static_cast<int64_t>(sizeof(XT));
      next = NextRows{reinterpret_cast<const char*>(x + b * p.x_sb + ta * p.x_st + h * p.x_sh),
                      z ? reinterpret_cast<const char*>(z + b * p.z_sb + ta * p.z_st + h * p.z_sh) : nullptr,
                      reinterpret_cast<const char*>(out + b * p.o_sb + ta * p.o_st + h * p.o_sh),
                      bc_cached ? nullptr : Bm + (b * p.b_sb + ta * p.b_st + g * p.b_sg) * static_cast<int64_t>(bes),
                      bc_cached ? nullptr : Cm + (b * p.c_sb + ta * p.c_st + g * p.c_sg) * static_cast<int64_t>(bes),
                      p.x_st * xe, p.z_st * xe, p.o_st * xe,
                      p.b_st * static_cast<int64_t>(bes), p.c_st * static_cast<int64_t>(bes),
                      P * xe, S * static_cast<int64_t>(bes), std::min(Q, sq.n - t0 - Q)};
    }
    dt_chunk(p, sq, b, t0, qn, h, A, w.dd, w.dA);
    // The decays, row by row: Rw[0] from the chunk's start, Rw[1 + k] from token k. Each step
    // scales whole vectors (a partial one went through a buffer and stalled on store forwarding);
    // the lanes past i + 1 are zeros, or values that are set to 1 before they are read.
    float* Rw = w.Rw;
    std::fill(Rw, Rw + Qr + VF, 0.f);
    Rw[0] = 1.f;
    for (int64_t i = 0; i < qn; ++i) {
      const fVec va(w.dA[i]);
      for (int64_t j = 0; j < i + 1; j += VF) (fVec::loadu(Rw + j) * va).store(Rw + j);
      Rw[i + 1] = 1.f;
      w.din[i] = Rw[0];
      const float* cr = cb + i * Qr;
      float* mr = w.M + i * Qr;
      const int64_t n = round_up(i + 1);
      for (int64_t k = 0; k < n; k += VF) (fVec::loadu(cr + k) * fVec::loadu(Rw + 1 + k)).store(mr + k);
      std::fill(mr + i + 1, mr + Qr, 0.f);
    }
    const float whole = Rw[0];
    // x in fp32 (for D x), d x and tail d x in one pass over the chunk's x rows.
    for (int64_t k = 0; k < qn; ++k) {
      const XT* xr = x + b * p.x_sb + (sq.t0 + t0 + k) * p.x_st + h * p.x_sh;
      const fVec vd(w.dd[k]), tk(Rw[1 + k]);
      for (int64_t j = 0; j < Pr; j += VF) {
        const fVec xv = j + VF <= P ? Io<XT>::load(xr + j) : Io<XT>::load(xr + j, static_cast<int>(P - j));
        const fVec dxv = vd * xv;
        xv.store(w.xf + k * Pr + j);
        dxv.store(w.dx + k * Pr + j);
        (tk * dxv).store(w.dxt + k * Pr + j);
      }
    }
    const int64_t tc = sq.t0 + t0;
    grid(YOp<XT>{&next, Cf, w.ST, w.M, w.dx, w.din, w.xf, z ? z + b * p.z_sb + tc * p.z_st + h * p.z_sh : nullptr,
                 out + b * p.o_sb + tc * p.o_st + h * p.o_sh, p.z_st, p.o_st, Dh, p.D != nullptr, S, P, Pr, Qr, qn,
                 state},
         qn, Pr / VF);
    grid(StOp{Bf, w.dxt, w.ST, whole, S, Pr, qn, state}, S, Pr / VF);
    state = true;
  }
  if (dst) {
    switch (p.sdtype) {
      case DType::F32: state_out<float>(dst, w, P); break;
      case DType::BF16: state_out<bf16>(dst, w, P); break;
      case DType::F16: state_out<f16>(dst, w, P); break;
    }
  }
}

}  // namespace

void run_range(const Params& p, int64_t begin, int64_t end) {
  const int64_t Pr = round_up(p.P), Sr = round_up(p.S);
  Scratch w(static_cast<size_t>(p.P * p.S + 2 * Sr + 4 * Pr));
  if (p.chunk > 0) {
    int64_t longest = 0;
    for (int64_t b = begin / p.H; b <= (end - 1) / p.H; ++b) longest = std::max(longest, p.seqs[b].n);
    ChunkWork cw(p, longest);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / p.H, h = i % p.H;
      switch (p.xdtype) {
        case DType::F32: run_item_chunked<float>(p, w.base, cw, b, h); break;
        case DType::BF16: run_item_chunked<bf16>(p, w.base, cw, b, h); break;
        case DType::F16: run_item_chunked<f16>(p, w.base, cw, b, h); break;
      }
    }
    return;
  }
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / p.H, h = i % p.H;
    switch (p.xdtype) {
      case DType::F32: run_item<float>(p, w.base, b, h); break;
      case DType::BF16: run_item<bf16>(p, w.base, b, h); break;
      case DType::F16: run_item<f16>(p, w.base, b, h); break;
    }
  }
}

}  // namespace KV_SSM_ISA_NS
}  // namespace kv_ssm
