// Plain-data interface between the torch-facing binding TU (gdn_cpu.cpp) and the per-ISA kernel
// TUs (gdn_avx*.cpp) of the gated delta rule. Free of torch headers on purpose, like the other
// kernels' params headers: the ISA TUs are compiled with wider target flags.
#pragma once
#include <cstdint>

namespace kv_gdn {

enum class DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

// One sequence: tokens [t0, t0 + n) on the packed token axis and its pool slot.
struct Seq {
  int64_t t0;
  int64_t n;
  int64_t slot;  // slot read (when init) and written, or -1: from zeros, final state not kept
  bool init;     // start from the slot's state (else zeros)
  bool pad;      // padded: zero output rows, no slot read or written
};

// Element (token t, head h, i) of q lies at q + t * q_st + h * q_sh + i (unit stride along K; k,
// v and out likewise along their last dim). The pool's slots are [Hv, K, V] dense at any slot
// stride.
struct Params {
  DType qdtype;  // q, k
  DType vdtype;  // v, out
  DType gdtype;  // a, b (fused gating) or g, beta (given)
  DType sdtype;  // state pool
  int64_t Hk, Hv, K, V;
  const void* q;
  int64_t q_st, q_sh;
  const void* k;
  int64_t k_st, k_sh;
  const void* v;
  int64_t v_st, v_sh;
  void* out;
  int64_t o_st, o_sh;
  // Gating, element (t, h) at x + t * x_st + h * x_sh. fused: a and b, with A_log and dt_bias
  // (the decode op); else g (log decay) and beta (write strength) as given (the prefill op).
  bool fused;
  const void* ga;
  int64_t ga_st, ga_sh;
  const void* gb;
  int64_t gb_st, gb_sh;
  const float* A_log;    // [Hv] (fused only)
  const float* dt_bias;  // [Hv] (fused only)
  float sp_beta, sp_threshold;
  bool l2norm;
  float scale;
  void* state;       // pool, or null (prefill without states)
  int64_t state_ss;  // slot stride (elements)
  const Seq* seqs;
  int64_t nseq;
};

// Runs work items [begin, end), item = seq * Hv + v head. One entry point per ISA build.
using RangeFn = void (*)(const Params&, int64_t begin, int64_t end);

}  // namespace kv_gdn
