// Mamba2's selective scan on the CPU: the decode / verify step (selective_state_update) and the
// varlen prefill (ssd_chunk_scan: token by token, or in the chunked SSD form), one kernel
// (ssm_scan_kernel.h) for both.
//
// This TU holds the torch bindings, argument checks, the parallel split over (sequence, head)
// and the portable (baseline-ISA) build; the AVX2 / AVX-512 / AVX-512+BF16 builds
// (ssm_scan_avx*.cpp) are chosen once at run time with kv_cpu::isa_level(). It comes first in
// the extension's source list: for inline functions emitted by several TUs the linker keeps the
// first copy, which has to be the baseline-ISA one.
//
// Layout: x, z, out take any strides but a unit one along P, B and C a unit one along S (other
// inputs are made so here; out must be). The pool [N, H, P, S] takes any slot stride with each
// slot's [H, P, S] dense, and is read and written only at the slots named. A (and D, dt_bias)
// are [H], converted to fp32 where they are not already. Each work item (sequence, head) is run
// whole by one thread, so results do not depend on the thread count.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "ssm_scan_params.h"

#define KV_SSM_ISA_NS generic
#include "ssm_scan_kernel.h"
#undef KV_SSM_ISA_NS

#include "cpu_common.h"

#if KV_X86_BUILDS
namespace kv_ssm {
namespace avx2 {
void run_range(const Params& p, int64_t begin, int64_t end);
}
namespace avx512 {
void run_range(const Params& p, int64_t begin, int64_t end);
}
namespace avx512bf16 {  // bf16 x only
void run_range(const Params& p, int64_t begin, int64_t end);
}
}  // namespace kv_ssm
#endif

namespace kv_ssm {
namespace {

// Below this many state-element updates (tokens x P x S, all items) a parallel region's ~1-2 us
// costs more than a second thread saves.
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

// The chunked form's largest chunk (its Q x Q buffers per thread).
constexpr int64_t kMaxChunk = 512;

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

// A per-head [H] vector as contiguous fp32 (a copy only where it is not already).
at::Tensor per_head(const at::Tensor& t, int64_t H, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == H, name, " must be [H=", H, "], got ", t.sizes());
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

// What the call shares between the two ops: dt processing, A, D, dt_bias, the pool.
struct Common {
  at::Tensor A, D, dt_bias;  // kept alive for the pointers in Params
};

void set_dt(Params& p, Common& c, const at::Tensor& A, const c10::optional<at::Tensor>& D,
            const c10::optional<at::Tensor>& dt_bias, bool softplus, double dt_min, double dt_max) {
  c.A = per_head(A, p.H, "A");
  p.A = c.A.data_ptr<float>();
  if (given(D)) {
    c.D = per_head(*D, p.H, "D");
    p.D = c.D.data_ptr<float>();
  }
  if (given(dt_bias)) {
    c.dt_bias = per_head(*dt_bias, p.H, "dt_bias");
    p.dt_bias = c.dt_bias.data_ptr<float>();
  }
  p.softplus = softplus;
  // vLLM's rule: the clamp is applied only when a limit is set.
  p.clamp = dt_min > 0.0 || dt_max < std::numeric_limits<double>::infinity();
  p.dt_min = static_cast<float>(dt_min);
  p.dt_max = static_cast<float>(dt_max);
}

// The pool [N, H, P, S]: any slot stride, each slot's [H, P, S] dense.
void set_pool(Params& p, const at::Tensor& s) {
  check_cpu(s, "state");
  TORCH_CHECK(s.dim() == 4 && s.size(1) == p.H && s.size(2) == p.P && s.size(3) == p.S, "state must be [N, H=", p.H,
              ", P=", p.P, ", S=", p.S, "], got ", s.sizes());
  const bool dense = (s.size(3) <= 1 || s.stride(3) == 1) && (s.size(2) <= 1 || s.stride(2) == p.S) &&
                     (s.size(1) <= 1 || s.stride(1) == p.P * p.S);
  TORCH_CHECK(dense, "state: each slot's [H, P, S] must be dense (strides ", s.strides(), ")");
  p.sdtype = kv_cpu::kernel_dtype<DType>(s.scalar_type(), "state");
  p.state = s.data_ptr();
  p.state_ss = s.stride(0);
}

// The output: the caller's (x's shape and dtype, unit stride along P) or a new tensor.
at::Tensor output_for(const at::Tensor& x, const c10::optional<at::Tensor>& out) {
  if (!given(out)) return kv_cpu::alloc_out(x);
  const at::Tensor& o = *out;
  check_cpu(o, "out");
  TORCH_CHECK(o.scalar_type() == x.scalar_type(), "out dtype ", o.scalar_type(), " must match x dtype ",
              x.scalar_type());
  TORCH_CHECK(o.sizes() == x.sizes(), "out must be ", x.sizes(), ", got ", o.sizes());
  TORCH_CHECK(o.size(-1) <= 1 || o.stride(-1) == 1, "out must have a unit stride along P");
  return o;
}

void set_bc(Params& p, const at::Tensor& B, const at::Tensor& C) {
  TORCH_CHECK(B.scalar_type() == C.scalar_type(), "B and C must share a dtype, got ", B.scalar_type(), " and ",
              C.scalar_type());
  p.bdtype = kv_cpu::kernel_dtype<DType>(B.scalar_type(), "B");
  p.B = B.data_ptr();
  p.C = C.data_ptr();
}

void run(const Params& p, int64_t tokens) {
  const RangeFn fn = impl()[static_cast<int>(p.xdtype)];
  const int64_t items = p.nseq * p.H;
  if (items == 0) return;
  const int64_t work = std::max<int64_t>(tokens, p.nseq) * p.H * p.P * p.S;
  if (work < kMinParallelWork || at::get_num_threads() == 1 || at::in_parallel_region()) {
    fn(p, 0, items);
    return;
  }
  at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) { fn(p, b, e); });
}

}  // namespace

// selective_state_update: x [B, T, H, P]; dt [B, T, H]; B, C [B, T, G, S]; z like x; state pool
// [N, H, P, S] updated in place at the slots src_idx (read) and dst_idx (written).
at::Tensor update(const at::Tensor& state, const at::Tensor& x_in, const at::Tensor& dt, const at::Tensor& A,
                  const at::Tensor& B_in, const at::Tensor& C_in, const c10::optional<at::Tensor>& D,
                  const c10::optional<at::Tensor>& z_in, const c10::optional<at::Tensor>& dt_bias, bool dt_softplus,
                  double dt_min, double dt_max, const c10::optional<at::Tensor>& src_idx,
                  const c10::optional<at::Tensor>& dst_idx, int64_t pad_slot_id,
                  const c10::optional<at::Tensor>& out_arg) {
  const at::Tensor x = unit_last(x_in, "x");
  TORCH_CHECK(x.dim() == 4, "x must be [B, T, H, P], got ", x.sizes());
  const int64_t Bn = x.size(0), T = x.size(1);
  Params p{};
  p.xdtype = kv_cpu::kernel_dtype<DType>(x.scalar_type(), "x");
  p.H = x.size(2);
  p.P = x.size(3);
  const at::Tensor Bm = unit_last(B_in, "B"), Cm = unit_last(C_in, "C");
  TORCH_CHECK(Bm.dim() == 4 && Bm.size(0) == Bn && Bm.size(1) == T, "B must be [B, T, G, S], got ", Bm.sizes());
  TORCH_CHECK(Cm.sizes() == Bm.sizes(), "C must be ", Bm.sizes(), ", got ", Cm.sizes());
  p.G = Bm.size(2);
  p.S = Bm.size(3);
  TORCH_CHECK(p.G >= 1 && p.H % p.G == 0, "H=", p.H, " must be a multiple of G=", p.G);
  check_cpu(dt, "dt");
  TORCH_CHECK(dt.dim() == 3 && dt.size(0) == Bn && dt.size(1) == T && dt.size(2) == p.H, "dt must be [B, T, H], got ",
              dt.sizes());
  set_pool(p, state);
  Common c;
  set_dt(p, c, A, D, dt_bias, dt_softplus, dt_min, dt_max);
  set_bc(p, Bm, Cm);
  p.dtdtype = kv_cpu::kernel_dtype<DType>(dt.scalar_type(), "dt");
  at::Tensor z;
  if (given(z_in)) {
    z = unit_last(*z_in, "z");
    TORCH_CHECK(z.sizes() == x.sizes() && z.scalar_type() == x.scalar_type(), "z must be x's shape and dtype");
    p.z = z.data_ptr();
    std::tie(p.z_sb, p.z_st, p.z_sh) = std::make_tuple(z.stride(0), z.stride(1), z.stride(2));
  }
  at::Tensor out = output_for(x, out_arg);
  p.x = x.data_ptr();
  std::tie(p.x_sb, p.x_st, p.x_sh) = std::make_tuple(x.stride(0), x.stride(1), x.stride(2));
  p.out = out.data_ptr();
  std::tie(p.o_sb, p.o_st, p.o_sh) = std::make_tuple(out.stride(0), out.stride(1), out.stride(2));
  p.dt = dt.data_ptr();
  std::tie(p.dt_sb, p.dt_st, p.dt_sh) = std::make_tuple(dt.stride(0), dt.stride(1), dt.stride(2));
  std::tie(p.b_sb, p.b_st, p.b_sg) = std::make_tuple(Bm.stride(0), Bm.stride(1), Bm.stride(2));
  std::tie(p.c_sb, p.c_st, p.c_sg) = std::make_tuple(Cm.stride(0), Cm.stride(1), Cm.stride(2));

  std::vector<int64_t> src(static_cast<size_t>(Bn)), dst;
  if (given(src_idx)) src = indices(*src_idx, Bn, "state_batch_indices");
  else for (int64_t b = 0; b < Bn; ++b) src[b] = b;
  dst = given(dst_idx) ? indices(*dst_idx, Bn, "dst_state_batch_indices") : src;
  std::vector<Seq> seqs(static_cast<size_t>(Bn));
  const int64_t N = state.size(0);
  for (int64_t b = 0; b < Bn; ++b) {
    const bool pad = src[b] == pad_slot_id || dst[b] == pad_slot_id;
    TORCH_CHECK(pad || (src[b] >= 0 && src[b] < N && dst[b] >= 0 && dst[b] < N), "sequence ", b, ": slot ",
                src[b], " -> ", dst[b], " out of range [0, ", N, ")");
    seqs[b] = Seq{0, T, src[b], dst[b], pad};
  }
  p.seqs = seqs.data();
  p.nseq = Bn;
  run(p, Bn * T);
  kv_cpu::mark_written(out);
  kv_cpu::mark_written(state);
  return out;
}

// ssd_chunk_scan (token by token, or chunked: ssm_scan_kernel.h): x [T, H, P]; dt [T, H]; B, C [T, G, S]; z like x; cu_seqlens
// [B+1] (None: one sequence); states: None or the pool [N, H, P, S], read at state_idx where
// has_init and written at state_idx.
at::Tensor scan(const at::Tensor& x_in, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B_in,
                const at::Tensor& C_in, const c10::optional<at::Tensor>& cu_seqlens,
                const c10::optional<at::Tensor>& D, const c10::optional<at::Tensor>& z_in,
                const c10::optional<at::Tensor>& dt_bias, bool dt_softplus, double dt_min, double dt_max,
                const c10::optional<at::Tensor>& states, const c10::optional<at::Tensor>& state_idx,
                const c10::optional<at::Tensor>& has_init, int64_t pad_slot_id,
                const c10::optional<at::Tensor>& out_arg, int64_t chunk) {
  const at::Tensor x = unit_last(x_in, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [T, H, P], got ", x.sizes());
  TORCH_CHECK(chunk >= 0 && chunk <= kMaxChunk, "chunk must be in [0, ", kMaxChunk, "], got ", chunk);
  const int64_t T = x.size(0);
  Params p{};
  p.chunk = chunk;
  p.xdtype = kv_cpu::kernel_dtype<DType>(x.scalar_type(), "x");
  p.H = x.size(1);
  p.P = x.size(2);
  const at::Tensor Bm = unit_last(B_in, "B"), Cm = unit_last(C_in, "C");
  TORCH_CHECK(Bm.dim() == 3 && Bm.size(0) == T, "B must be [T, G, S], got ", Bm.sizes());
  TORCH_CHECK(Cm.sizes() == Bm.sizes(), "C must be ", Bm.sizes(), ", got ", Cm.sizes());
  p.G = Bm.size(1);
  p.S = Bm.size(2);
  TORCH_CHECK(p.G >= 1 && p.H % p.G == 0, "H=", p.H, " must be a multiple of G=", p.G);
  check_cpu(dt, "dt");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == T && dt.size(1) == p.H, "dt must be [T, H], got ", dt.sizes());
  Common c;
  set_dt(p, c, A, D, dt_bias, dt_softplus, dt_min, dt_max);
  set_bc(p, Bm, Cm);
  p.dtdtype = kv_cpu::kernel_dtype<DType>(dt.scalar_type(), "dt");
  at::Tensor z;
  if (given(z_in)) {
    z = unit_last(*z_in, "z");
    TORCH_CHECK(z.sizes() == x.sizes() && z.scalar_type() == x.scalar_type(), "z must be x's shape and dtype");
    p.z = z.data_ptr();
    std::tie(p.z_st, p.z_sh) = std::make_tuple(z.stride(0), z.stride(1));
  }
  at::Tensor out = output_for(x, out_arg);
  p.x = x.data_ptr();
  std::tie(p.x_st, p.x_sh) = std::make_tuple(x.stride(0), x.stride(1));
  p.out = out.data_ptr();
  std::tie(p.o_st, p.o_sh) = std::make_tuple(out.stride(0), out.stride(1));
  p.dt = dt.data_ptr();
  std::tie(p.dt_st, p.dt_sh) = std::make_tuple(dt.stride(0), dt.stride(1));
  std::tie(p.b_st, p.b_sg) = std::make_tuple(Bm.stride(0), Bm.stride(1));
  std::tie(p.c_st, p.c_sg) = std::make_tuple(Cm.stride(0), Cm.stride(1));

  std::vector<int64_t> cu;
  if (given(cu_seqlens)) {
    check_cpu(*cu_seqlens, "cu_seqlens");
    TORCH_CHECK(cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 1, "cu_seqlens must be [B+1], got ",
                cu_seqlens->sizes());
    cu = indices(*cu_seqlens, cu_seqlens->size(0), "cu_seqlens");
  } else {
    cu = {0, T};
  }
  const int64_t Bn = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(cu[0] == 0 && cu[Bn] == T, "cu_seqlens must run from 0 to T=", T);
  for (int64_t b = 0; b < Bn; ++b) TORCH_CHECK(cu[b] <= cu[b + 1], "cu_seqlens must be non-decreasing");
  std::vector<int64_t> slot(static_cast<size_t>(Bn));
  std::vector<bool> init(static_cast<size_t>(Bn), false);
  int64_t N = 0;
  if (given(states)) {
    set_pool(p, *states);
    N = states->size(0);
    if (given(state_idx)) slot = indices(*state_idx, Bn, "state_indices");
    else for (int64_t b = 0; b < Bn; ++b) slot[b] = b;
    if (given(has_init)) {
      const at::Tensor h = has_init->to(at::kBool);
      TORCH_CHECK(h.dim() == 1 && h.size(0) == Bn, "has_initial_state must be [B], got ", h.sizes());
      const bool* d = h.data_ptr<bool>();
      for (int64_t b = 0; b < Bn; ++b) init[b] = d[b * h.stride(0)];
    }
  }
  std::vector<Seq> seqs(static_cast<size_t>(Bn));
  for (int64_t b = 0; b < Bn; ++b) {
    const int64_t n = cu[b + 1] - cu[b];
    if (!given(states)) {
      seqs[b] = Seq{cu[b], n, -1, -1, false};
      continue;
    }
    const bool pad = slot[b] == pad_slot_id;
    TORCH_CHECK(pad || (slot[b] >= 0 && slot[b] < N), "sequence ", b, ": slot ", slot[b], " out of range [0, ", N,
                ")");
    seqs[b] = Seq{cu[b], n, init[b] ? slot[b] : -1, slot[b], pad};
  }
  p.seqs = seqs.data();
  p.nseq = Bn;
  run(p, T);
  kv_cpu::mark_written(out);
  if (given(states)) kv_cpu::mark_written(*states);
  return out;
}

// Builds serving (float32, bfloat16, float16) x: default / avx2 / avx512 / avx512bf16.
std::tuple<std::string, std::string, std::string> isa() {
  const std::array<RangeFn, 3>& k = impl();
  return {isa_name(k[0]), isa_name(k[1]), isa_name(k[2])};
}

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("update", &update, py::arg("state"), py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"),
        py::arg("D") = py::none(), py::arg("z") = py::none(), py::arg("dt_bias") = py::none(),
        py::arg("dt_softplus") = false, py::arg("dt_min") = 0.0,
        py::arg("dt_max") = std::numeric_limits<double>::infinity(), py::arg("src_idx") = py::none(),
        py::arg("dst_idx") = py::none(), py::arg("pad_slot_id") = -1, py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "selective_state_update: x [B, T, H, P], dt [B, T, H], B/C [B, T, G, S], state pool [N, H, P, S] "
        "updated in place; returns y (out, or a new tensor of x's shape and dtype).");
  m.def("scan", &scan, py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"),
        py::arg("cu_seqlens") = py::none(), py::arg("D") = py::none(), py::arg("z") = py::none(),
        py::arg("dt_bias") = py::none(), py::arg("dt_softplus") = false, py::arg("dt_min") = 0.0,
        py::arg("dt_max") = std::numeric_limits<double>::infinity(), py::arg("states") = py::none(),
        py::arg("state_idx") = py::none(), py::arg("has_init") = py::none(), py::arg("pad_slot_id") = -1,
        py::arg("out") = py::none(), py::arg("chunk") = 0, py::call_guard<py::gil_scoped_release>(),
        "ssd_chunk_scan: x [T, H, P], dt [T, H], B/C [T, G, S], cu_seqlens [B+1]; the pool's slots read "
        "(has_init) and written; chunk 0: token by token, Q > 0: the chunked (SSD) form in chunks of Q "
        "tokens; returns y (out, or a new tensor of x's shape and dtype).");
  m.def("ssm_scan_isa", &isa, "Builds serving (float32, bfloat16, float16) x: default / avx2 / avx512 / avx512bf16.");
}

}  // namespace kv_ssm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { kv_ssm::bind(m); }
