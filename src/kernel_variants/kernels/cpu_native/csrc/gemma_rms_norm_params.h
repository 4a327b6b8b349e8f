// Plain-data interface between the torch-facing binding TU
// (gemma_rms_norm_cpu.cpp) and the per-ISA kernel TUs
// (gemma_rms_norm_avx*.cpp). Free of torch headers on purpose, like
// causal_conv1d_params.h: the ISA TUs are compiled with wider target flags.
#pragma once
#include <cstdint>

namespace kv_grms {

enum class DType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

// One call: rows [0, T) of a [T, D] problem. Serves Gemma RMSNorm (offset 1)
// and plain RMSNorm (offset 0, vLLM IR's rms_norm / fused_add_rms_norm).
struct Params {
  DType dtype;         // x / residual / out / residual_sum element type
  DType wdtype;        // weight: == dtype, or F32 (the binding converts others)
  int64_t dim;         // D
  int64_t var_dim;     // channels [0, var_dim) make the mean of squares (vLLM's variance_size; D)
  float eps;
  float offset;        // the scale is offset + weight: 1 for Gemma, 0 for plain RMSNorm
  const void* x;       // row r at x + r * x_rs (elements), stride 1 along D
  int64_t x_rs;
  const void* res;     // residual, or null for plain gemma_rms_norm
  int64_t r_rs;
  const void* weight;  // [D], contiguous
  void* out;           // [T, D] contiguous
  void* sum;           // [T, D] contiguous residual_sum (null without residual)
};

// Normalises rows [begin, end). One entry point per ISA build.
using RangeFn = void (*)(const Params&, int64_t begin, int64_t end);

}  // namespace kv_grms
