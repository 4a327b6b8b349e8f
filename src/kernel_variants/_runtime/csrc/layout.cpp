#include "call_core.h"

namespace kv_core {

namespace {

// The engine adapters' per-call layout mapping (integrations/_fast.py), without Python's
// argument parsing and the dispatcher's view machinery on the way (~0.8 us per view from Python,
// ~0.2 us here): an alias of a plain dense CPU or CUDA tensor with other sizes and strides,
// sharing its storage and version counter, an inference tensor exactly when its base is. Anything
// else (a subclass, another TensorImpl, a functional or fake tensor, an active dispatch mode,
// grad mode with a tensor that requires grad) gets the ordinary view.
bool plain_alias_ok(PyObject* o, const at::Tensor& t) {
  if (!THPVariable_CheckExact(o) || t.layout() != c10::kStrided || !t.has_storage()) return false;
  if (!(t.is_cpu() || t.is_cuda()) || typeid(*t.unsafeGetTensorImpl()) != typeid(c10::TensorImpl)) return false;
  if (t.requires_grad() && c10::GradMode::is_enabled()) return false;
  if (c10::impl::TorchDispatchModeTLS::any_modes_set()) return false;
  const auto ks = t.key_set();
  return !ks.has(c10::DispatchKey::Python) && !ks.has(c10::DispatchKey::Functionalize) &&
         !ks.has(c10::DispatchKey::PythonTLSSnapshot) && !ks.has(c10::DispatchKey::FuncTorchBatched);
}

PyObject* alias(const at::Tensor& t, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  // The view constructor, as torch's own views use it: it takes the base's dispatch keys as they
  // are, so the alias is an inference tensor exactly when its base is, whatever the mode (the
  // plain constructor decides by the current mode, and needed a mode guard where they differ).
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(),
                                                   t.dtype());
  impl->set_sizes_and_strides(sizes, strides, t.storage_offset());
  if (!t.is_inference()) impl->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
  return THPVariable_Wrap(at::Tensor(std::move(impl)));
}

// t's sizes and strides with the last two swapped.
struct Swapped {
  explicit Swapped(const at::Tensor& t) : sizes(t.sizes().begin(), t.sizes().end()), strides(t.strides().begin(), t.strides().end()) {
    const size_t n = sizes.size();
    std::swap(sizes[n - 1], sizes[n - 2]);
    std::swap(strides[n - 1], strides[n - 2]);
  }
  c10::SmallVector<int64_t, 5> sizes, strides;
};

// Lent aliases. The views a step hands the op (the pool, a prefill's x, a slot table's column)
// live for the op's call only. Where nothing else holds one afterwards (no other reference,
// weak reference, attribute, hook or autograd data: a variant that keeps its argument keeps it
// intact), its TensorImpl and Python object are kept for the next step and re-pointed at that
// step's tensor: a few stores where a new alias allocates and frees both (~0.3-0.45 us each on a
// 2-vCPU Xeon; a prefill step lends two). A kept alias holds an empty storage, never the
// engine's: a pool its owner frees is freed. CPU tensors, under the GIL (a free-threaded build,
// or a Python whose weak reference list this cannot read, makes a new alias every time).
constexpr int kKept = 4;
PyObject* g_kept[kKept] = {};  // parked: untracked by the GC, unreachable from Python
int g_evict = 0;               // where a view of new dispatch keys goes when every place is taken

// What a parked view holds: zero bytes from the CPU allocator (no dispatcher, no mode, no throw).
const c10::Storage& empty_storage() {
  static const auto* s = new c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::GetDefaultCPUAllocator(),
                                          /*resizable=*/false);  // never freed: no exit-order hazard
  return *s;
}

// Whether `o`, a torch.Tensor of exactly that class, is held by its caller's reference alone: no
// other Python reference or weak reference, and its TensorImpl (a plain one) by no C++ reference
// or autograd data. Its metadata may then change without anyone seeing it.
bool sole_owner(PyObject* o) {
  if (!Py_IS_TYPE(o, reinterpret_cast<PyTypeObject*>(THPVariableClass)) || Py_REFCNT(o) != 1) return false;
  // The weak reference list where CPython's own _PyObject_GET_WEAKREFS_LISTPTR finds it: at
  // tp_weaklistoffset, negative for a managed list (3.12+).
  const Py_ssize_t weaklist = Py_TYPE(o)->tp_weaklistoffset;
  if (weaklist == 0 || *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + weaklist) != nullptr) return false;
  const at::Tensor& t = THPVariable_Unpack(o);
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return t.use_count() == 1 && t.weak_use_count() == 1 && impl->autograd_meta() == nullptr &&
         impl->allow_tensor_metadata_change() && typeid(*impl) == typeid(c10::TensorImpl);
}

// sole_owner, and nothing set on the object that a later step's argument would carry: no
// attribute (its dict is made once, then kept with it), no hook. The dict first: making it may
// run the GC, and so other code, which the ownership test must come after.
bool reusable(PyObject* o) {
  const auto* v = reinterpret_cast<const THPVariable*>(o);
  if (v->backward_hooks != nullptr || v->post_accumulate_grad_hooks != nullptr) return false;
  THPObjectPtr dict(PyObject_GenericGetDict(o, nullptr));
  if (!dict) {
    PyErr_Clear();
    return false;
  }
  if (!PyDict_Check(dict.get()) || PyDict_GET_SIZE(dict.get()) != 0) return false;
  dict = nullptr;
  return sole_owner(o);
}

// An owned reference to a step's view of an engine tensor, given back when the step is done.
class Lent {
 public:
  Lent() = default;
  Lent(const Lent&) = delete;
  Lent& operator=(const Lent&) = delete;
  ~Lent() { reset(); }
  PyObject* get() const { return o_; }
  // t (`o`'s tensor) with `sizes` and `strides`: a kept alias re-pointed where one has t's
  // dispatch keys, a new alias otherwise, `view()` (the same, made the ordinary way) where an
  // alias may not be made.
  template <typename View>
  bool make(PyObject* o, const at::Tensor& t, c10::IntArrayRef sizes, c10::IntArrayRef strides, View view) {
    reset();
    if (!plain_alias_ok(o, t)) {
      o_ = THPVariable_Wrap(view());
      return o_ != nullptr;
    }
#ifndef Py_GIL_DISABLED
    if (t.is_cpu()) {
      const auto keys = t.key_set();
      for (PyObject*& kept : g_kept) {
        if (kept == nullptr) continue;
        c10::TensorImpl* impl = THPVariable_Unpack(kept).unsafeGetTensorImpl();
        if (impl->key_set() != keys) continue;
        o_ = std::exchange(kept, nullptr);
        impl->set_storage_and_dtype(t.storage(), t.dtype());
        impl->set_sizes_and_strides(sizes, strides, t.storage_offset());
        if (!t.is_inference()) impl->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
        PyObject_GC_Track(o_);
        lent_ = true;
        return true;
      }
      lent_ = true;  // a new alias, kept after the step where nothing holds it
    }
#endif
    o_ = alias(t, sizes, strides);
    return o_ != nullptr;
  }
  // t with its last two dims swapped.
  bool make_swapped(PyObject* o, const at::Tensor& t) {
    Swapped sw(t);
    return make(o, t, sw.sizes, sw.strides, [&t] { return t.transpose(-1, -2); });
  }
  void borrow(PyObject* o) {
    reset();
    o_ = Py_NewRef(o);
  }

 private:
  void reset() {
    PyObject* o = std::exchange(o_, nullptr);
    const bool lent = std::exchange(lent_, false);
    if (o == nullptr) return;
    // Not after an error: the traceback may hold it, and it is no step's common case.
    if (lent && !PyErr_Occurred() && reusable(o)) {
      // The engine's storage let go first (its release may run a weak reference's callback,
      // which may step again), then parked where nothing (the GC included) reaches it.
      c10::TensorImpl* impl = THPVariable_Unpack(o).unsafeGetTensorImpl();
      impl->set_storage_keep_dtype(empty_storage());
      const int64_t none = 0;
      impl->set_sizes_contiguous(c10::IntArrayRef(&none, 1));
      PyObject_GC_UnTrack(o);
      PyObject** place = nullptr;
      for (PyObject*& kept : g_kept) {
        if (kept == nullptr) {
          place = &kept;
          break;
        }
      }
      PyObject* evicted = nullptr;
      if (place == nullptr) {  // dispatch keys seen no more hold every place: the oldest goes
        place = &g_kept[g_evict];
        g_evict = (g_evict + 1) % kKept;
        evicted = *place;
      }
      *place = o;
      if (evicted != nullptr) {
        PyObject_GC_Track(evicted);  // freed as it was made: tracked
        Py_DECREF(evicted);
      }
      return;
    }
    Py_DECREF(o);
  }
  PyObject* o_ = nullptr;
  bool lent_ = false;
};

PyObject* swapped_alias(PyObject* o, const at::Tensor& t) {
  if (!plain_alias_ok(o, t)) return THPVariable_Wrap(t.transpose(-1, -2));
  Swapped sw(t);
  return alias(t, sw.sizes, sw.strides);
}

// channel_last(t): t with its last two dims swapped (a (dim, T) x as [T, dim], a (T, dim) result
// back as the engine's (dim, T)).
}  // namespace

PyObject* channel_last(PyObject*, PyObject* o) {
  HANDLE_TH_ERRORS
  if (!THPVariable_Check(o)) {
    PyErr_Format(PyExc_TypeError, "channel_last: expected a tensor, got %s", Py_TYPE(o)->tp_name);
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(o);
  if (t.dim() < 2) return THPVariable_Wrap(t.transpose(-1, -2));  // torch says what is wrong
  return swapped_alias(o, t);
  END_HANDLE_TH_ERRORS
}

namespace {

// The op's [T, dim] result `y` (a reference stolen) as the engine's (dim, T): y itself restrided
// where nothing else holds it (a fresh output: no allocation), else its alias.
PyObject* engine_layout(PyObject* y) {
  THPObjectPtr owned(y);
#ifndef Py_GIL_DISABLED  // ownership read without the GIL's guarantee: always the alias there
  if (THPVariable_Check(y)) {
    const at::Tensor& t = THPVariable_Unpack(y);
    if (t.dim() == 2 && plain_alias_ok(y, t) && sole_owner(y)) {
      Swapped sw(t);
      t.unsafeGetTensorImpl()->set_sizes_and_strides(sw.sizes, sw.strides, t.storage_offset());
      return owned.release();
    }
  }
#endif
  return channel_last(nullptr, y);
}

// An engine's slot ids for `batch` sequences as the op takes them, into `out`: None, a [B]
// tensor, or with `table` a [B, k] one's column 0 (a lent alias). 1 where done, 0 where they are
// neither (the adapter's general path serves them), -1 with an error set.
int slot_ids(PyObject* io, int64_t batch, bool table, Lent& out) {
  if (io == Py_None) {
    out.borrow(io);
    return 1;
  }
  if (!THPVariable_Check(io)) return 0;
  const at::Tensor& i = THPVariable_Unpack(io);
  if (i.dim() == 0 || i.size(0) != batch) return 0;
  if (i.dim() == 1) {
    out.borrow(io);
    return 1;
  }
  if (i.dim() != 2 || i.size(1) < 1 || !table) return 0;
  const int64_t size = i.size(0), stride = i.stride(0);
  return out.make(io, i, c10::IntArrayRef(&size, 1), c10::IntArrayRef(&stride, 1), [&i] { return i.select(1, 0); })
             ? 1
             : -1;
}

// Whether `o` is None or a tensor whose sizes and data a step may read: a plain TensorImpl
// without a Python or functionalization key and with concrete sizes. A run under torch.export or
// a compile session hands fake or functional tensors, symbolic sizes among them: reading one
// here would fix a dynamic size to a constant, so such a call takes the adapter's general path.
bool readable(PyObject* o) {
  if (o == Py_None) return true;
  if (!THPVariable_Check(o)) return false;
  const c10::TensorImpl* impl = THPVariable_Unpack(o).unsafeGetTensorImpl();
  const auto ks = impl->key_set();
  return typeid(*impl) == typeid(c10::TensorImpl) && !impl->has_symbolic_sizes_strides() &&
         !ks.has(c10::DispatchKey::Python) && !ks.has(c10::DispatchKey::Functionalize);
}

// Whether a CPU [B+1] int32/int64 tensor (a readable one) has no two equal neighbours; -1 where it
// is not read here.
int none_empty(const at::Tensor& t) {
  if (!t.is_cpu() || t.dim() != 1 || !t.has_storage()) return -1;
  const int64_t n = t.size(0), st = t.stride(0);
  if (t.scalar_type() == at::kInt) {
    const int32_t* p = t.const_data_ptr<int32_t>();
    for (int64_t i = 1; i < n; ++i)
      if (p[i * st] == p[(i - 1) * st]) return 0;
    return 1;
  }
  if (t.scalar_type() == at::kLong) {
    const int64_t* p = t.const_data_ptr<int64_t>();
    for (int64_t i = 1; i < n; ++i)
      if (p[i * st] == p[(i - 1) * st]) return 0;
    return 1;
  }
  return -1;
}

// The op called with `args` (its parameters in signature order, then out; nargsf as a
// vectorcall's, PY_VECTORCALL_ARGUMENTS_OFFSET where args[-1] is lent): its CallCore served in C
// where `core` is one of this module's for that many arguments, a call it hands back going to
// `missed`; any other call to `entry`, the op's Python entry (`core` None: no core built, or
// KV_CALL_CORE=0; the entry then takes the Python path).
PyObject* call_op(PyObject* core, PyObject* entry, PyObject* missed, PyObject* const* args, size_t nargsf) {
  if (Py_IS_TYPE(core, &CallCoreType)) {
    State* st = reinterpret_cast<CallCore*>(core)->st;
    if (PyVectorcall_NARGS(nargsf) == st->n + 1) {
      PyObject* r = serve_or_miss(st, args);
      if (r != st->miss) return r;
      Py_DECREF(r);
      return PyObject_Vectorcall(missed, args, nargsf, nullptr);
    }
  }
  return PyObject_Vectorcall(entry, args, nargsf, nullptr);
}

// The op's call core for an adapter's views: the entry's core where it keys x's device (the
// CPU; CUDA where a capture check is installed), None otherwise (the op's entry then: asking a
// core that serves no such tensor first would build the key twice).
PyObject* step_core(PyObject* core, const at::Tensor& x) {
  return x.is_cpu() || (x.is_cuda() && cuda_served()) ? core : Py_None;
}

}  // namespace

// decode_step(core, entry, x, pool, weight, bias, activation, indices, sentinel, table): a
// channel-first engine's decode step (x [B, dim], pool (N, dim, W-1), weight [dim, W], one
// dtype; slot ids None, [B] or, with `table`, [B, k] read at column 0, B = x's) as the op's
// decode on the pool's channel-last view, returning [B, dim]; or None where the adapter's
// general path must serve. Checks, views and the op in one call: each step from Python costs
// about as much as the view.
PyObject* decode_step(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError,
                    "decode_step(core, entry, x, pool, weight, bias, activation, indices, sentinel, table)");
    return nullptr;
  }
  PyObject *xo = args[2], *po = args[3], *wo = args[4], *io = args[7];
  if (!THPVariable_Check(xo) || !THPVariable_Check(po) || !THPVariable_Check(wo)) Py_RETURN_NONE;
  if (!readable(xo) || !readable(po) || !readable(wo) || !readable(io)) Py_RETURN_NONE;
  const at::Tensor& x = THPVariable_Unpack(xo);
  const at::Tensor& pool = THPVariable_Unpack(po);
  const at::Tensor& w = THPVariable_Unpack(wo);
  if (x.dim() != 2 || pool.dim() != 3 || w.dim() != 2 || pool.size(2) != w.size(1) - 1 ||
      x.scalar_type() != pool.scalar_type() || x.scalar_type() != w.scalar_type()) {
    Py_RETURN_NONE;
  }
  const int table = PyObject_IsTrue(args[9]);
  if (table < 0) return nullptr;
  Lent idx, state;
  const int ids = slot_ids(io, x.size(0), table == 1, idx);
  if (ids <= 0) {
    if (ids == 0) Py_RETURN_NONE;
    return nullptr;
  }
  if (!state.make_swapped(po, pool)) return nullptr;
  // x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens, pad_slot_id, out
  PyObject* stack[10] = {nullptr, xo, state.get(), wo, args[5], args[6], idx.get(), Py_None, args[8], Py_None};
  return call_op(step_core(args[0], x), args[1], args[1], stack + 1, 9 | PY_VECTORCALL_ARGUMENTS_OFFSET);
  END_HANDLE_TH_ERRORS
}

namespace {

// Whether `lengths`, an engine's host list (or tuple) of sequence lengths, holds only plain
// ints, none zero, summing to `total`: 1 yes, 0 no (the general path serves), -1 an error set.
int host_lengths_fill(PyObject* lengths, int64_t total) {
  if (!PyList_Check(lengths) && !PyTuple_Check(lengths)) return 0;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(lengths);
  PyObject** items = PySequence_Fast_ITEMS(lengths);
  int64_t sum = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(items[i])) return 0;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow != 0 || v <= 0 || v > total) return 0;
    sum += v;
    if (sum > total) return 0;
  }
  return sum == total ? 1 : 0;
}

}  // namespace

// prefill_step(core, entry, x, weight, bias, pool, query_start_loc, indices, has_initial_state,
// activation, sentinel, table, lengths): a channel-first engine's varlen prefill (x (dim, T),
// weight [dim, W], pool (N, dim, W-1) or None, one dtype; query_start_loc [B+1]; slot ids and
// flags of exactly B entries, slot ids [B] or with `table` [B, k] read at column 0; a plain int
// pad id; with a pool, no empty sequence: read here from query_start_loc on the CPU, or, given
// the engine's host `lengths`, from them, which must then sum to T) as the op's prefill on the
// channel-last views, returning the (dim, T) view of its [T, dim] result; or None where the
// adapter's general path must serve.
PyObject* prefill_step(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 13) {
    PyErr_SetString(PyExc_TypeError,
                    "prefill_step(core, entry, x, weight, bias, pool, query_start_loc, indices, has_initial_state, "
                    "activation, sentinel, table, lengths)");
    return nullptr;
  }
  if (!PyLong_CheckExact(args[10])) Py_RETURN_NONE;  // a pad id the general path converts
  PyObject *xo = args[2], *wo = args[3], *po = args[5], *qo = args[6], *io = args[7], *ho = args[8];
  if (!THPVariable_Check(xo) || !THPVariable_Check(wo) || !THPVariable_Check(qo)) Py_RETURN_NONE;
  if (!readable(xo) || !readable(wo) || !readable(qo) || !readable(po) || !readable(io) || !readable(ho)) {
    Py_RETURN_NONE;
  }
  const at::Tensor& x = THPVariable_Unpack(xo);
  const at::Tensor& w = THPVariable_Unpack(wo);
  const at::Tensor& q = THPVariable_Unpack(qo);
  if (x.dim() != 2 || w.dim() != 2 || q.dim() != 1 || q.size(0) < 1 || x.scalar_type() != w.scalar_type()) {
    Py_RETURN_NONE;
  }
  const int64_t batch = q.size(0) - 1;
  if (ho != Py_None && (THPVariable_Unpack(ho).dim() != 1 || THPVariable_Unpack(ho).size(0) != batch)) {
    Py_RETURN_NONE;
  }
  const int table = PyObject_IsTrue(args[11]);
  if (table < 0) return nullptr;
  int known = 0;
  if (args[12] != Py_None) {
    known = host_lengths_fill(args[12], x.size(1));
    if (known < 0) return nullptr;
    if (known == 0) Py_RETURN_NONE;
  }
  Lent pv, idx, xv;
  if (po == Py_None) {
    pv.borrow(po);
  } else {  // a tensor: readable() above
    const at::Tensor& pool = THPVariable_Unpack(po);
    if (pool.dim() != 3 || pool.size(2) != w.size(1) - 1 || pool.scalar_type() != x.scalar_type()) Py_RETURN_NONE;
    if (known != 1 && none_empty(q) != 1) Py_RETURN_NONE;
    if (!pv.make_swapped(po, pool)) return nullptr;
  }
  const int ids = slot_ids(io, batch, table == 1, idx);
  if (ids <= 0) {
    if (ids == 0) Py_RETURN_NONE;
    return nullptr;
  }
  if (!xv.make_swapped(xo, x)) return nullptr;
  // x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc, activation,
  // pad_slot_id, out
  PyObject* stack[11] = {nullptr, xv.get(), wo, args[4], pv.get(), idx.get(), ho, qo, args[9], args[10], Py_None};
  THPObjectPtr y(call_op(step_core(args[0], x), args[1], args[1], stack + 1, 10 | PY_VECTORCALL_ARGUMENTS_OFFSET));
  if (!y) return nullptr;
  return engine_layout(y.release());
  END_HANDLE_TH_ERRORS
}

// --- the op's eager entry, in C ---

}  // namespace kv_core
