// Plain-data interface between the torch-facing binding TU
// (gemma_rms_norm_cpu.cpp) and the per-ISA kernel TUs
// (gemma_rms_norm_avx*.cpp). Free of torch headers on purpose, like
// causal_conv1d_params.h: the ISA TUs are compiled with wider target flags.
#pragma once
#include <cstdint>

namespace kv_grms {

enum class DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

// Where the gate act(z) applies (vLLM's RMSNormGated): to the norm's input
// (In: norm(x * act(z)), Mamba2's) or to its output (Out: norm(x) * act(z)).
enum class Gate : int32_t { None = 0, In = 1, Out = 2 };

// One call: rows [0, T) of a [T, D] problem. Serves Gemma RMSNorm (offset 1),
// plain RMSNorm (offset 0, vLLM IR's rms_norm / fused_add_rms_norm) and gated
// RMSNorm (offset 0, a gate and groups; never with a residual).
struct Params {
  DType dtype;         // x / residual / out / residual_sum element type
  DType wdtype;        // weight: == dtype, or F32 (the binding converts others)
  int64_t dim;         // D
  int64_t group;       // channels per group, each normalised by its own mean (D: one group)
  int64_t var_dim;     // channels [0, var_dim) of a group make its mean of squares
                       // (vLLM's variance_size with one group; the group otherwise)
  float eps;
  float offset;        // the scale is offset + weight: 1 for Gemma, 0 for plain RMSNorm
  const void* x;       // row r at x + r * x_rs (elements), stride 1 along D
  int64_t x_rs;
  const void* res;     // residual, or null for plain gemma_rms_norm
  int64_t r_rs;
  const void* weight;  // [D], contiguous
  void* out;           // [T, D] contiguous
  void* sum;           // [T, D] contiguous residual_sum (null without residual)
  const void* gate;    // z (x's dtype), row r at gate + r * g_rs, stride 1 (null: no gate)
  int64_t g_rs;
  Gate gate_at;        // None exactly when gate is null
  bool sigmoid;        // act = the sigmoid; SiLU otherwise
};

// Normalises rows [begin, end). One entry point per ISA build.
using RangeFn = void (*)(const Params&, int64_t begin, int64_t end);

}  // namespace kv_grms
