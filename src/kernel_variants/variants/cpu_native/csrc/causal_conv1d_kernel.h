// Depthwise causal conv1d (+ optional SiLU) over channel-last data.
//
// This header is compiled once per ISA: the including TU defines KV_ISA_NS
// (and, for SIMD builds, CPU_CAPABILITY / CPU_CAPABILITY_<ISA> plus a
// matching `#pragma GCC target`) before including it. ATen's Vectorized<>
// resolves to the ISA's implementation inside the inline namespace
// at::vec::CPU_CAPABILITY, so the copies never collide at link time.
//
// Work decomposition (fwd): item = (sequence, time chunk, channel tile).
// Inside an item, rows are walked in blocks of kTimeBlock; for each block
// every 2*VF-channel group runs the time loop with the W-1 previous input
// rows held in registers (fp32). Between blocks the window is parked in a
// small stack buffer. This keeps each row's tile bytes touched in address
// order (hardware prefetch friendly) while converting each input element
// to fp32 exactly once.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

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
constexpr int64_t kTimeBlock = 16;
static_assert(kTileC % VW == 0, "tile must hold whole channel groups");

// ---------------------------------------------------------------- SiLU
// x * sigmoid(x) with a 6th-order exp (rel. err ~1e-7) and a Newton-refined
// reciprocal: the exact divide has a 5-10 cycle throughput on one port and
// dominated the loop; Sleef's exp is more accurate than fp32 output needs.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kClamp = 87.0f;  // exp(+-87) stays a normal float
constexpr float kP6 = 1.f / 720, kP5 = 1.f / 120, kP4 = 1.f / 24,
                kP3 = 1.f / 6, kP2 = 0.5f;

#if defined(CPU_CAPABILITY_AVX512)
KV_INLINE fVec silu(const fVec& xv) {
  const __m512 x = xv;
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-kClamp)),
                                  _mm512_set1_ps(kClamp));
  // e = exp(-xc) = 2^n * exp(r)
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(xc, _mm512_set1_ps(-kLog2e)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 u = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  const __m512 r = _mm512_fnmsub_ps(n, _mm512_set1_ps(kLn2Lo), u);
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(kP6), r, _mm512_set1_ps(kP5));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kP4));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kP3));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kP2));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f));
  const __m512 d = _mm512_add_ps(_mm512_scalef_ps(q, n), _mm512_set1_ps(1.f));
  const __m512 rc = _mm512_rcp14_ps(d);
  const __m512 nr = _mm512_fnmadd_ps(d, rc, _mm512_set1_ps(2.f));
  return fVec(_mm512_mul_ps(_mm512_mul_ps(x, rc), nr));
}
#elif defined(CPU_CAPABILITY_AVX2)
KV_INLINE fVec silu(const fVec& xv) {
  const __m256 x = xv;
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-kClamp)),
                                  _mm256_set1_ps(kClamp));
  // Round-to-int by adding 1.5*2^23 (+127 exponent bias): the low mantissa
  // bits of f then hold n+127, so f<<23 is the float 2^n.
  const __m256 magic = _mm256_set1_ps(12582912.f + 127.f);
  const __m256 f = _mm256_fmadd_ps(xc, _mm256_set1_ps(-kLog2e), magic);
  const __m256 n = _mm256_sub_ps(f, magic);
  const __m256 u = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  const __m256 r = _mm256_fnmsub_ps(n, _mm256_set1_ps(kLn2Lo), u);
  __m256 q = _mm256_fmadd_ps(_mm256_set1_ps(kP6), r, _mm256_set1_ps(kP5));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kP4));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kP3));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kP2));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f));
  const __m256 p2 =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(f), 23));
  const __m256 d = _mm256_fmadd_ps(q, p2, _mm256_set1_ps(1.f));
  const __m256 rc = _mm256_rcp_ps(d);
  const __m256 nr = _mm256_fnmadd_ps(d, rc, _mm256_set1_ps(2.f));
  return fVec(_mm256_mul_ps(_mm256_mul_ps(x, rc), nr));
}
#else
// Portable build: same algorithm on plain floats so the compiler can
// auto-vectorise it for whatever baseline ISA it targets.
KV_INLINE float silu_scalar(float x) {
  const float xc = std::min(std::max(x, -kClamp), kClamp);
  const float magic = 12582912.f + 127.f;
  const float f = xc * -kLog2e + magic;
  const float n = f - magic;
  const float r = -(xc + n * kLn2Hi) - n * kLn2Lo;
  float q = kP6 * r + kP5;
  q = q * r + kP4;
  q = q * r + kP3;
  q = q * r + kP2;
  q = q * r + 1.f;
  q = q * r + 1.f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits <<= 23;
  float p2;
  std::memcpy(&p2, &bits, sizeof(p2));
  return x / (q * p2 + 1.f);
}
KV_INLINE fVec silu(const fVec& xv) {
  alignas(64) float buf[VF];
  xv.store(buf);
  for (int i = 0; i < VF; ++i) buf[i] = silu_scalar(buf[i]);
  return fVec::loadu(buf);
}
#endif

// ---------------------------------------------------------------- I/O
// Load/store 2*VF channels of T as two fp32 vectors; the `n` overloads
// handle the ragged last group (n < VW).
template <typename T>
struct IO {  // bf16 / fp16
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

template <typename WT>
inline void fill_taps(const WT* w, int64_t sd, int64_t sk, int W, int64_t c0,
                      int64_t n, float* wt /* [W][kTileC] */) {
  for (int k = 0; k < W; ++k)
    for (int64_t c = 0; c < n; ++c)
      wt[k * kTileC + c] = to_f(w[(c0 + c) * sd + k * sk]);
}

template <typename WT>
inline void fill_bias(const WT* b, int64_t sd, int64_t c0, int64_t n,
                      float* bt) {
  for (int64_t c = 0; c < n; ++c) bt[c] = to_f(b[(c0 + c) * sd]);
}

// Transposed fp32 taps [W][kTileC] and bias [kTileC] for channels
// [c0, c0+n); the tail up to the next group boundary is zeroed so ragged
// groups compute on defined values.
template <int W>
inline void load_taps(const Params& p, int64_t c0, int64_t n, float* wt,
                      float* bt) {
  const int64_t npad = std::min<int64_t>(kTileC, (n + VW - 1) / VW * VW);
  switch (p.wdtype) {
    case DType::F32:
      fill_taps(static_cast<const float*>(p.weight), p.w_sd, p.w_sk, W, c0, n,
                wt);
      break;
    case DType::BF16:
      fill_taps(static_cast<const c10::BFloat16*>(p.weight), p.w_sd, p.w_sk, W,
                c0, n, wt);
      break;
    case DType::F16:
      fill_taps(static_cast<const c10::Half*>(p.weight), p.w_sd, p.w_sk, W, c0,
                n, wt);
      break;
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
    fVec xa, xb;
    if constexpr (FULL) {
      IO<T>::load(xp, xa, xb);
    } else {
      IO<T>::load(xp, xa, xb, n);
    }
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
    if constexpr (SILU) {
      a0 = silu(a0);
      a1 = silu(a1);
    }
    if constexpr (FULL) {
      IO<T>::store(op, a0, a1);
    } else {
      IO<T>::store(op, a0, a1, n);
    }
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

template <typename T>
inline void zero_rows(T* out, int64_t o_rs, int64_t t0, int64_t t1,
                      int64_t c0, int64_t nc) {
  for (int64_t t = t0; t < t1; ++t)
    std::memset(out + t * o_rs + c0, 0, static_cast<size_t>(nc) * sizeof(T));
}

template <typename T, int W, bool SILU>
void fwd_item(const Params& p, const Seq& sq, int64_t chunk, int64_t tile) {
  constexpr int H = W - 1;
  const int64_t c0 = tile * kTileC;
  const int64_t nc = std::min(p.dim, c0 + kTileC) - c0;
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

  alignas(64) float wt[W * kTileC];
  alignas(64) float bt[kTileC];
  alignas(64) float win[H * kTileC];
  load_taps<W>(p, c0, nc, wt, bt);

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

  run_tile<T, W, SILU>(x + t0 * p.x_rs + c0, p.x_rs, out + t0 * p.out_rs + c0,
                       p.out_rs, t1 - t0, nc, wt, bt, win);

  // Only the first chunk reads the history, so it alone writes the new
  // state, after its reads. If it is also the last chunk, the window now
  // holds exactly the final H rows of history ++ x (this covers L < H).
  if (chunk == 0 && st != nullptr) {
    for (int j = 0; j < H; ++j) {
      T* dst = st + (p.st_rows - H + j) * p.st_ss;
      if (t1 == L) {
        f32_to_row(win + j * kTileC, dst, p.st_sd, nc);
      } else {
        copy_row(x + (L - H + j) * p.x_rs + c0, 1, dst, p.st_sd, nc);
      }
    }
  }
}

template <typename T, int W, bool SILU>
void update_item(const Params& p, const Seq& sq, int64_t tile) {
  constexpr int H = W - 1;
  const int64_t c0 = tile * kTileC;
  const int64_t nc = std::min(p.dim, c0 + kTileC) - c0;
  const int64_t L = sq.len;
  const int64_t S = p.st_rows;
  T* out = static_cast<T*>(p.out) + sq.out_off;
  if (sq.pad) {
    zero_rows(out, p.out_rs, 0, L, c0, nc);
    return;
  }
  const T* x = static_cast<const T*>(p.x) + sq.x_off;
  T* st = static_cast<T*>(p.state) + sq.slot * p.st_sn + c0 * p.st_sd;

  alignas(64) float wt[W * kTileC];
  alignas(64) float bt[kTileC];
  alignas(64) float win[H * kTileC];
  load_taps<W>(p, c0, nc, wt, bt);
  for (int j = 0; j < H; ++j) {
    float* wr = win + j * kTileC;
    row_to_f32(st + (sq.hist_row + j) * p.st_ss, p.st_sd, wr, nc);
    std::fill(wr + nc, wr + kTileC, 0.f);
  }

  run_tile<T, W, SILU>(x + c0, p.x_rs, out + c0, p.out_rs, L, nc, wt, bt, win);

  // Shift the slot after all history reads of this tile. Row r takes old
  // row r+shift (ascending r only reads rows not yet overwritten) or x.
  const int64_t keep = std::max<int64_t>(S - L, 0);
  for (int64_t r = 0; r < S; ++r) {
    T* dst = st + r * p.st_ss;
    if (r < keep) {
      copy_row(st + (r + sq.shift) * p.st_ss, p.st_sd, dst, p.st_sd, nc);
    } else {
      copy_row(x + (L - S + r) * p.x_rs + c0, 1, dst, p.st_sd, nc);
    }
  }
}

template <typename T, int W, bool SILU>
void fwd_range_t(const Params& p, int64_t begin, int64_t end) {
  const Seq* seqs = p.seqs;
  // Last sequence whose first item is <= begin.
  int64_t s = std::upper_bound(seqs, seqs + p.nseq, begin,
                               [](int64_t v, const Seq& q) {
                                 return v < q.item0;
                               }) -
              seqs - 1;
  for (int64_t it = begin; it < end; ++it) {
    while (s + 1 < p.nseq && seqs[s + 1].item0 <= it) ++s;
    const int64_t rel = it - seqs[s].item0;
    fwd_item<T, W, SILU>(p, seqs[s], rel / p.n_tiles, rel % p.n_tiles);
  }
}

template <typename T, int W, bool SILU>
void update_range_t(const Params& p, int64_t begin, int64_t end) {
  for (int64_t it = begin; it < end; ++it)
    update_item<T, W, SILU>(p, p.seqs[it / p.n_tiles], it % p.n_tiles);
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

inline void dispatch(const Params& p, int64_t b, int64_t e, bool upd) {
  switch (p.dtype) {
    case DType::F32:
      dispatch_act<float>(p, b, e, upd);
      break;
    case DType::BF16:
      dispatch_act<c10::BFloat16>(p, b, e, upd);
      break;
    case DType::F16:
      dispatch_act<c10::Half>(p, b, e, upd);
      break;
  }
}

}  // namespace

void fwd_range(const Params& p, int64_t begin, int64_t end) {
  dispatch(p, begin, end, false);
}

void update_range(const Params& p, int64_t begin, int64_t end) {
  dispatch(p, begin, end, true);
}

}  // namespace KV_ISA_NS
}  // namespace kv_cconv
