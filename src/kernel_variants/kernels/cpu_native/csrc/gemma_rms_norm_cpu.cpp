// Fused CPU RMSNorm, plain and with a residual add, in two flavours of one
// kernel: Gemma's (sgl-kernel-npu's gemma_rms_norm / add_gemma_rms_norm,
// scale 1 + weight) and plain RMSNorm (vLLM IR's rms_norm /
// fused_add_rms_norm: scale weight, or none, and an optional variance_size):
//   s   = x                       (gemma_rms_norm, rms_norm)
//   s   = round_to_dtype(x + residual), returned too (the add forms)
//   out = s * rsqrt(mean(s[:V]^2) + eps) * (offset + weight), in fp32,
//         returned in x's dtype (offset 1 for Gemma, 0 otherwise; V = D, or
//         variance_size; no weight: a scale of 1).
// and gated RMSNorm (vLLM's RMSNormGated): s = x * act(z), or the output
// times act(z), per group of channels (gemma_rms_norm_kernel.h).
//
// This TU holds the torch bindings, argument checks, the parallel split
// over rows and the portable (baseline-ISA) kernel build; the AVX2 /
// AVX-512 / AVX-512+BF16 builds (gemma_rms_norm_avx*.cpp) are chosen once
// at run time. Like causal_conv1d_cpu.cpp it must come before the ISA files
// in the source list of whatever extension it is linked into: for inline
// functions emitted by several TUs the linker keeps the first copy, which
// has to be the baseline-ISA one.
//
// Layout: x2d / residual2d are [T, D] with any row stride (stride(1) != 1
// is made contiguous here); weight is [D] of any floating dtype and stride
// (used as is when it is contiguous and of x's dtype or fp32, else
// converted to fp32, exactly). Outputs are contiguous [T, D] tensors: the
// caller's (which may be x, and residual for the sum) or new ones. Nothing
// else is written.
//
// Build: no extra flags beyond the conv kernel's (-O3 -fno-trapping-math
// -fno-math-errno -Wno-psabi -fopenmp). Define KV_GRMS_NO_MODULE to link
// these files into an extension that has its own PYBIND11_MODULE and call
// kv_grms::bind(m) from it.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <string>
#include <initializer_list>
#include <tuple>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "gemma_rms_norm_params.h"

#define KV_GRMS_ISA_NS generic
#include "gemma_rms_norm_kernel.h"
#undef KV_GRMS_ISA_NS

#include "cpu_common.h"

#if KV_X86_BUILDS
namespace kv_grms {
namespace avx2 {
void norm_range(const Params& p, int64_t begin, int64_t end);
}
namespace avx512 {
void norm_range(const Params& p, int64_t begin, int64_t end);
}
namespace avx512bf16 {  // bf16 data only
void norm_range(const Params& p, int64_t begin, int64_t end);
}
}  // namespace kv_grms
#endif

namespace kv_grms {
namespace {

// Each thread gets at least this much work (elements, twice for the
// residual version): below it the ~1 us of a parallel region costs more than
// a second core saves. Measured crossover on a 2-core Zen 4: 16-32K elements
// for gemma_rms_norm, 8-16K for add_gemma_rms_norm.
#ifndef KV_GRMS_MIN_WORK
#define KV_GRMS_MIN_WORK (int64_t{1} << 14)
#endif
constexpr int64_t kMinWork = KV_GRMS_MIN_WORK;

// Per data dtype (indexed by DType), chosen once.
const std::array<RangeFn, 3>& impl() {
  static const std::array<RangeFn, 3> k = kv_cpu::per_dtype_builds<RangeFn>(
      {
          generic::norm_range,
#if KV_X86_BUILDS
          avx2::norm_range,
          avx512::norm_range,
          avx512bf16::norm_range,
#endif
      },
      static_cast<int>(DType::BF16));
  return k;
}

// Which build serves each dtype (for tests / diagnostics).
std::string isa_name(RangeFn f) {
#if KV_X86_BUILDS
  if (f == avx2::norm_range) return "avx2";
  if (f == avx512::norm_range) return "avx512";
  if (f == avx512bf16::norm_range) return "avx512bf16";
#endif
  return "default";
}

at::Tensor rows_view(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [T, D], got ", t.sizes());
  if (t.stride(1) != 1 && t.size(1) > 1) return t.contiguous();
  return t;
}

// Weight as the kernel takes it: contiguous, x's dtype or fp32.
at::Tensor weight_view(const at::Tensor& w, const at::Tensor& x) {
  const int64_t D = x.size(1);
  TORCH_CHECK(w.device().is_cpu(), "weight must be a CPU tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D, "weight must be [D=", D, "], got ", w.sizes());
  TORCH_CHECK(at::isFloatingType(w.scalar_type()), "weight must be floating point, got ",
              w.scalar_type());
  const bool ok_dtype = w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat;
  if (!ok_dtype) return w.to(at::kFloat).contiguous();
  if (w.stride(0) != 1 && D > 1) return w.contiguous();
  return w;
}

void run(const Params& p, int64_t T) {
  const RangeFn fn = impl()[static_cast<int>(p.dtype)];
  const int64_t row_work = std::max<int64_t>(p.dim, 1) * (p.res || p.gate ? 2 : 1);
  const int64_t grain = std::max<int64_t>(1, kMinWork / row_work);
  if (T <= grain || at::get_num_threads() == 1 || at::in_parallel_region()) {
    fn(p, 0, T);
    return;
  }
  at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) { fn(p, b, e); });
}

// The caller's output `name` for a [T, D] result of x's dtype (contiguous: the kernel writes
// rows of D), or a new tensor. It may be `may_be` itself (every element of that is read
// before the same element is written: sum_squares, then scale_row, row by row); it must share
// no byte with the tensors of `apart`.
at::Tensor output_for(const at::Tensor& x, const c10::optional<at::Tensor>& out, const char* name,
                      const at::Tensor& may_be, std::initializer_list<const at::Tensor*> apart) {
  if (!out.has_value() || !out->defined()) return kv_cpu::alloc_out(x);
  const at::Tensor& o = *out;
  TORCH_CHECK(o.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(o.scalar_type() == x.scalar_type(), name, " dtype ", o.scalar_type(),
              " must match x dtype ", x.scalar_type());
  TORCH_CHECK(o.sizes() == x.sizes(), name, " must be ", x.sizes(), ", got ", o.sizes());
  TORCH_CHECK(o.is_contiguous(), name, " must be contiguous");
  const bool same = o.numel() > 0 && o.data_ptr() == may_be.data_ptr() && o.strides() == may_be.strides();
  TORCH_CHECK(same || !kv_cpu::bytes_overlap(o, may_be), name,
              " may be the input it replaces but must not partly overlap it");
  for (const at::Tensor* t : apart)
    TORCH_CHECK(!t->defined() || !kv_cpu::bytes_overlap(o, *t), name,
                " must not overlap another input or output");
  return o;
}

// How the scale, the mean and the gate are formed: Gemma's (1 + weight over
// all D), plain RMSNorm's (weight or none, over the first variance_size
// channels) or gated RMSNorm's (weight or none, per group of group_size
// channels, with a gate z before or after the norm).
struct Flavour {
  float offset;
  c10::optional<int64_t> variance_size;
  c10::optional<int64_t> group_size = c10::nullopt;  // None: one group of D
  const at::Tensor* gate = nullptr;                  // z, or null
  Gate gate_at = Gate::None;
  bool sigmoid = false;
};

std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x_in,
                                             const c10::optional<at::Tensor>& weight,
                                             const at::Tensor* residual_in, double eps,
                                             Flavour flavour,
                                             const c10::optional<at::Tensor>& out_arg,
                                             const c10::optional<at::Tensor>& sum_arg) {
  const at::Tensor x = rows_view(x_in, "x");
  const DType dt = kv_cpu::kernel_dtype<DType>(x.scalar_type(), "x");
  at::Tensor residual;
  if (residual_in) {
    residual = rows_view(*residual_in, "residual");
    TORCH_CHECK(residual.sizes() == x.sizes(), "residual must be ", x.sizes(), ", got ",
                residual.sizes());
    TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual dtype ",
                residual.scalar_type(), " must match x dtype ", x.scalar_type());
  }
  const int64_t T = x.size(0), D = x.size(1);
  // No weight: a scale of exactly 1, as an fp32 row of ones with no offset (one small
  // allocation per call, instead of a third weight path through every ISA build).
  const bool weighted = weight.has_value() && weight->defined();
  const at::Tensor w = weighted ? weight_view(*weight, x) : at::ones({D}, x.options().dtype(at::kFloat));
  const int64_t G = flavour.group_size.value_or(D);
  TORCH_CHECK(G >= 1 && D % G == 0, "group_size must divide D=", D, ", got ", G);
  TORCH_CHECK(G == D || (!residual_in && !flavour.variance_size), "groups take no residual or variance_size");
  const int64_t V = flavour.variance_size.value_or(G);
  TORCH_CHECK(V >= 1 && V <= D, "variance_size must be in [1, D=", D, "], got ", V);
  at::Tensor gate;
  if (flavour.gate) {
    TORCH_CHECK(!residual_in, "a gate takes no residual");
    gate = rows_view(*flavour.gate, "z");
    TORCH_CHECK(gate.sizes() == x.sizes(), "z must be ", x.sizes(), ", got ", gate.sizes());
    TORCH_CHECK(gate.scalar_type() == x.scalar_type(), "z dtype ", gate.scalar_type(), " must match x dtype ",
                x.scalar_type());
  }

  // The norm may be written over x, the sum over residual (sglang's in-place fused add).
  at::Tensor out = output_for(x, out_arg, "out", x, {&residual, &w, &gate});
  at::Tensor sum = residual_in ? output_for(x, sum_arg, "residual_sum", residual, {&x, &w, &out}) : at::Tensor();
  auto written = [&]() -> std::tuple<at::Tensor, at::Tensor> {
    kv_cpu::mark_written(out);
    kv_cpu::mark_written(sum);
    return {out, sum};
  };
  if (T == 0 || D == 0) return written();

  Params p{};
  p.dtype = dt;
  p.wdtype = w.scalar_type() == at::kFloat ? DType::F32 : dt;
  p.dim = D;
  p.var_dim = V;
  p.eps = static_cast<float>(eps);
  p.offset = weighted ? flavour.offset : 0.f;
  p.x = x.data_ptr();
  p.x_rs = x.stride(0);
  p.res = residual_in ? residual.data_ptr() : nullptr;
  p.r_rs = residual_in ? residual.stride(0) : 0;
  p.weight = w.data_ptr();
  p.out = out.data_ptr();
  p.sum = residual_in ? sum.data_ptr() : nullptr;
  p.group = G;
  p.gate = gate.defined() ? gate.data_ptr() : nullptr;
  p.g_rs = gate.defined() ? gate.stride(0) : 0;
  p.gate_at = gate.defined() ? flavour.gate_at : Gate::None;
  p.sigmoid = flavour.sigmoid;
  run(p, T);
  return written();
}

}  // namespace

constexpr Flavour kGemma{1.f, c10::nullopt};

at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                          const c10::optional<at::Tensor>& out) {
  return std::get<0>(norm_impl(x, weight, nullptr, eps, kGemma, out, c10::nullopt));
}

std::tuple<at::Tensor, at::Tensor> add_gemma_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& weight,
                                                      const at::Tensor& residual, double eps,
                                                      const c10::optional<at::Tensor>& out,
                                                      const c10::optional<at::Tensor>& residual_sum) {
  return norm_impl(x, weight, &residual, eps, kGemma, out, residual_sum);
}

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps,
                    c10::optional<int64_t> variance_size, const c10::optional<at::Tensor>& out) {
  return std::get<0>(norm_impl(x, weight, nullptr, eps, {0.f, variance_size}, out, c10::nullopt));
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual, const c10::optional<at::Tensor>& weight,
    double eps, c10::optional<int64_t> variance_size, const c10::optional<at::Tensor>& out,
    const c10::optional<at::Tensor>& residual_sum) {
  return norm_impl(x, weight, &residual, eps, {0.f, variance_size}, out, residual_sum);
}

at::Tensor gated_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& z,
                          const c10::optional<at::Tensor>& weight, double eps,
                          c10::optional<int64_t> group_size, bool norm_before_gate, bool sigmoid,
                          const c10::optional<at::Tensor>& out) {
  const bool gated = z.has_value() && z->defined();
  Flavour f{0.f, c10::nullopt, group_size, gated ? &*z : nullptr,
            !gated ? Gate::None : norm_before_gate ? Gate::Out : Gate::In, sigmoid};
  return std::get<0>(norm_impl(x, weight, nullptr, eps, f, out, c10::nullopt));
}

// {dtype name: build} actually used, e.g. {"bfloat16": "avx512bf16", ...}.
std::tuple<std::string, std::string, std::string> isa() {
  const std::array<RangeFn, 3>& k = impl();
  return {isa_name(k[0]), isa_name(k[1]), isa_name(k[2])};
}

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("gemma_rms_norm", &gemma_rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "Gemma RMSNorm of x [T, D]: x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32; "
        "returns out (contiguous [T, D] of x's dtype, may be x) or a new tensor.");
  m.def("add_gemma_rms_norm", &add_gemma_rms_norm, py::arg("x"), py::arg("weight"),
        py::arg("residual"), py::arg("eps"), py::arg("out") = py::none(),
        py::arg("residual_sum") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "s = x + residual (in x's dtype), then Gemma RMSNorm of s; returns (out, s), each the "
        "given tensor (contiguous [T, D]; out may be x, residual_sum may be residual) or new.");
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("variance_size") = py::none(), py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "RMSNorm of x [T, D]: x * rsqrt(mean(x[:, :variance_size]^2) + eps) * weight (none: 1), "
        "in fp32; returns out (contiguous [T, D] of x's dtype, may be x) or a new tensor.");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"), py::arg("variance_size") = py::none(),
        py::arg("out") = py::none(), py::arg("residual_sum") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "s = x + residual (in x's dtype), then RMSNorm of s; returns (out, s), each the given "
        "tensor (contiguous [T, D]; out may be x, residual_sum may be residual) or new.");
  m.def("gated_rms_norm", &gated_rms_norm, py::arg("x"), py::arg("z"), py::arg("weight"), py::arg("eps"),
        py::arg("group_size") = py::none(), py::arg("norm_before_gate") = false,
        py::arg("sigmoid") = false, py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "Gated RMSNorm of x [T, D] (vLLM's RMSNormGated), in fp32: x * act(z) before the norm, "
        "or the norm times act(z) after it (act: SiLU, or the sigmoid), each group of group_size "
        "channels by its own mean, times weight (none: 1); returns out (contiguous [T, D] of "
        "x's dtype, may be x) or a new tensor.");
  m.def("gemma_rms_norm_isa", &isa,
        "Builds serving (float32, bfloat16, float16): default / avx2 / avx512 / avx512bf16.");
}

}  // namespace kv_grms

#if !defined(KV_GRMS_NO_MODULE)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { kv_grms::bind(m); }
#endif
