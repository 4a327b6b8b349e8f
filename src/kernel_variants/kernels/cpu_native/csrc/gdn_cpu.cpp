// The gated delta rule (Qwen3-Next's GDN linear attention) on the CPU: the decode / verify step
// with the gating fused in (update) and the varlen prefill with g and beta given (scan), one
// kernel (gdn_kernel.h) for both.
//
// This TU holds the torch bindings, argument checks, the parallel split over (sequence, v head)
// and the portable (baseline-ISA) build; the AVX2 / AVX-512 / AVX-512+BF16 builds (gdn_avx*.cpp)
// are chosen once at run time with kv_cpu::isa_level(). It comes first in the extension's source
// list: for inline functions emitted by several TUs the linker keeps the first copy, which has to
// be the baseline-ISA one.
//
// Layout: q, k, v, out take any strides but a unit one along their last dim (q, k, v are made so
// here; out must be); the gating inputs any strides. The pool [N, Hv, K, V] takes any slot stride
// with each slot's [Hv, K, V] dense, and is read and written only at the slots named. Each work
// item (sequence, v head) is run whole by one thread, so results do not depend on the thread count.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gdn_params.h"

#define KV_GDN_ISA_NS generic
#include "gdn_kernel.h"
#undef KV_GDN_ISA_NS

#include "cpu_common.h"

#if KV_X86_BUILDS
namespace kv_gdn {
namespace avx2 {
void run_range(const Params& p, int64_t begin, int64_t end);
}
namespace avx512 {
void run_range(const Params& p, int64_t begin, int64_t end);
}
namespace avx512bf16 {  // bf16 v only
void run_range(const Params& p, int64_t begin, int64_t end);
}
}  // namespace kv_gdn
#endif

namespace kv_gdn {
namespace {

// Below this many state-element updates (tokens x Hv x K x V) a parallel region's ~1-2 us costs
// more than a second thread saves.
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

const std::array<RangeFn, 3>& impl() {
  static const std::array<RangeFn, 3> k = kv_cpu::per_dtype_builds<RangeFn>(
      {
          generic::run_range,
#if KV_X86_BUILDS
          avx2::run_range,
          avx512::run_range,
          avx512bf16::run_range,
#endif
      },
      static_cast<int>(DType::BF16));
  return k;
}

std::string isa_name(RangeFn f) {
#if KV_X86_BUILDS
  if (f == avx2::run_range) return "avx2";
  if (f == avx512::run_range) return "avx512";
  if (f == avx512bf16::run_range) return "avx512bf16";
#endif
  return "default";
}

bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// t with a unit stride along its last dim (a copy only where it lacks one).
at::Tensor unit_last(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  if (t.size(-1) > 1 && t.stride(-1) != 1) return t.clone(at::MemoryFormat::Contiguous);
  return t;
}

// A per-head [Hv] vector as contiguous fp32 (a copy only where it is not already).
at::Tensor per_head(const at::Tensor& t, int64_t H, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == H, name, " must be [Hv=", H, "], got ", t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), name, " must be floating point, got ", t.scalar_type());
  if (t.scalar_type() == at::kFloat && (t.stride(0) == 1 || H <= 1)) return t;
  return t.to(at::kFloat).contiguous();
}

// Index tensor [n] (int32 / int64, any stride) as int64 values.
std::vector<int64_t> indices(const at::Tensor& t, int64_t n, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must be [", n, "], got ", t.sizes());
  std::vector<int64_t> v(static_cast<size_t>(n));
  const int64_t st = t.stride(0);
  if (t.scalar_type() == at::kInt) {
    const int32_t* d = t.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) v[i] = d[i * st];
  } else if (t.scalar_type() == at::kLong) {
    const int64_t* d = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) v[i] = d[i * st];
  } else {
    TORCH_CHECK(false, name, " must be int32 or int64, got ", t.scalar_type());
  }
  return v;
}

// cu_seqlens [B+1] checked against T (None: `none`).
std::vector<int64_t> offsets(const c10::optional<at::Tensor>& cu_seqlens, int64_t T, std::vector<int64_t> none) {
  std::vector<int64_t> cu = std::move(none);
  if (given(cu_seqlens)) {
    check_cpu(*cu_seqlens, "cu_seqlens");
    TORCH_CHECK(cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 1, "cu_seqlens must be [B+1], got ",
                cu_seqlens->sizes());
    cu = indices(*cu_seqlens, cu_seqlens->size(0), "cu_seqlens");
  }
  const int64_t Bn = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(cu[0] == 0 && cu[Bn] == T, "cu_seqlens must run from 0 to T=", T);
  for (int64_t b = 0; b < Bn; ++b) TORCH_CHECK(cu[b] <= cu[b + 1], "cu_seqlens must be non-decreasing");
  return cu;
}

// What the Params point into, kept alive for the call.
struct Inputs {
  at::Tensor q, k, v, ga, gb, A_log, dt_bias, out;
};

// q, k [T, Hk, K] (one dtype: both fp32 where they differ), v [T, Hv, V], the two gating inputs
// [T, Hv] (one dtype likewise), the output; returns T.
int64_t set_tokens(Params& p, Inputs& in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& ga, const at::Tensor& gb, const char* ga_name, const char* gb_name,
                   const c10::optional<at::Tensor>& out, bool l2norm, const c10::optional<double>& scale) {
  in.q = unit_last(q, "q");
  in.k = unit_last(k, "k");
  in.v = unit_last(v, "v");
  TORCH_CHECK(in.q.dim() == 3, "q must be [T, Hk, K], got ", in.q.sizes());
  TORCH_CHECK(in.k.sizes() == in.q.sizes(), "k must be ", in.q.sizes(), ", got ", in.k.sizes());
  const int64_t T = in.q.size(0);
  TORCH_CHECK(in.v.dim() == 3 && in.v.size(0) == T, "v must be [T=", T, ", Hv, V], got ", in.v.sizes());
  p.Hk = in.q.size(1);
  p.K = in.q.size(2);
  p.Hv = in.v.size(1);
  p.V = in.v.size(2);
  TORCH_CHECK(p.Hk >= 1 && p.Hv % p.Hk == 0, "Hv=", p.Hv, " must be a multiple of Hk=", p.Hk);
  TORCH_CHECK(p.K >= 1 && p.V >= 1, "K and V must be positive");
  if (in.q.scalar_type() != in.k.scalar_type()) {
    in.q = in.q.to(at::kFloat);
    in.k = in.k.to(at::kFloat);
  }
  p.qdtype = kv_cpu::kernel_dtype<DType>(in.q.scalar_type(), "q");
  p.vdtype = kv_cpu::kernel_dtype<DType>(in.v.scalar_type(), "v");
  check_cpu(ga, ga_name);
  check_cpu(gb, gb_name);
  TORCH_CHECK(ga.dim() == 2 && ga.size(0) == T && ga.size(1) == p.Hv, ga_name, " must be [T=", T, ", Hv=", p.Hv,
              "], got ", ga.sizes());
  TORCH_CHECK(gb.sizes() == ga.sizes(), gb_name, " must be ", ga.sizes(), ", got ", gb.sizes());
  in.ga = ga;
  in.gb = gb;
  if (ga.scalar_type() != gb.scalar_type()) {
    in.ga = ga.to(at::kFloat);
    in.gb = gb.to(at::kFloat);
  }
  p.gdtype = kv_cpu::kernel_dtype<DType>(in.ga.scalar_type(), ga_name);
  if (given(out)) {
    const at::Tensor& o = *out;
    check_cpu(o, "out");
    TORCH_CHECK(o.scalar_type() == in.v.scalar_type(), "out dtype ", o.scalar_type(), " must match v dtype ",
                in.v.scalar_type());
    TORCH_CHECK(o.sizes() == in.v.sizes(), "out must be ", in.v.sizes(), ", got ", o.sizes());
    TORCH_CHECK(o.size(-1) <= 1 || o.stride(-1) == 1, "out must have a unit stride along V");
    in.out = o;
  } else {
    in.out = kv_cpu::alloc_out(in.v);
  }
  p.q = in.q.data_ptr();
  std::tie(p.q_st, p.q_sh) = std::make_tuple(in.q.stride(0), in.q.stride(1));
  p.k = in.k.data_ptr();
  std::tie(p.k_st, p.k_sh) = std::make_tuple(in.k.stride(0), in.k.stride(1));
  p.v = in.v.data_ptr();
  std::tie(p.v_st, p.v_sh) = std::make_tuple(in.v.stride(0), in.v.stride(1));
  p.out = in.out.data_ptr();
  std::tie(p.o_st, p.o_sh) = std::make_tuple(in.out.stride(0), in.out.stride(1));
  p.ga = in.ga.data_ptr();
  std::tie(p.ga_st, p.ga_sh) = std::make_tuple(in.ga.stride(0), in.ga.stride(1));
  p.gb = in.gb.data_ptr();
  std::tie(p.gb_st, p.gb_sh) = std::make_tuple(in.gb.stride(0), in.gb.stride(1));
  p.l2norm = l2norm;
  p.scale = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(p.K)));
  return T;
}

// The pool [N, Hv, K, V]: any slot stride, each slot's [Hv, K, V] dense. Returns N.
int64_t set_pool(Params& p, const at::Tensor& s) {
  check_cpu(s, "state");
  TORCH_CHECK(s.dim() == 4 && s.size(1) == p.Hv && s.size(2) == p.K && s.size(3) == p.V, "state must be [N, Hv=",
              p.Hv, ", K=", p.K, ", V=", p.V, "], got ", s.sizes());
  const bool dense = (s.size(3) <= 1 || s.stride(3) == 1) && (s.size(2) <= 1 || s.stride(2) == p.V) &&
                     (s.size(1) <= 1 || s.stride(1) == p.K * p.V);
  TORCH_CHECK(dense, "state: each slot's [Hv, K, V] must be dense (strides ", s.strides(), ")");
  p.sdtype = kv_cpu::kernel_dtype<DType>(s.scalar_type(), "state");
  p.state = s.data_ptr();
  p.state_ss = s.stride(0);
  return s.size(0);
}

void run(const Params& p, int64_t tokens) {
  const RangeFn fn = impl()[static_cast<int>(p.vdtype)];
  const int64_t items = p.nseq * p.Hv;
  if (items == 0) return;
  const int64_t work = std::max<int64_t>(tokens, p.nseq) * p.Hv * p.K * p.V;
  if (work < kMinParallelWork || at::get_num_threads() == 1 || at::in_parallel_region()) {
    fn(p, 0, items);
    return;
  }
  at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) { fn(p, b, e); });
}

}  // namespace

// Decode / verify: q, k [T, Hk, K]; v [T, Hv, V]; a, b [T, Hv]; A_log, dt_bias [Hv]; the pool
// state [N, Hv, K, V] read and written in place at state_indices [B] (None: slot b); cu_seqlens
// [B+1] (None: B = T sequences of one token). Returns o [T, Hv, V] (out, or a new tensor).
at::Tensor update(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                  const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& state,
                  const c10::optional<at::Tensor>& state_indices, const c10::optional<at::Tensor>& cu_seqlens,
                  bool use_qk_l2norm, const c10::optional<double>& scale, double softplus_beta,
                  double softplus_threshold, int64_t pad_slot_id, const c10::optional<at::Tensor>& out) {
  Params p{};
  Inputs in;
  const int64_t T = set_tokens(p, in, q, k, v, a, b, "a", "b", out, use_qk_l2norm, scale);
  p.fused = true;
  in.A_log = per_head(A_log, p.Hv, "A_log");
  in.dt_bias = per_head(dt_bias, p.Hv, "dt_bias");
  p.A_log = in.A_log.data_ptr<float>();
  p.dt_bias = in.dt_bias.data_ptr<float>();
  p.sp_beta = static_cast<float>(softplus_beta);
  p.sp_threshold = static_cast<float>(softplus_threshold);
  const int64_t N = set_pool(p, state);
  std::vector<int64_t> one(static_cast<size_t>(T + 1));
  for (int64_t t = 0; t <= T; ++t) one[t] = t;
  const std::vector<int64_t> cu = offsets(cu_seqlens, T, std::move(one));
  const int64_t Bn = static_cast<int64_t>(cu.size()) - 1;
  std::vector<int64_t> slot(static_cast<size_t>(Bn));
  if (given(state_indices)) slot = indices(*state_indices, Bn, "state_indices");
  else for (int64_t i = 0; i < Bn; ++i) slot[i] = i;
  std::vector<Seq> seqs(static_cast<size_t>(Bn));
  for (int64_t i = 0; i < Bn; ++i) {
    const bool pad = slot[i] == pad_slot_id;
    TORCH_CHECK(pad || (slot[i] >= 0 && slot[i] < N), "sequence ", i, ": slot ", slot[i], " out of range [0, ", N,
                ")");
    seqs[i] = Seq{cu[i], cu[i + 1] - cu[i], pad ? -1 : slot[i], true, pad};
  }
  p.seqs = seqs.data();
  p.nseq = Bn;
  run(p, T);
  kv_cpu::mark_written(in.out);
  kv_cpu::mark_written(state);
  return in.out;
}

// Prefill: q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; cu_seqlens [B+1] (None: one
// sequence); states None (zeros, nothing kept) or the pool [N, Hv, K, V], read at state_indices
// where has_init and written there. Returns o [T, Hv, V] (out, or a new tensor).
at::Tensor scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                const at::Tensor& beta, const c10::optional<at::Tensor>& cu_seqlens,
                const c10::optional<at::Tensor>& states, const c10::optional<at::Tensor>& state_indices,
                const c10::optional<at::Tensor>& has_init, bool use_qk_l2norm, const c10::optional<double>& scale,
                int64_t pad_slot_id, const c10::optional<at::Tensor>& out) {
  Params p{};
  Inputs in;
  const int64_t T = set_tokens(p, in, q, k, v, g, beta, "g", "beta", out, use_qk_l2norm, scale);
  p.fused = false;
  const std::vector<int64_t> cu = offsets(cu_seqlens, T, {0, T});
  const int64_t Bn = static_cast<int64_t>(cu.size()) - 1;
  std::vector<Seq> seqs(static_cast<size_t>(Bn));
  if (!given(states)) {
    for (int64_t i = 0; i < Bn; ++i) seqs[i] = Seq{cu[i], cu[i + 1] - cu[i], -1, false, false};
  } else {
    const int64_t N = set_pool(p, *states);
    std::vector<int64_t> slot(static_cast<size_t>(Bn));
    if (given(state_indices)) slot = indices(*state_indices, Bn, "state_indices");
    else for (int64_t i = 0; i < Bn; ++i) slot[i] = i;
    std::vector<bool> init(static_cast<size_t>(Bn), false);
    if (given(has_init)) {
      check_cpu(*has_init, "has_initial_state");
      const at::Tensor h = has_init->to(at::kBool);
      TORCH_CHECK(h.dim() == 1 && h.size(0) == Bn, "has_initial_state must be [B], got ", h.sizes());
      const bool* d = h.data_ptr<bool>();
      for (int64_t i = 0; i < Bn; ++i) init[i] = d[i * h.stride(0)];
    }
    for (int64_t i = 0; i < Bn; ++i) {
      const bool pad = slot[i] == pad_slot_id;
      TORCH_CHECK(pad || (slot[i] >= 0 && slot[i] < N), "sequence ", i, ": slot ", slot[i], " out of range [0, ",
                  N, ")");
      seqs[i] = Seq{cu[i], cu[i + 1] - cu[i], pad ? -1 : slot[i], init[i], pad};
    }
  }
  p.seqs = seqs.data();
  p.nseq = Bn;
  run(p, T);
  kv_cpu::mark_written(in.out);
  if (given(states)) kv_cpu::mark_written(*states);
  return in.out;
}

// Builds serving (float32, bfloat16, float16) v: default / avx2 / avx512 / avx512bf16.
std::tuple<std::string, std::string, std::string> isa() {
  const std::array<RangeFn, 3>& k = impl();
  return {isa_name(k[0]), isa_name(k[1]), isa_name(k[2])};
}

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("update", &update, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("a"), py::arg("b"), py::arg("A_log"),
        py::arg("dt_bias"), py::arg("state"), py::arg("state_indices") = py::none(),
        py::arg("cu_seqlens") = py::none(), py::arg("use_qk_l2norm") = true, py::arg("scale") = py::none(),
        py::arg("softplus_beta") = 1.0, py::arg("softplus_threshold") = 20.0, py::arg("pad_slot_id") = -1,
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "gated_delta_rule_update: q/k [T, Hk, K], v [T, Hv, V], a/b [T, Hv], A_log/dt_bias [Hv], state pool "
        "[N, Hv, K, V] updated in place; returns o (out, or a new tensor of v's shape and dtype).");
  m.def("scan", &scan, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
        py::arg("cu_seqlens") = py::none(), py::arg("states") = py::none(), py::arg("state_indices") = py::none(),
        py::arg("has_init") = py::none(), py::arg("use_qk_l2norm") = true, py::arg("scale") = py::none(),
        py::arg("pad_slot_id") = -1, py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "chunk_gated_delta_rule: q/k [T, Hk, K], v [T, Hv, V], g/beta [T, Hv], cu_seqlens [B+1]; the pool's slots "
        "read (has_init) and written; returns o (out, or a new tensor of v's shape and dtype).");
  m.def("gdn_isa", &isa, "Builds serving (float32, bfloat16, float16) v: default / avx2 / avx512 / avx512bf16.");
}

}  // namespace kv_gdn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { kv_gdn::bind(m); }
