// Bench-only extension: the compute floor of cpu_native's causal_conv1d (floor_kernel.h) on
// the ISA build the kernel runs, for tools/bench_cpu_roofline.py. Baseline ISA like the
// kernel's binding TU; the ISA builds are the floor_<isa>.cpp files.
#include <torch/extension.h>

#include <string>

#include "isa.h"  // KV_X86_BUILDS

#define KV_ISA_NS floor_generic
#include "floor_kernel.h"
#undef KV_ISA_NS

namespace kv_cconv {
#if KV_X86_BUILDS
#define KV_FLOOR_DECL(NS)                                                                 \
  namespace NS {                                                                          \
  void floor_run(int, bool, const void*, void*, int64_t, const float*, const float*);     \
  int floor_lanes();                                                                      \
  }
KV_FLOOR_DECL(floor_avx2)
KV_FLOOR_DECL(floor_avx512)
KV_FLOOR_DECL(floor_avx512bf16)
#undef KV_FLOOR_DECL
#endif

namespace {

using RunFn = void (*)(int, bool, const void*, void*, int64_t, const float*, const float*);

// isa: cpu_native's isa_path(); as in the kernel, "avx512-bf16" runs bf16 on the AVX512-BF16
// build and other dtypes on the AVX-512 one.
std::pair<RunFn, int> pick(const std::string& isa, int dtype) {
#if KV_X86_BUILDS
  if (isa == "avx512-bf16" && dtype == 1) return {floor_avx512bf16::floor_run, floor_avx512bf16::floor_lanes()};
  if (isa == "avx512-bf16" || isa == "avx512") return {floor_avx512::floor_run, floor_avx512::floor_lanes()};
  if (isa == "avx2") return {floor_avx2::floor_run, floor_avx2::floor_lanes()};
#endif
  TORCH_CHECK(isa == "scalar", "unknown ISA path ", isa);
  return {floor_generic::floor_run, floor_generic::floor_lanes()};
}

void run(const at::Tensor& x, at::Tensor& out, const at::Tensor& w, const at::Tensor& b, bool silu,
         const std::string& isa) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.sizes() == out.sizes() &&
                  x.scalar_type() == out.scalar_type(),
              "x, out: contiguous, one shape and dtype");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == 128 &&
                  b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == 32,
              "w: 128 floats ([4][32]), b: 32 floats");
  const int dtype = x.scalar_type() == at::kFloat ? 0 : x.scalar_type() == at::kBFloat16 ? 1 : 2;
  TORCH_CHECK(dtype != 2 || x.scalar_type() == at::kHalf, "float32, bfloat16 or float16");
  const auto [fn, lanes] = pick(isa, dtype);
  TORCH_CHECK(x.numel() % lanes == 0, "numel must be a multiple of ", lanes);
  fn(dtype, silu, x.data_ptr(), out.data_ptr(), x.numel(), w.data_ptr<float>(), b.data_ptr<float>());
}

}  // namespace
}  // namespace kv_cconv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &kv_cconv::run, pybind11::arg("x"), pybind11::arg("out"), pybind11::arg("w"),
        pybind11::arg("b"), pybind11::arg("silu"), pybind11::arg("isa"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "out = the floor's 4 FMAs (+SiLU) of x, on the given ISA path, one thread");
}
