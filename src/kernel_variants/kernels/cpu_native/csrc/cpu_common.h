// What every cpu_native extension shares: which ISA build to run, and how outputs are allocated.
// Included by each extension's first (baseline-ISA) translation unit only.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "isa.h"  // KV_X86_BUILDS

namespace kv_cpu {

// 0: portable, 1: AVX2 (+FMA, F16C), 2: AVX-512 (F, BW, VL, DQ), 3: AVX-512 with BF16. What the
// CPU supports, capped by ATEN_CPU_CAPABILITY (default / avx2 / avx512) like ATen's own kernels,
// so every build can be exercised on one machine.
inline int isa_level() {
  std::string want;
  if (const char* e = std::getenv("ATEN_CPU_CAPABILITY")) want = e;
  std::transform(want.begin(), want.end(), want.begin(), [](unsigned char c) { return std::tolower(c); });
  int cap = 3;
  if (want == "default") cap = 0;
  if (want == "avx2") cap = 1;
  if (want == "avx512") cap = 2;
#if KV_X86_BUILDS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  return std::min(cap, bf16 ? 3 : avx512 ? 2 : avx2 ? 1 : 0);
#else
  (void)cap;
  return 0;
#endif
}

// Which build's entry points serve each dtype (indexed by an op's DType: F32, BF16, F16; bf16
// at index `bf16`), chosen from `builds`: {portable, AVX2, AVX-512, AVX-512 + BF16} where the ISA
// builds are compiled (KV_X86_BUILDS), the portable one alone elsewhere. The widest build
// isa_level() allows serves every dtype, but the AVX512-BF16 build serves bf16 data only.
// Fns: one build's entry points (a function pointer, or a struct of them).
template <class Fns, size_t N>
std::array<Fns, 3> per_dtype_builds(const Fns (&builds)[N], int bf16) {
  static_assert(N == (KV_X86_BUILDS ? 4 : 1), "one entry per ISA build");
  const int level = std::min(isa_level(), static_cast<int>(N) - 1);
  std::array<Fns, 3> k;
  k.fill(builds[std::min(level, 2)]);
  if (level >= 3) k[bf16] = builds[level];
  return k;
}

// The kernels' element type (an op's DType) of a float32 / bfloat16 / float16 tensor `name`.
template <class DType>
DType kernel_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat:
      return DType::F32;
    case at::kBFloat16:
      return DType::BF16;
    case at::kHalf:
      return DType::F16;
    default:
      TORCH_CHECK(false, name, ": unsupported dtype ", t, " (expected float32, bfloat16 or float16)");
  }
}

// Whether a and b may share a byte: their spans [first byte, last byte] intersect (strides are
// >= 0). Conservative: a strided view interleaved with another tensor counts as overlapping.
// (at::assert_no_partial_overlap does not judge non-dense views.)
inline bool bytes_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(lo, lo + static_cast<uintptr_t>((last + 1) * t.element_size()));
  };
  const auto [a_lo, a_hi] = span(a);
  const auto [b_lo, b_hi] = span(b);
  return a_lo < b_hi && b_lo < a_hi;
}

// Tell autograd that `t` was written through its data pointer, as torch's in-place ops do: a
// graph that saved it then fails at backward instead of using the new values. Inference tensors
// have no version counter.
inline void mark_written(const at::Tensor& t) {
  if (t.defined() && !t.is_inference()) torch::autograd::impl::bump_version(t);
}

// A new contiguous tensor of x's shape and dtype.
//
// With `apart` it starts 2 KiB away from x modulo 4 KiB (a view at a storage offset into a
// buffer one page larger): when rows are a multiple of 4 KiB long, an output at x's page
// offset, where a plain allocation of the same size lands, makes loads of x alias the
// in-flight stores of the output ("4K aliasing": ~1.25x slower for D=4096 fp32, even on
// the conv kernel's alias-safe block path). Small outputs skip it: few rows, and the extra
// allocation is a sizeable part of their call.
//
// Large outputs are fresh mmap'd memory that the kernel faults in page by page; asking for
// transparent huge pages first (only a hint, errors are ignored) cuts that cost by ~2x for
// multi-hundred-MB outputs.
inline at::Tensor alloc_out(const at::Tensor& x, bool apart = false) {
  constexpr size_t kHugePage = size_t{1} << 21;
  constexpr size_t kHugeOutBytes = size_t{4} << 20;
  constexpr size_t kPage = 4096;
  constexpr size_t kApartMinBytes = size_t{64} << 10;
  const size_t bytes = static_cast<size_t>(x.numel()) * x.element_size();
  at::Tensor out;
  if (apart && bytes >= kApartMinBytes) {
    at::Tensor buf = at::empty({static_cast<int64_t>(bytes + kPage)}, x.options().dtype(at::kByte));
    const uintptr_t b = reinterpret_cast<uintptr_t>(buf.data_ptr());
    // On a cache line (buf is 64-byte aligned) whatever x's alignment.
    const uintptr_t want = ((reinterpret_cast<uintptr_t>(x.data_ptr()) & ~uintptr_t{63}) + kPage / 2) % kPage;
    const size_t off = (want + kPage - b % kPage) % kPage;
    std::vector<int64_t> strides(static_cast<size_t>(x.dim()), 1);
    for (int64_t d = x.dim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * std::max<int64_t>(x.size(d + 1), 1);
    out = at::empty({0}, x.options())
              .set_(buf.storage(), static_cast<int64_t>(off) / x.element_size(), x.sizes(), strides);
  } else {
    out = at::empty(x.sizes(), x.options());
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHugeOutBytes) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(out.data_ptr());
    const uintptr_t lo = (p + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t hi = (p + bytes) & ~(kHugePage - 1);
    if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
#endif
  return out;
}

}  // namespace kv_cpu
