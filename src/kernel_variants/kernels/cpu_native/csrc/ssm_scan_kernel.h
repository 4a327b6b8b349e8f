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

// d for token (b, t) of head h: dt (+ bias), softplus (torch's, threshold 20), clamp.
KV_SSM_INLINE float dt_of(const Params& p, const Seq& q, int64_t b, int64_t t, int64_t h) {
  float d = scalar_f32(p.dt, p.dtdtype, b * p.dt_sb + (q.t0 + t) * p.dt_st + h * p.dt_sh);
  if (p.dt_bias) d += p.dt_bias[h];
  if (p.softplus) d = d > 20.f ? d : std::log1p(std::exp(d));
  if (p.clamp) d = std::min(std::max(d, p.dt_min), p.dt_max);
  return d;
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
    const float d = dt_of(p, q, b, t, h);
    to_f32(x + b * p.x_sb + tt * p.x_st + h * p.x_sh, xf, P);
    const fVec vd(d);
    for (int64_t i = 0; i < Pr; i += VF) (vd * fVec::loadu(xf + i)).store(dx + i);
    row_f32(Bm + (b * p.b_sb + tt * p.b_st + g * p.b_sg) * bes, p.bdtype, Bf, S);
    row_f32(Cm + (b * p.c_sb + tt * p.c_st + g * p.c_sg) * bes, p.bdtype, Cf, S);
    const Tok k{std::exp(d * A), dx, Bf, Cf};
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
    // Epilogue over P: + D * x, silu(z) gate, round to x's dtype.
    XT* o = out + b * p.o_sb + tt * p.o_st + h * p.o_sh;
    if (z) to_f32(z + b * p.z_sb + tt * p.z_st + h * p.z_sh, zf, P);
    const fVec vD(Dh), one(1.f), zero(0.f);
    for (int64_t i = 0; i < P; i += VF) {
      fVec yv = fVec::loadu(y + i);
      if (p.D) yv = at::vec::fmadd(vD, fVec::loadu(xf + i), yv);
      if (z) {
        const fVec zv = fVec::loadu(zf + i);
        yv = yv * zv / (one + (zero - zv).exp());
      }
      store_y<XT>(o + i, yv, static_cast<int>(std::min<int64_t>(VF, P - i)));
    }
  }
}

}  // namespace

void run_range(const Params& p, int64_t begin, int64_t end) {
  const int64_t Pr = round_up(p.P), Sr = round_up(p.S);
  Scratch w(static_cast<size_t>(p.P * p.S + 2 * Sr + 4 * Pr));
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
