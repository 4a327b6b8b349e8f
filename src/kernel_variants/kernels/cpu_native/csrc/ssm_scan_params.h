// Plain-data interface between the torch-facing binding TU (ssm_scan_cpu.cpp) and the per-ISA
// kernel TUs (ssm_scan_avx*.cpp). Free of torch headers on purpose, like the other kernels'
// params headers: the ISA TUs are compiled with wider target flags.
#pragma once
#include <cstdint>

namespace kv_ssm {

enum class DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

// One sequence: its tokens, the slot its state is read from and the one it is written to.
struct Seq {
  int64_t t0;   // first token on the token axis (x + t0 * x_st), 0 for the update
  int64_t n;    // tokens
  int64_t src;  // slot read, or -1: zero initial state
  int64_t dst;  // slot written, or -1: final state not kept
  bool pad;     // padded: zero output rows, no slot read or written
};

// Element (seq b, token t, head h, p) of x lies at x + b * x_sb + (seq[b].t0 + t) * x_st + h * x_sh + p:
// the update's [B, T, H, P] (t0 = 0) and the scan's [T, H, P] (x_sb = 0) alike. Unit stride
// along P (x, z, out) and along S (B, C); the pool's slots are [H, P, S] dense at any slot stride.
struct Params {
  DType xdtype;   // x, z, out
  DType dtdtype;  // dt
  DType bdtype;   // B, C
  DType sdtype;   // state pool
  int64_t H, P, S, G;
  const void* x;
  int64_t x_sb, x_st, x_sh;
  const void* z;  // null: no gate
  int64_t z_sb, z_st, z_sh;
  void* out;
  int64_t o_sb, o_st, o_sh;
  const void* dt;  // element (b, t, h) at dt + b * dt_sb + (t0 + t) * dt_st + h * dt_sh
  int64_t dt_sb, dt_st, dt_sh;
  const void* B;  // element (b, t, g, s) at B + b * b_sb + (t0 + t) * b_st + g * b_sg + s
  int64_t b_sb, b_st, b_sg;
  const void* C;
  int64_t c_sb, c_st, c_sg;
  const float* A;        // [H]
  const float* D;        // [H] or null
  const float* dt_bias;  // [H] or null
  bool softplus;
  bool clamp;  // dt_min > 0 or dt_max < inf (vLLM's rule)
  float dt_min, dt_max;
  void* state;       // pool, or null (scan without states)
  int64_t state_ss;  // slot stride (elements)
  const Seq* seqs;
  int64_t nseq;
  int64_t chunk;  // 0: token by token; Q > 0: the chunked (SSD) form in chunks of Q tokens
};

// Runs work items [begin, end), item = seq * H + head. One entry point per ISA build.
using RangeFn = void (*)(const Params&, int64_t begin, int64_t end);

}  // namespace kv_ssm
