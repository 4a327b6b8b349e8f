// Fused CPU causal depthwise conv1d (+SiLU) with in-place conv-state update.
//
// This TU holds the torch bindings, argument checks, work decomposition and
// the portable (baseline-ISA) kernel build; the AVX2 / AVX-512 /
// AVX-512+BF16 builds of the same kernel (causal_conv1d_avx*.cpp) are chosen
// once at runtime. It must stay first in the source list: for inline
// functions emitted by several TUs the linker keeps the first copy, and that
// copy has to be the baseline-ISA one.
//
// Layout requirements: x needs stride(-1) == 1 (any batch / time strides);
// weight [D, W], bias [D] and the index tensors may have any strides;
// conv_states is read and written in place through all three of its strides
// (stride(-1) != 1 works, on a slower scalar path). out is a new contiguous
// tensor of x's shape and dtype, or the caller's (x's shape and dtype, unit
// channel stride, any other strides), which may be x itself.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "causal_conv1d_params.h"

#define KV_ISA_NS generic
#include "causal_conv1d_kernel.h"
#undef KV_ISA_NS

#include "cpu_common.h"

#if KV_X86_BUILDS
namespace kv_cconv {
namespace avx2 {
void fwd_range(const Params& p, int64_t begin, int64_t end);
void update_range(const Params& p, int64_t begin, int64_t end);
}  // namespace avx2
namespace avx512 {
void fwd_range(const Params& p, int64_t begin, int64_t end);
void update_range(const Params& p, int64_t begin, int64_t end);
}  // namespace avx512
namespace avx512bf16 {  // bf16 data only
void fwd_range(const Params& p, int64_t begin, int64_t end);
void update_range(const Params& p, int64_t begin, int64_t end);
}  // namespace avx512bf16
}  // namespace kv_cconv
#endif

namespace kv_cconv {
namespace {

// Below this many output elements a parallel region costs more than it
// saves (decode with small B). Not lower: what a 2-thread team costs to start
// and join varies in stretches on a shared VM (AMD EPYC, KVM): from 32K
// elements the team won (B=8 D=4096 decode: 1.18x) in one stretch and lost
// (0.75-0.79x) in the next, where the serial call is the same in both.
constexpr int64_t kSerialWork = int64_t{1} << 16;
constexpr int64_t kChunkT = 256;
constexpr int64_t kMinChunkT = 32;
// Largest x (bytes) for the kernel's alias-safe block path (see the kernel header); above it
// the call streams from DRAM, where the window path's row-wise sweep and prefetch do better.
constexpr int64_t kBlockPathBytes = int64_t{8} << 20;

// One build's kernel entry points.
struct Fns {
  RangeFn fwd;
  RangeFn upd;
};

// Per data dtype (indexed by DType), chosen once.
const std::array<Fns, 3>& impl() {
  static const std::array<Fns, 3> k = kv_cpu::per_dtype_builds<Fns>(
      {
          {generic::fwd_range, generic::update_range},
#if KV_X86_BUILDS
          {avx2::fwd_range, avx2::update_range},
          {avx512::fwd_range, avx512::update_range},
          {avx512bf16::fwd_range, avx512bf16::update_range},
#endif
      },
      static_cast<int>(DType::BF16));
  return k;
}

DType to_dtype(const at::Tensor& t, const char* name) {
  return kv_cpu::kernel_dtype<DType>(t.scalar_type(), name);
}

// Read-only view of a small 1-D index / flag tensor of any integer or bool
// dtype and any stride.
struct IndexView {
  const void* data = nullptr;
  int64_t stride = 0;
  at::ScalarType type = at::kLong;

  bool present() const { return data != nullptr; }
  int64_t operator[](int64_t i) const {
    const int64_t o = i * stride;
    switch (type) {
      case at::kInt:
        return static_cast<const int32_t*>(data)[o];
      case at::kLong:
        return static_cast<const int64_t*>(data)[o];
      case at::kBool:
        return static_cast<const bool*>(data)[o] ? 1 : 0;
      case at::kByte:
        return static_cast<const uint8_t*>(data)[o];
      case at::kChar:
        return static_cast<const int8_t*>(data)[o];
      case at::kShort:
        return static_cast<const int16_t*>(data)[o];
      default:
        return 0;  // rejected in index_view
    }
  }
};

IndexView index_view(const c10::optional<at::Tensor>& t, const char* name,
                     int64_t min_len) {
  IndexView v;
  if (!t.has_value() || !t->defined()) return v;
  const at::Tensor& a = *t;
  TORCH_CHECK(a.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(a.dim() == 1, name, " must be 1-D, got ", a.dim(), "-D");
  TORCH_CHECK(a.size(0) >= min_len, name, " has ", a.size(0),
              " entries, need ", min_len);
  switch (a.scalar_type()) {
    case at::kInt:
    case at::kLong:
    case at::kBool:
    case at::kByte:
    case at::kChar:
    case at::kShort:
      break;
    default:
      TORCH_CHECK(false, name, ": expected an integer or bool tensor, got ",
                  a.scalar_type());
  }
  v.data = a.data_ptr();
  v.stride = a.stride(0);
  v.type = a.scalar_type();
  return v;
}

// Fills the weight / bias fields of p; returns the filter width.
int fill_filter(Params& p, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias, int64_t D) {
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D, "weight must be [D=",
              D, ", W], got ", weight.sizes());
  const int64_t W = weight.size(1);
  TORCH_CHECK(W >= 2 && W <= 4, "filter width W must be 2, 3 or 4, got ", W);
  p.wdtype = to_dtype(weight, "weight");
  p.weight = weight.data_ptr();
  p.w_sd = weight.stride(0);
  p.w_sk = weight.stride(1);
  p.bias = nullptr;
  p.bdtype = p.wdtype;
  p.b_sd = 0;
  if (bias.has_value() && bias->defined()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.device().is_cpu(), "bias must be a CPU tensor");
    TORCH_CHECK(b.dim() == 1 && b.size(0) == D, "bias must be [D=", D,
                "], got ", b.sizes());
    p.bdtype = to_dtype(b, "bias");
    p.bias = b.data_ptr();
    p.b_sd = b.stride(0);
  }
  p.width = static_cast<int32_t>(W);
  return static_cast<int>(W);
}

void fill_state(Params& p, const at::Tensor& st, const at::Tensor& x,
                int64_t D, int W, const char* name) {
  TORCH_CHECK(st.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(st.scalar_type() == x.scalar_type(), name, " dtype ",
              st.scalar_type(), " must match x dtype ", x.scalar_type());
  TORCH_CHECK(st.dim() == 3 && st.size(2) == D, name, " must be [N, S, D=", D,
              "], got ", st.sizes());
  TORCH_CHECK(st.size(1) >= W - 1, name, " has S=", st.size(1),
              " rows, need at least W-1=", W - 1);
  p.state = st.data_ptr();
  p.st_sn = st.stride(0);
  p.st_ss = st.stride(1);
  p.st_sd = st.stride(2);
  p.st_rows = st.size(1);
}

// The caller's output tensor, or a new one. `out` may be x itself (both kernels read a
// row's x values before writing its outputs, see fwd); any other shared byte is refused.
at::Tensor output_for(const at::Tensor& x, const c10::optional<at::Tensor>& out) {
  if (!out.has_value() || !out->defined()) return kv_cpu::alloc_out(x, /*apart=*/true);
  const at::Tensor& o = *out;
  TORCH_CHECK(o.device().is_cpu(), "out must be a CPU tensor");
  TORCH_CHECK(o.scalar_type() == x.scalar_type(), "out dtype ", o.scalar_type(),
              " must match x dtype ", x.scalar_type());
  TORCH_CHECK(o.sizes() == x.sizes(), "out must have x's shape ", x.sizes(), ", got ",
              o.sizes());
  TORCH_CHECK(o.stride(-1) == 1 || o.size(-1) <= 1, "out must have stride(-1) == 1");
  if (o.numel() > 0 && o.data_ptr() == x.data_ptr()) {
    TORCH_CHECK(o.strides() == x.strides(), "out may be x itself but must not partly overlap it");
  } else {
    // A strided out interleaved with x is refused too; the dispatched op copies for such calls.
    TORCH_CHECK(!kv_cpu::bytes_overlap(o, x), "out must be x itself or apart from it, got a view that overlaps it");
  }
  return o;
}

// Tiles of equal width rather than kTileC-wide ones and a narrow remainder: the threads split
// the items by count, so a remainder tile left a thread short of work (D=3072 as 2048 + 1024
// ran 2 threads at 1.5x one, D=4160 at 1.3x; AMD EPYC, varlen prefill of 2048 tokens).
void set_tiles(Params& p, int64_t D) {
  const int64_t n = std::max<int64_t>(1, (D + kTileC - 1) / kTileC);
  const int64_t even = ((D + n - 1) / n + kTileAlign - 1) / kTileAlign * kTileAlign;
  p.tile_c = std::min(kTileC, even);
  p.n_tiles = std::max<int64_t>(1, (D + p.tile_c - 1) / p.tile_c);  // no empty last tile
}

void run(const Params& p, int64_t n_items, int64_t work, bool upd) {
  const int di = static_cast<int>(p.dtype);
  const RangeFn fn = upd ? impl()[di].upd : impl()[di].fwd;
  if (n_items <= 0) return;
  if (work < kSerialWork || n_items == 1 || at::get_num_threads() == 1) {
    fn(p, 0, n_items);
    return;
  }
  at::parallel_for(0, n_items, 1,
                   [&](int64_t b, int64_t e) { fn(p, b, e); });
}

}  // namespace

at::Tensor fwd(const at::Tensor& x, const at::Tensor& weight,
               const c10::optional<at::Tensor>& bias,
               const c10::optional<at::Tensor>& conv_states,
               const c10::optional<at::Tensor>& cache_indices,
               const c10::optional<at::Tensor>& has_initial_state,
               const c10::optional<at::Tensor>& query_start_loc, bool silu,
               int64_t pad_slot_id, const c10::optional<at::Tensor>& out_arg) {
  const bool varlen = query_start_loc.has_value() && query_start_loc->defined();
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor");
  TORCH_CHECK(x.dim() == (varlen ? 2 : 3), "x must be ",
              varlen ? "[T, D] with query_start_loc" : "[B, L, D]", ", got ",
              x.sizes());
  const int64_t D = x.size(-1);
  TORCH_CHECK(x.stride(-1) == 1 || D <= 1, "x must have stride(-1) == 1");

  Params p{};
  p.dtype = to_dtype(x, "x");
  const int W = fill_filter(p, weight, bias, D);
  p.silu = silu;
  p.dim = D;

  at::Tensor out = output_for(x, out_arg);
  const bool in_place = x.numel() > 0 && out.data_ptr() == x.data_ptr();
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.x_rs = x.stride(-2);
  p.out_rs = out.stride(-2);

  int64_t B = 0;
  IndexView qsl;
  if (varlen) {
    qsl = index_view(query_start_loc, "query_start_loc", 1);
    B = query_start_loc->size(0) - 1;
  } else {
    B = x.size(0);
  }
  const IndexView ci = index_view(cache_indices, "cache_indices", B);
  const IndexView his = index_view(has_initial_state, "has_initial_state", B);

  const bool has_state = conv_states.has_value() && conv_states->defined();
  int64_t n_slots = 0;
  if (has_state) {
    fill_state(p, *conv_states, x, D, W, "conv_states");
    n_slots = conv_states->size(0);
  }

  std::vector<Seq> seqs(static_cast<size_t>(B));
  const int64_t T = varlen ? x.size(0) : 0;
  int64_t covered_lo = 0, covered_hi = 0;
  for (int64_t b = 0; b < B; ++b) {
    Seq& s = seqs[b];
    if (varlen) {
      const int64_t lo = qsl[b], hi = qsl[b + 1];
      TORCH_CHECK(lo >= 0 && lo <= hi && hi <= T,
                  "query_start_loc must be non-decreasing within [0, ", T,
                  "], got [", lo, ", ", hi, "] for sequence ", b);
      if (b == 0) covered_lo = lo;
      covered_hi = hi;
      s.x_off = lo * x.stride(0);
      s.out_off = lo * out.stride(0);
      s.len = hi - lo;
    } else {
      s.x_off = b * x.stride(0);
      s.out_off = b * out.stride(0);
      s.len = x.size(1);
    }
    s.slot = ci.present() ? ci[b] : b;
    s.pad = ci.present() && s.slot == pad_slot_id;
    s.init = his.present() && his[b] != 0;
    s.hist_row = 0;
    s.shift = 0;
    if (!has_state || s.pad) {
      if (!has_state) s.slot = -1;
    } else {
      TORCH_CHECK(s.slot >= 0 && s.slot < n_slots, "cache index ", s.slot,
                  " of sequence ", b, " is outside conv_states[0:", n_slots,
                  "]");
    }
  }
  // Rows of a varlen x outside every sequence get zeros, not garbage.
  if (varlen && D > 0 && (covered_lo > 0 || covered_hi < T)) {
    if (covered_lo > 0) out.narrow(0, 0, covered_lo).zero_();
    if (covered_hi < T) out.narrow(0, covered_hi, T - covered_hi).zero_();
  }
  auto written = [&]() {
    kv_cpu::mark_written(out);
    if (has_state) kv_cpu::mark_written(*conv_states);
    return out;
  };
  if (B == 0 || D == 0) return written();

  set_tiles(p, D);
  p.seqs = seqs.data();
  p.nseq = B;

  // Time chunks split long sequences across threads when B is small; each
  // chunk re-reads only W-1 halo rows.
  int64_t rows = 0;
  for (const Seq& s : seqs) rows += s.len;
  auto count_items = [&](int64_t ct) {
    int64_t n = 0;
    for (const Seq& s : seqs) n += std::max<int64_t>(1, (s.len + ct - 1) / ct);
    return n * p.n_tiles;
  };
  const int64_t nthr = at::get_num_threads();
  int64_t chunk_t = kChunkT;
  while (chunk_t > kMinChunkT && count_items(chunk_t) < 4 * nthr) chunk_t /= 2;
  if (in_place) {
    // A later chunk would read its halo rows of x after the chunk before it overwrote them
    // with outputs, and a non-final first chunk copies x's last rows into the state: one
    // chunk per sequence reads every x row just before writing that row's outputs.
    chunk_t = 1;
    for (const Seq& s : seqs) chunk_t = std::max(chunk_t, s.len);
  }
  p.chunk_t = std::max<int64_t>(chunk_t, W - 1);

  int64_t per_tile = 0;
  for (Seq& s : seqs) {
    s.item0 = per_tile;
    per_tile += std::max<int64_t>(1, (s.len + p.chunk_t - 1) / p.chunk_t);
  }
  p.items_per_tile = per_tile;
  p.block_path = !in_place && rows * D * static_cast<int64_t>(x.element_size()) <= kBlockPathBytes;
  // A call that streams from DRAM gives each thread whole rows (every tile of its time chunks):
  // tile-major, two threads on two tiles each read every other 4 KiB of x's 8 KiB rows, and
  // in a serving-like process (the bench_vllm_cpu grid) their D=4096 prefill at 2 threads then
  // ran 0.8-1.5x one thread's speed where chunk-major ran 1.7-2.0x (AMD EPYC Zen 4). A cache-
  // sized call stays tile-major: its block path keeps one tile's split taps per thread.
  p.chunk_major = p.n_tiles > 1 && !p.block_path;
  run(p, per_tile * p.n_tiles, std::max<int64_t>(rows, B) * D, /*upd=*/false);
  return written();
}

at::Tensor update(const at::Tensor& x, const at::Tensor& conv_state,
                  const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias, bool silu,
                  const c10::optional<at::Tensor>& conv_state_indices,
                  const c10::optional<at::Tensor>& num_accepted_tokens,
                  int64_t pad_slot_id, const c10::optional<at::Tensor>& out_arg) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x must be [B, L, D] or [B, D], got ",
              x.sizes());
  const int64_t D = x.size(-1);
  TORCH_CHECK(x.stride(-1) == 1 || D <= 1, "x must have stride(-1) == 1");
  const int64_t B = x.size(0);
  const int64_t L = x.dim() == 3 ? x.size(1) : 1;

  Params p{};
  p.dtype = to_dtype(x, "x");
  const int W = fill_filter(p, weight, bias, D);
  p.silu = silu;
  p.dim = D;
  fill_state(p, conv_state, x, D, W, "conv_state");
  const int64_t S = p.st_rows;
  const int64_t n_slots = conv_state.size(0);

  // In place (out is x) is safe: each batch row's slot shift, which copies x, runs before
  // that row's outputs are stored, and rows never read one another.
  at::Tensor out = output_for(x, out_arg);
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.x_rs = x.dim() == 3 ? x.stride(1) : 0;
  p.out_rs = x.dim() == 3 ? out.stride(1) : 0;

  const IndexView ci = index_view(conv_state_indices, "conv_state_indices", B);
  const IndexView nat = index_view(num_accepted_tokens, "num_accepted_tokens", B);
  if (nat.present())
    TORCH_CHECK(S >= (W - 1) + (L - 1), "num_accepted_tokens needs S >= W-1+L-1 = ",
                (W - 1) + (L - 1), ", conv_state has S=", S);

  std::vector<Seq> seqs(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    Seq& s = seqs[b];
    s.x_off = b * x.stride(0);
    s.out_off = b * out.stride(0);
    s.len = L;
    s.slot = ci.present() ? ci[b] : b;
    s.pad = ci.present() && s.slot == pad_slot_id;
    s.init = true;
    s.item0 = 0;
    if (s.pad) continue;
    TORCH_CHECK(s.slot >= 0 && s.slot < n_slots, "conv_state index ", s.slot,
                " of row ", b, " is outside conv_state[0:", n_slots, "]");
    if (nat.present()) {
      const int64_t n = nat[b];
      TORCH_CHECK(n >= 1 && n <= L, "num_accepted_tokens[", b, "]=", n,
                  " must be in [1, L=", L, "]");
      s.hist_row = n - 1;
      s.shift = n;
    } else {
      s.hist_row = S - (W - 1);
      s.shift = L;
    }
  }
  auto written = [&]() {
    kv_cpu::mark_written(out);
    kv_cpu::mark_written(conv_state);
    return out;
  };
  if (B == 0 || D == 0) return written();

  set_tiles(p, D);
  p.seqs = seqs.data();
  p.nseq = B;
  // Batch rows per item: all of them below kSerialWork (one serial item),
  // else enough items to balance the threads (cut so even at 1 thread).
  const int64_t work = B * std::max<int64_t>(L, 1) * D;
  int64_t rows_per_item = B;
  if (work >= kSerialWork) {
    const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
    const int64_t chunks = std::min(B, std::max<int64_t>(1, want / p.n_tiles));
    rows_per_item = (B + chunks - 1) / chunks;
  }
  p.chunk_t = rows_per_item;
  run(p, (B + rows_per_item - 1) / rows_per_item * p.n_tiles, work,
      /*upd=*/true);
  return written();
}

// Which build of the kernel runs here: "avx512-bf16" (bf16 data on the AVX512-BF16 build,
// other dtypes on the AVX-512 one), "avx512", "avx2" or "scalar" (the portable build).
std::string isa_path() {
  switch (kv_cpu::isa_level()) {
    case 3:
      return "avx512-bf16";
    case 2:
      return "avx512";
    case 1:
      return "avx2";
    default:
      return "scalar";
  }
}

}  // namespace kv_cconv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("fwd", &kv_cconv::fwd, py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("conv_states"), py::arg("cache_indices"),
        py::arg("has_initial_state"), py::arg("query_start_loc"),
        py::arg("silu"), py::arg("pad_slot_id"), py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "Causal depthwise conv1d prefill (batched [B,L,D] or varlen [T,D]); "
        "updates conv_states in place.");
  m.def("update", &kv_cconv::update, py::arg("x"), py::arg("conv_state"),
        py::arg("weight"), py::arg("bias"), py::arg("silu"),
        py::arg("conv_state_indices"), py::arg("num_accepted_tokens"),
        py::arg("pad_slot_id"), py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "Causal depthwise conv1d decode step; shifts conv_state in place.");
  m.def("isa_path", &kv_cconv::isa_path,
        "The kernel build chosen on this CPU (capped by ATEN_CPU_CAPABILITY).");
}
