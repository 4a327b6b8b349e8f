// The compiled call core: the per-call work of a dispatched op, in C++.
//
// One CallCore per op spec. A call hands it the op's arguments in signature order plus `out`
// (a vectorcall, no tuple or dict built). It reads what the Python memo key reads (each
// tensor's sizes, dtype and device, the mutated tensors' strides, whether grad mode is on and
// a tensor requires grad, every other argument with its type, the pins of kv.force), looks
// the decision up in its own map, runs the op's declared index value checks and the write
// guard on data learned once per signature, and calls the chosen variant the way
// OpSpec.invoke does (positional parameters by position, keyword-only ones by name).
//
// The C++ detects, the Python raises: on a miss, on anything it does not serve (an `out`, a
// tensor subclass, a tensor on a device the core does not serve (the CPU, and CUDA where a
// capture check is installed: capture_check), or with another dispatch key, a torch function
// mode, a graph being captured on the call's device)
// and on any problem it detects (a bad index value, an overlap with a written tensor, an
// inference tensor written outside inference mode) it returns the MISS sentinel, and the
// Python path (_runtime/call.py: call) decides, raises with its own message, or fills the memo and then
// teaches this core the entry (learn). So each error message is written in one place.
// A variant's own exception goes to a Python function that raises VariantFailed from it.
//
// The map only ever holds entries the Python memo holds too: the Python side clears both
// together (Dispatcher memo cleared, reset, calibration), so the core never decides.
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/object_ptr.h>
#include <torch/library.h>

#include <algorithm>
#include <typeinfo>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// The most parameters an op may have for the core to serve it (a stack array per call).
constexpr int kMaxParams = 32;
constexpr size_t kMapLimit = 65536;  // the Python memo's bound: serving memory stays flat

enum Param : int8_t { kValue = 0, kTensor = 1, kOptionalTensor = 2 };
enum CheckKind : int { kSlots = 1, kOffsets = 2, kBounded = 3 };

struct Check {
  int kind;
  int index;
  int64_t a;  // kSlots: slot count; kOffsets: the end value; kBounded: low
  int64_t b;  // kSlots: pad id; kBounded: high
  bool has_pad;  // kSlots: whether some int64 can equal the pad id
};

struct Guard {
  int mutated;
  int64_t span;  // bytes from the written tensor's first element to past its last
  std::vector<int> near;  // the arguments compared with it (its dtype, non-empty)
};

// One memoised decision: its key, and what a call with that key runs around the variant.
// Counted by hand (every count changes under the GIL): the map holds one, a call in progress
// another, so a map cleared by Python code the call runs does not free what it still reads.
struct Entry {
  int refs = 1;
  std::vector<int64_t> words;
  std::vector<PyObject*> objs;  // owned: the non-tensor arguments, then the pins
  bool python_only = false;  // the Python path serves this key (an out= runner, a guard it cannot read)
  PyObject* fn = nullptr;
  PyObject* vid = nullptr;
  std::vector<PyObject*> subs;  // per parameter: the normalised value, or nullptr
  std::vector<Check> checks;
  PyObject* gate = nullptr;  // the device whose pending device-rule counts a host check reports first
  PyObject* py_checks = nullptr;  // a value check the core cannot read as data: called as is
  // The op's device rule (values not read on the host): rule(args) -> the arguments it hands on.
  PyObject* rule = nullptr;
  std::vector<Guard> guards;

  Entry() = default;
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  ~Entry() {  // dropped with the GIL held: every path that releases an entry holds it
    for (PyObject* o : objs) Py_DECREF(o);
    for (PyObject* o : subs) Py_XDECREF(o);
    Py_XDECREF(fn);
    Py_XDECREF(vid);
    Py_XDECREF(gate);
    Py_XDECREF(py_checks);
    Py_XDECREF(rule);
  }
};

void release(Entry* e) {
  if (--e->refs == 0) delete e;
}

struct State {
  int n = 0;
  std::vector<int8_t> kind;
  std::vector<uint8_t> mutated;
  int npos = 0;
  PyObject* kwnames = nullptr;  // the keyword-only parameters' names, for the variant's call
  PyObject* pins_var = nullptr;
  PyObject* counters = nullptr;  // the device-rule counters by device (a dict)
  PyObject* fail = nullptr;  // fail(vid, exc): raises VariantFailed from exc
  PyObject* miss = nullptr;
  // Given as `out`: a call from a compiled graph's kernel, which takes no `out` and whose
  // outputs may not alias an input (unaliased below, in the same call).
  PyObject* graph = nullptr;
  // A hash bucket holds every entry whose key hashes alike (compared word by word).
  std::unordered_map<uint64_t, std::vector<Entry*>> map;
  size_t size = 0;
  // The pins object last seen and its hash: a tuple's hash is not cached, and a force()
  // block hands every call the same tuple.
  PyObject* last_pins = nullptr;
  Py_hash_t last_pins_hash = 0;
  // Scratch for building a key: reused, so a call allocates nothing once warm. Only read
  // before any Python code runs in a call (a nested op call may overwrite it). nwords: how
  // many of words the key uses (the vector only grows).
  std::vector<int64_t> words = std::vector<int64_t>(256);
  size_t nwords = 0;
  std::vector<PyObject*> objs;
};

struct CallCore {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  State* st;
};

// Dense CPU tensors, with or without autograd (every CPU tensor carries the autocast key):
// what the key's fields fully describe. Anything with another dispatch key (a wrapper of
// torch.func, a Python-dispatch tensor, sparse, another device) is served by the Python path.
// Compared as raw bits: DispatchKeySet's difference keeps the backend bits.
const uint64_t kServed = c10::DispatchKeySet({c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                                              c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU})
                             .raw_repr();
// The same for dense CUDA tensors, served where a capture check for CUDA is installed.
const uint64_t kServedCuda = c10::DispatchKeySet({c10::DispatchKey::CUDA, c10::DispatchKey::AutogradCUDA,
                                                  c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCUDA})
                                 .raw_repr();

// Per device type, what says whether a graph is being captured on it now (a callable returning a
// bool; for CUDA the builtin behind torch.cuda.is_current_stream_capturing), installed by
// capture_check() (callcore.py installs CUDA's at the first CUDA call its Python path sees). A
// call on a device with one is keyed only while it says no: a decision made in a capture may be
// provisional (a variant not yet qualified is passed over there), and the Python path keeps such
// calls. Process-wide, as the devices are.
PyObject* g_capturing[static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)] = {};

// Whether the cores key CUDA tensors: once a capture check for CUDA is installed.
inline bool cuda_served() {
  return g_capturing[static_cast<int>(c10::DeviceType::CUDA)] != nullptr;
}

inline bool served_keys(uint64_t ks) {
  return (ks & ~kServed) == 0 || (cuda_served() && (ks & ~kServedCuda) == 0);
}

// The dispatch keys a bound call compares with its example's: all but autograd's and autocast's,
// which an inference tensor lacks (a serving loop's tensors, bound with an example made
// outside inference_mode) and requires_grad does not change.
const uint64_t kBoundKeys = ~(c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView) | c10::autograd_dispatch_keyset |
                              c10::autocast_dispatch_keyset)
                                 .raw_repr();

constexpr uint64_t kMul = 0x9e3779b97f4a7c15ULL;

inline uint64_t mix(uint64_t h, uint64_t v) {
  return (h ^ v) * kMul;
}

// Four independent lanes: a key is tens of words, and one chained multiply per word would be
// the call's longest dependency.
uint64_t hash_words(const int64_t* w, size_t n) {
  uint64_t h0 = 1, h1 = 2, h2 = 3, h3 = 4;
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    h0 = mix(h0, static_cast<uint64_t>(w[j]));
    h1 = mix(h1, static_cast<uint64_t>(w[j + 1]));
    h2 = mix(h2, static_cast<uint64_t>(w[j + 2]));
    h3 = mix(h3, static_cast<uint64_t>(w[j + 3]));
  }
  for (; j < n; ++j) h0 = mix(h0, static_cast<uint64_t>(w[j]));
  uint64_t h = h0 ^ (h1 << 16 | h1 >> 48) ^ (h2 << 32 | h2 >> 32) ^ (h3 << 48 | h3 >> 16);
  h ^= h >> 29;
  return h * kMul;
}

// A tensor parameter's words in a key (the memo's, and a bound call's comparison with its
// example): -1 for None; else its dimension count, sizes, dtype and device, and for a tensor the
// op writes, its strides. Each word goes to `out` (Emit writes them, Match compares them with a
// bound op's example); *t: the tensor, nullptr for None. False: not an argument the core serves
// (None for a required tensor, a subclass, which may see its own __torch_function__, another
// dispatch key unless !served_only), or a word Match found different.
template <class Out>
inline bool tensor_words(PyObject* a, int8_t kind, bool mutated, Out& out, const at::Tensor** t,
                         bool served_only = true) {
  if (a == Py_None) {
    *t = nullptr;
    return kind == kOptionalTensor && out.room(1) && out.put(-1);
  }
  if (!THPVariable_CheckExact(a)) return false;
  const at::Tensor& tensor = THPVariable_Unpack(a);
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  if (served_only && !served_keys(impl->key_set().raw_repr())) return false;
  auto sizes = impl->sizes();
  size_t nd = sizes.size();
  if (!out.room(3 + 2 * nd) || !out.put(static_cast<int64_t>(nd))) return false;
  for (size_t d = 0; d < nd; ++d)
    if (!out.put(sizes[d])) return false;
  c10::Device dev = impl->device();
  if (!out.put(static_cast<int64_t>(impl->dtype().toScalarType())) ||
      !out.put((static_cast<int64_t>(dev.type()) << 8) | static_cast<uint8_t>(dev.index())))
    return false;
  if (mutated) {
    auto strides = impl->strides();
    for (size_t d = 0; d < nd; ++d)
      if (!out.put(strides[d])) return false;
  }
  *t = &tensor;
  return true;
}

// Writes a key's words into a growing scratch vector, from `pos`.
struct Emit {
  std::vector<int64_t>& words;
  size_t pos;
  int64_t* w = nullptr;
  bool room(size_t n) {
    if (w != nullptr) pos = static_cast<size_t>(w - words.data());
    if (pos + n > words.size()) words.resize(2 * (pos + n));
    w = words.data() + pos;
    return true;
  }
  bool put(int64_t v) {
    *w++ = v;
    return true;
  }
  size_t end() const { return w == nullptr ? pos : static_cast<size_t>(w - words.data()); }
};

// Compares words with an example's, in order, without writing them.
struct Match {
  const int64_t* w;
  const int64_t* end;
  bool room(size_t) { return true; }
  bool put(int64_t v) { return w != end && *w++ == v; }
};

// The key of a call, into st->words / st->objs. 1: built (hash in *hash, each tensor argument
// in ts, nullptr for None); 0: not a call the core serves; no Python error is left set.
int build_key(State* st, PyObject* const* args, PyObject* out, const at::Tensor** ts, uint64_t* hash) {
  if (out != Py_None || at::impl::torch_function_mode_enabled()) {
    return 0;
  }
  // A graph being captured on the call's device (the first tensor's: the Python path refuses a
  // call spread over devices): the Python path serves the call and keeps its decision apart.
  // Asked before the scratch key is written: the check may be Python code. (The Python key's
  // capture test also asks whether torch.compile traces; a traced call's tensors are fake or
  // functional, which served_keys refuses.)
  for (int i = 0; i < st->n; ++i) {
    if (st->kind[i] == kValue || !THPVariable_CheckExact(args[i])) continue;
    PyObject* check = g_capturing[static_cast<int>(THPVariable_Unpack(args[i]).unsafeGetTensorImpl()->device_type())];
    if (check != nullptr) {
      PyObject* r = PyObject_CallNoArgs(check);
      const int busy = r == nullptr ? -1 : PyObject_IsTrue(r);
      Py_XDECREF(r);
      if (busy != 0) {
        if (busy < 0) PyErr_Clear();
        return 0;
      }
    }
    break;
  }
  auto& objs = st->objs;
  objs.clear();
  const bool grad = c10::GradMode::is_enabled();
  bool requires_grad = false;
  size_t pos = 1;  // words[0]: whether the call needs autograd
  for (int i = 0; i < st->n; ++i) {
    PyObject* a = args[i];
    int8_t k = st->kind[i];
    if (k == kValue) {
      // Values whose hash and == are C code: nothing run here can switch threads (the scratch
      // key is this core's), nor differ from what the Python memo's dict would do.
      if (!(a == Py_None || PyUnicode_CheckExact(a) || PyLong_CheckExact(a) || PyBool_Check(a) ||
            PyFloat_CheckExact(a)))
        return 0;
      objs.push_back(a);
      continue;
    }
    Emit emit{st->words, pos};
    if (!tensor_words(a, k, st->mutated[i], emit, &ts[i])) return 0;
    pos = emit.end();
    if (grad && !requires_grad && ts[i] != nullptr) requires_grad = ts[i]->unsafeGetTensorImpl()->requires_grad();
  }
  st->words[0] = requires_grad;
  st->nwords = pos;
  uint64_t h = hash_words(st->words.data(), pos);
  for (PyObject* o : objs) {
    Py_hash_t oh = PyObject_Hash(o);
    if (oh == -1) {  // unhashable: the Python path validates it
      PyErr_Clear();
      return 0;
    }
    h = mix(mix(h, reinterpret_cast<uintptr_t>(Py_TYPE(o))), static_cast<uint64_t>(oh));
  }
  PyObject* pins = nullptr;
  if (PyContextVar_Get(st->pins_var, nullptr, &pins) < 0 || pins == nullptr) {
    PyErr_Clear();
    return 0;
  }
  Py_hash_t ph;
  if (pins == st->last_pins) {
    ph = st->last_pins_hash;
  } else {
    ph = PyObject_Hash(pins);
    if (ph == -1) {
      PyErr_Clear();
      Py_DECREF(pins);
      return 0;
    }
    Py_XSETREF(st->last_pins, Py_NewRef(pins));
    st->last_pins_hash = ph;
  }
  objs.push_back(pins);  // borrowed from here on: last_pins holds a reference
  Py_DECREF(pins);
  *hash = mix(h, static_cast<uint64_t>(ph));
  return 1;
}

inline bool same_words(const Entry& e, const State* st) {
  return e.words.size() == st->nwords &&
         std::equal(e.words.begin(), e.words.end(), st->words.begin());
}

// Python's tuple equality on the key's objects: identity, else same type and ==.
bool same_objects(const std::vector<PyObject*>& a, const std::vector<PyObject*>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    if (Py_TYPE(a[i]) != Py_TYPE(b[i])) return false;
    int eq = PyObject_RichCompareBool(a[i], b[i], Py_EQ);
    if (eq != 1) {
      if (eq < 0) PyErr_Clear();
      return false;
    }
  }
  return true;
}

// The entry of the key in st's scratch, borrowed (nullptr: none).
Entry* find(State* st, uint64_t hash) {
  auto it = st->map.find(hash);
  if (it == st->map.end()) return nullptr;
  for (Entry* e : it->second) {
    if (same_words(*e, st) && same_objects(e->objs, st->objs)) return e;
  }
  return nullptr;
}

// A 1-D int32/int64 index tensor read in place, through its stride (nothing copied).
struct Index {
  const void* data = nullptr;
  int64_t n = 0;
  int64_t stride = 0;
  bool wide = false;
  int64_t operator[](int64_t j) const {
    return wide ? static_cast<const int64_t*>(data)[j * stride] : static_cast<const int32_t*>(data)[j * stride];
  }
};

bool as_index(const at::Tensor& t, Index* out) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto type = impl->dtype().toScalarType();
  // Read in place on the host: a tensor elsewhere is the Python path's (never taught so).
  if (impl->dim() != 1 || (type != at::kInt && type != at::kLong) || !impl->device().is_cpu()) return false;
  out->data = impl->data();
  out->n = impl->sizes()[0];
  out->stride = impl->strides()[0];
  out->wide = type == at::kLong;
  return true;
}

// Whether the live slots (every entry but pads) are distinct.
bool distinct_slots(const Index& v, const Check& c) {
  if (v.n <= 32) {  // a decode batch: fewer compares than a sort's setup, and nothing allocated
    for (int64_t i = 1; i < v.n; ++i) {
      int64_t s = v[i];
      if (c.has_pad && s == c.b) continue;
      for (int64_t j = 0; j < i; ++j)
        if (v[j] == s) return false;
    }
    return true;
  }
  std::vector<int64_t> live;
  live.reserve(v.n);
  for (int64_t j = 0; j < v.n; ++j)
    if (!(c.has_pad && v[j] == c.b)) live.push_back(v[j]);
  std::sort(live.begin(), live.end());
  return std::adjacent_find(live.begin(), live.end()) == live.end();
}

// Whether every declared index value check passes (the same conditions as the Python checks
// of _runtime/values.py, which say what is wrong when one does not).
bool values_pass(const std::vector<Check>& checks, const at::Tensor* const* ts) {
  for (const Check& c : checks) {
    const at::Tensor* t = ts[c.index];
    Index v;
    if (t == nullptr || !as_index(*t, &v)) return false;
    switch (c.kind) {
      case kSlots: {
        for (int64_t j = 0; j < v.n; ++j) {
          int64_t s = v[j];
          if (c.has_pad && s == c.b) continue;
          if (s < 0 || s >= c.a) return false;
        }
        if (v.n > 1 && !distinct_slots(v, c)) return false;
        break;
      }
      case kOffsets: {
        if (v.n == 0 || v[0] != 0 || v[v.n - 1] != c.a) return false;
        for (int64_t j = 1; j < v.n; ++j)
          if (v[j] < v[j - 1]) return false;
        break;
      }
      case kBounded: {
        for (int64_t j = 0; j < v.n; ++j)
          if (v[j] < c.a || v[j] > c.b) return false;
        break;
      }
      default:
        return false;
    }
  }
  return true;
}

inline int64_t span_bytes(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto sizes = impl->sizes();
  auto strides = impl->strides();
  int64_t last = 0;
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  return (last + 1) * static_cast<int64_t>(impl->itemsize());
}

// The write guard of _runtime/guards.py: write_plan: no argument of a written tensor's dtype may start
// inside it or reach into it; an inference tensor is written only in inference mode.
bool writes_safe(const std::vector<Guard>& guards, const at::Tensor* const* ts) {
  if (guards.empty()) return true;
  bool inference = c10::InferenceMode::is_enabled();
  for (const Guard& g : guards) {
    const at::Tensor* m = ts[g.mutated];
    if (m == nullptr) return false;
    if (!inference && m->is_inference()) return false;
    auto lo = reinterpret_cast<uintptr_t>(m->const_data_ptr());
    uintptr_t hi = lo + static_cast<uintptr_t>(g.span);
    auto base = reinterpret_cast<uintptr_t>(m->storage().data());
    for (int i : g.near) {
      const at::Tensor* a = ts[i];
      if (a == nullptr) return false;
      auto a_lo = reinterpret_cast<uintptr_t>(a->const_data_ptr());
      // Past m's last byte, or in another allocation (allocations are disjoint, and strides
      // are never negative: a tensor never reaches below its first byte).
      if (a_lo >= hi || a_lo < base) continue;
      if (a_lo >= lo || a_lo + static_cast<uintptr_t>(span_bytes(*a)) > lo) return false;
    }
  }
  return true;
}

PyObject* call_py_checks(State* st, const Entry& e, PyObject* const* args) {
  PyObject* tup = PyTuple_New(st->n);
  if (tup == nullptr) return nullptr;
  for (int i = 0; i < st->n; ++i) PyTuple_SET_ITEM(tup, i, Py_NewRef(args[i]));
  PyObject* r = PyObject_CallOneArg(e.py_checks, tup);
  Py_DECREF(tup);
  return r;
}

// The variant's exception becomes VariantFailed, raised by the Python side's one message
// (`fail`, called with the variant id and the exception).
PyObject* variant_failed(PyObject* fail, PyObject* vid) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;  // KeyboardInterrupt and kin pass
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr) PyException_SetTraceback(value, tb);
  PyObject* r = PyObject_CallFunctionObjArgs(fail, vid, value, nullptr);
  Py_XDECREF(r);  // fail raises; a return would be a bug there, reported as the original error
  if (r != nullptr) {
    PyErr_Restore(type, value, tb);
    return nullptr;
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return nullptr;
}

// Whether the device rule counted something on this device (its gate is in counters): the
// call then goes to the Python path, so that this is reported before a host check passes.
bool gate_counted(PyObject* counters, PyObject* gate) {
  if (gate == nullptr || PyDict_GET_SIZE(counters) == 0) return false;
  const int has = PyDict_Contains(counters, gate);
  if (has < 0) PyErr_Clear();
  return has != 0;
}

// The device rule, as the Python path runs it: on the arguments the variant is about to get
// (stack[1..n], normalised values in place), which it replaces by what it returns (in signature
// order; `ruled` keeps them alive). False with its own error raised as is.
bool apply_rule(PyObject* rule, int n, PyObject** stack, THPObjectPtr& ruled) {
  THPObjectPtr tup(PyTuple_New(n));
  if (!tup) return false;
  for (int i = 0; i < n; ++i) PyTuple_SET_ITEM(tup.get(), i, Py_NewRef(stack[i + 1]));
  ruled = PyObject_CallOneArg(rule, tup.get());
  if (!ruled) return false;
  if (!PyTuple_Check(ruled.get()) || PyTuple_GET_SIZE(ruled.get()) != n) {
    // The Python path's exception (errors.rule_result_error), so that both paths raise the same.
    THPObjectPtr errors(PyImport_ImportModule("kernel_variants._runtime.errors"));
    THPObjectPtr exc(errors ? PyObject_CallMethod(errors.get(), "rule_result_error", "Oi", ruled.get(), n) : nullptr);
    if (exc) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.get())), exc.get());
    return false;
  }
  for (int i = 0; i < n; ++i) stack[i + 1] = PyTuple_GET_ITEM(ruled.get(), i);
  return true;
}

PyObject* run(State* st, Entry* e, PyObject* const* args, const at::Tensor* const* ts) {
  if (!e->checks.empty() || e->py_checks != nullptr) {
    // What the device rule counted on this device is reported before a host check passes.
    if (gate_counted(st->counters, e->gate)) return Py_NewRef(st->miss);
    if (!values_pass(e->checks, ts)) return Py_NewRef(st->miss);
  }
  if (!writes_safe(e->guards, ts)) return Py_NewRef(st->miss);
  if (e->py_checks != nullptr) {
    PyObject* r = call_py_checks(st, *e, args);
    if (r == nullptr) return nullptr;  // the Python check's own error
    Py_DECREF(r);
  }
  PyObject* stack[kMaxParams + 1];
  stack[0] = nullptr;  // the slot PY_VECTORCALL_ARGUMENTS_OFFSET lends the callee
  for (int i = 0; i < st->n; ++i) {
    PyObject* s = e->subs[i];
    stack[i + 1] = s != nullptr ? s : args[i];
  }
  THPObjectPtr ruled;
  if (e->rule != nullptr && !apply_rule(e->rule, st->n, stack, ruled)) return nullptr;
  PyObject* r = PyObject_Vectorcall(e->fn, stack + 1, st->npos | PY_VECTORCALL_ARGUMENTS_OFFSET, st->kwnames);
  if (r == nullptr) return variant_failed(st->fail, e->vid);
  return r;
}

// A tensor argument's storage (data: its first byte; present: a tensor with storage there).
struct Base {
  const void* data;
  bool present;
};
PyObject* unalias_graph(PyObject* res, const State* st, const Base* bases);

// The storages a graph call's outputs are compared with, read before the variant runs: after a
// large kernel the inputs' TensorImpls and StorageImpls are cache misses again (two per tensor),
// where the variant is about to read them now.
void storage_bases(const State* st, const at::Tensor* const* ts, Base* bases) {
  for (int i = 0; i < st->n; ++i) {
    const at::Tensor* t = st->kind[i] == kValue ? nullptr : ts[i];
    const bool present = t != nullptr && t->has_storage();
    bases[i] = {present ? t->storage().data() : nullptr, present};
  }
}

PyObject* serve(State* st, PyObject* const* args, PyObject* out) {
  const at::Tensor* ts[kMaxParams];
  uint64_t hash;
  const bool graph = out == st->graph;
  if (graph) out = Py_None;
  if (build_key(st, args, out, ts, &hash) != 1) return Py_NewRef(st->miss);
  Entry* e = find(st, hash);
  if (e == nullptr || e->python_only) return Py_NewRef(st->miss);
  // Python code run below (a check, the variant) may clear the map: this call holds the entry.
  struct Hold {
    Entry* e;
    ~Hold() { release(e); }
  } hold{e};
  ++e->refs;
  Base bases[kMaxParams];
  if (graph) storage_bases(st, ts, bases);
  PyObject* r = run(st, e, args, ts);
  if (!graph || r == nullptr || r == st->miss) return r;
  // The variant ran: from here an error is raised, never a miss (the Python path would run
  // the variant again and write the state twice).
  PyObject* u = unalias_graph(r, st, bases);
  Py_DECREF(r);
  return u;
}

// serve() for a call of the op's arguments and out (args[st->n]): its result, or the miss.
PyObject* serve_or_miss(State* st, PyObject* const* args) {
  try {
    return serve(st, args, args[st->n]);
  } catch (const c10::Error&) {
    // A tensor whose metadata cannot be read this way (no storage, symbolic sizes): the
    // Python path serves it, and says what is wrong if anything is.
    return Py_NewRef(st->miss);
  }
}

PyObject* core_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  State* st = reinterpret_cast<CallCore*>(self)->st;
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != st->n + 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    return Py_NewRef(st->miss);  // the Python path says what is wrong (errors.entry_error)
  }
  return serve_or_miss(st, args);
}

void clear_map(State* st) {
  // Moved out first: an entry's last reference may run Python code (a finalizer) that calls
  // back into this core.
  std::unordered_map<uint64_t, std::vector<Entry*>> old;
  old.swap(st->map);
  st->size = 0;
  for (auto& bucket : old)
    for (Entry* e : bucket.second) release(e);
}

int64_t as_int64(PyObject* o, bool* ok) {
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    *ok = false;
    return 0;
  }
  *ok = overflow == 0;
  return v;
}

// A new object of `type` (a CallCore or a BoundCore, Obj) that owns st and is called through vc;
// nullptr with the error set if it cannot be allocated. tp_alloc zeroes the object.
template <class Obj, class St>
PyObject* new_core(PyTypeObject* type, vectorcallfunc vc, std::unique_ptr<St> st) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  auto* o = reinterpret_cast<Obj*>(self);
  o->vectorcall = vc;
  o->st = st.release();
  return self;
}

// A parameter's kind (kValue, kTensor or kOptionalTensor); -1 with a ValueError set that `who`
// (the constructor) raises.
int parse_kind(PyObject* o, const char* who) {
  const long k = PyLong_AsLong(o);
  if (k < kValue || k > kOptionalTensor) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: each kind is 0, 1 or 2", who);
    return -1;
  }
  return static_cast<int>(k);
}

// `who`: the caller that raises a malformed tuple's error (learn, BoundCore).
bool parse_checks(int n, const std::vector<int8_t>& kind, PyObject* seq, std::vector<Check>& out, const char* who) {
  if (seq == Py_None) return true;
  if (!PyTuple_Check(seq)) {
    PyErr_Format(PyExc_TypeError, "%s: checks must be a tuple of (kind, index, a, b) tuples or None", who);
    return false;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(seq); ++k) {
    PyObject* item = PyTuple_GET_ITEM(seq, k);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
      PyErr_Format(PyExc_TypeError, "%s: each check must be a (kind, index, a, b) tuple", who);
      return false;
    }
    Check c{};
    bool ok_kind, ok_index, ok_a, ok_b = true;
    c.kind = static_cast<int>(as_int64(PyTuple_GET_ITEM(item, 0), &ok_kind));
    c.index = static_cast<int>(as_int64(PyTuple_GET_ITEM(item, 1), &ok_index));
    c.a = as_int64(PyTuple_GET_ITEM(item, 2), &ok_a);
    PyObject* b = PyTuple_GET_ITEM(item, 3);
    c.has_pad = b != Py_None;
    if (c.has_pad) c.b = as_int64(b, &ok_b);
    if (c.kind == kSlots && c.has_pad && !ok_b) {  // a pad id no int64 equals: never a pad
      c.has_pad = false;
      ok_b = true;
    }
    if (!ok_kind || !ok_index || !ok_a || !ok_b || c.index < 0 || c.index >= n || kind[c.index] == kValue ||
        (c.kind == kBounded && !c.has_pad)) {
      PyErr_Format(PyExc_ValueError, "%s: a check names no tensor parameter or has a bound out of int64", who);
      return false;
    }
    out.push_back(c);
  }
  return true;
}

bool parse_guards(int n, const std::vector<int8_t>& kind, PyObject* seq, std::vector<Guard>& out) {
  if (!PyTuple_Check(seq)) {
    PyErr_SetString(PyExc_TypeError, "guards must be a tuple of (mutated, span, near) tuples");
    return false;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(seq); ++k) {
    PyObject* item = PyTuple_GET_ITEM(seq, k);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 || !PyTuple_Check(PyTuple_GET_ITEM(item, 2))) {
      PyErr_SetString(PyExc_TypeError, "each guard must be a (mutated, span, near) tuple");
      return false;
    }
    Guard g;
    bool ok_m, ok_s;
    g.mutated = static_cast<int>(as_int64(PyTuple_GET_ITEM(item, 0), &ok_m));
    g.span = as_int64(PyTuple_GET_ITEM(item, 1), &ok_s);
    bool bad = !ok_m || !ok_s || g.mutated < 0 || g.mutated >= n || kind[g.mutated] == kValue;
    PyObject* near = PyTuple_GET_ITEM(item, 2);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(near) && !bad; ++j) {
      bool ok;
      int i = static_cast<int>(as_int64(PyTuple_GET_ITEM(near, j), &ok));
      bad = !ok || i < 0 || i >= n || kind[i] == kValue;
      g.near.push_back(i);
    }
    if (bad) {
      PyErr_SetString(PyExc_ValueError, "a guard names no tensor parameter");
      return false;
    }
    out.push_back(std::move(g));
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The Python-facing type
// ---------------------------------------------------------------------------------------------

bool unpack_call(State* st, PyObject* args_tuple, const char* who) {
  if (!PyTuple_Check(args_tuple) || PyTuple_GET_SIZE(args_tuple) != st->n) {
    PyErr_Format(PyExc_TypeError, "%s: expected a tuple of the op's %d arguments", who, st->n);
    return false;
  }
  return true;
}

// learn(args, out, fn, vid, subs, checks, gate, py_checks, guard, python_only, rule) -> bool:
// remember what the Python path decided for this call's key (False: not a call it serves).
PyObject* core_learn(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  State* st = reinterpret_cast<CallCore*>(self)->st;
  if (nargs != 11) {
    PyErr_SetString(PyExc_TypeError,
                    "learn(args, out, fn, vid, subs, checks, gate, py_checks, guard, python_only, rule)");
    return nullptr;
  }
  if (!unpack_call(st, a[0], "learn")) return nullptr;
  const at::Tensor* ts[kMaxParams];
  uint64_t hash;
  int built;
  try {
    built = build_key(st, &PyTuple_GET_ITEM(a[0], 0), a[1], ts, &hash);
  } catch (const c10::Error&) {
    built = 0;
  }
  if (built != 1) Py_RETURN_FALSE;
  std::unique_ptr<Entry> e(new Entry());
  e->words.assign(st->words.begin(), st->words.begin() + static_cast<std::ptrdiff_t>(st->nwords));
  e->objs = st->objs;
  for (PyObject* o : e->objs) Py_INCREF(o);
  e->python_only = PyObject_IsTrue(a[9]) == 1;
  e->fn = Py_NewRef(a[2]);
  e->vid = Py_NewRef(a[3]);
  e->subs.assign(st->n, nullptr);
  if (!PyTuple_Check(a[4])) {
    PyErr_SetString(PyExc_TypeError, "learn: subs must be a tuple of (index, value) pairs");
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(a[4]); ++k) {
    PyObject* pair = PyTuple_GET_ITEM(a[4], k);
    bool ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
    int i = ok ? static_cast<int>(as_int64(PyTuple_GET_ITEM(pair, 0), &ok)) : -1;
    if (!ok || i < 0 || i >= st->n) {
      PyErr_SetString(PyExc_ValueError, "learn: subs must be (parameter index, value) pairs");
      return nullptr;
    }
    Py_XSETREF(e->subs[i], Py_NewRef(PyTuple_GET_ITEM(pair, 1)));
  }
  if (!parse_checks(st->n, st->kind, a[5], e->checks, "learn") || !parse_guards(st->n, st->kind, a[8], e->guards)) return nullptr;
  if (a[6] != Py_None) e->gate = Py_NewRef(a[6]);
  if (a[7] != Py_None) e->py_checks = Py_NewRef(a[7]);
  if (a[10] != Py_None) e->rule = Py_NewRef(a[10]);
  if (st->size >= kMapLimit) clear_map(st);
  auto& bucket = st->map[hash];
  for (Entry*& old : bucket) {
    if (old->words == e->words && same_objects(old->objs, e->objs)) {
      Entry* replaced = old;
      old = e.release();
      release(replaced);
      Py_RETURN_TRUE;
    }
  }
  bucket.push_back(e.release());
  ++st->size;
  Py_RETURN_TRUE;
}

PyObject* key_tuple(State* st) {
  PyObject* w = PyTuple_New(static_cast<Py_ssize_t>(st->nwords));
  if (w == nullptr) return nullptr;
  for (size_t k = 0; k < st->nwords; ++k) {
    PyObject* v = PyLong_FromLongLong(st->words[k]);
    if (v == nullptr) {
      Py_DECREF(w);
      return nullptr;
    }
    PyTuple_SET_ITEM(w, k, v);
  }
  PyObject* o = PyTuple_New(static_cast<Py_ssize_t>(st->objs.size()));
  if (o == nullptr) {
    Py_DECREF(w);
    return nullptr;
  }
  for (size_t k = 0; k < st->objs.size(); ++k) {
    // With its type, as the core compares them (1 == True == 1.0 as values alone).
    PyObject* pair = PyTuple_Pack(2, st->objs[k], reinterpret_cast<PyObject*>(Py_TYPE(st->objs[k])));
    if (pair == nullptr) {
      Py_DECREF(w);
      Py_DECREF(o);
      return nullptr;
    }
    PyTuple_SET_ITEM(o, k, pair);
  }
  return Py_BuildValue("(NN)", w, o);
}

// The key of the call (args, out) that key() and lookup() inspect: 1 built (its hash in *hash),
// 0 not a call the core keys (the Python path's), -1 a Python error set.
int inspected_key(State* st, PyObject* const* a, Py_ssize_t nargs, const char* what, uint64_t* hash) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "%s(args, out)", what);
    return -1;
  }
  if (!unpack_call(st, a[0], what)) return -1;
  const at::Tensor* ts[kMaxParams];
  try {
    return build_key(st, &PyTuple_GET_ITEM(a[0], 0), a[1], ts, hash) == 1 ? 1 : 0;
  } catch (const c10::Error&) {
    return 0;
  }
}

// key(args, out) -> (words, ((object, its type), ...)) or None: the key the core builds for
// this call (tests compare its classes with the Python memo key's).
PyObject* core_key(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  State* st = reinterpret_cast<CallCore*>(self)->st;
  uint64_t hash;
  int got = inspected_key(st, a, nargs, "key", &hash);
  if (got < 0) return nullptr;
  if (got == 0) Py_RETURN_NONE;
  return key_tuple(st);
}

// lookup(args, out) -> the variant id memoised for this call's key, or None.
PyObject* core_lookup(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  State* st = reinterpret_cast<CallCore*>(self)->st;
  uint64_t hash;
  int got = inspected_key(st, a, nargs, "lookup", &hash);
  if (got < 0) return nullptr;
  if (got == 0) Py_RETURN_NONE;
  Entry* e = find(st, hash);
  if (e == nullptr || e->python_only) Py_RETURN_NONE;
  return Py_NewRef(e->vid);
}

PyObject* core_clear(PyObject* self, PyObject*) {
  clear_map(reinterpret_cast<CallCore*>(self)->st);
  Py_RETURN_NONE;
}

Py_ssize_t core_len(PyObject* self) {
  return static_cast<Py_ssize_t>(reinterpret_cast<CallCore*>(self)->st->size);
}

// CallCore(kinds, mutated, npos, kwnames, pins_var, counters, fail, miss, graph=None)
//   kinds: per parameter 0 (not a tensor), 1 (a tensor), 2 (a tensor or None)
//   mutated: per parameter, whether the op writes it (its strides are part of the key)
//   graph: passed as `out`, a compiled graph's call: no `out`, each output aliasing an argument cloned
PyObject* core_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *kinds, *mutated, *kwnames, *pins_var, *counters, *fail, *miss, *graph = Py_None;
  int npos;
  static const char* names[] = {"kinds", "mutated", "npos", "kwnames", "pins_var", "counters", "fail", "miss",
                                "graph", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!iO!OO!OO|O", const_cast<char**>(names), &PyTuple_Type, &kinds,
                                   &PyTuple_Type, &mutated, &npos, &PyTuple_Type, &kwnames, &pins_var, &PyDict_Type,
                                   &counters, &fail, &miss, &graph)) {
    return nullptr;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(kinds);
  if (n > kMaxParams || PyTuple_GET_SIZE(mutated) != n || npos < 0 || npos > n ||
      PyTuple_GET_SIZE(kwnames) != n - npos || !PyContextVar_CheckExact(pins_var) || !PyCallable_Check(fail)) {
    PyErr_Format(PyExc_ValueError,
                 "CallCore: expected up to %d parameters, a kind and a mutated flag for each, the keyword-only "
                 "names after npos, a ContextVar and a callable",
                 kMaxParams);
    return nullptr;
  }
  auto st = std::make_unique<State>();
  st->n = static_cast<int>(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int k = parse_kind(PyTuple_GET_ITEM(kinds, i), "CallCore");
    if (k < 0) return nullptr;
    st->kind.push_back(static_cast<int8_t>(k));
    int m = PyObject_IsTrue(PyTuple_GET_ITEM(mutated, i));
    if (m < 0) return nullptr;
    st->mutated.push_back(static_cast<uint8_t>(m && k != kValue));
  }
  st->npos = npos;
  st->kwnames = Py_NewRef(kwnames);
  st->pins_var = Py_NewRef(pins_var);
  st->counters = Py_NewRef(counters);
  st->fail = Py_NewRef(fail);
  st->miss = Py_NewRef(miss);
  // None (no graph calls): `out` None is an ordinary call, never a graph call.
  st->graph = graph == Py_None ? nullptr : Py_NewRef(graph);
  return new_core<CallCore>(type, core_vectorcall, std::move(st));
}

void core_dealloc(PyObject* self) {
  auto* core = reinterpret_cast<CallCore*>(self);
  PyObject_GC_UnTrack(self);
  if (core->st != nullptr) {
    State* st = core->st;
    core->st = nullptr;
    clear_map(st);
    Py_XDECREF(st->kwnames);
    Py_XDECREF(st->pins_var);
    Py_XDECREF(st->counters);
    Py_XDECREF(st->fail);
    Py_XDECREF(st->miss);
    Py_XDECREF(st->graph);
    Py_XDECREF(st->last_pins);
    delete st;
  }
  Py_TYPE(self)->tp_free(self);
}

int core_traverse(PyObject* self, visitproc visit, void* arg) {
  State* st = reinterpret_cast<CallCore*>(self)->st;
  if (st == nullptr) return 0;
  Py_VISIT(st->fail);  // a closure over the spec: the one reference a cycle could go through
  for (auto& kv : st->map)
    for (Entry* e : kv.second) {
      Py_VISIT(e->fn);
      Py_VISIT(e->py_checks);
      Py_VISIT(e->rule);  // a closure over the spec, as fail is
    }
  return 0;
}

int core_clear_refs(PyObject* self) {
  State* st = reinterpret_cast<CallCore*>(self)->st;
  if (st != nullptr) {
    clear_map(st);
    Py_CLEAR(st->fail);
    st->fail = Py_NewRef(Py_None);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// BoundCore: what kv.bind returns where the core is built
// ---------------------------------------------------------------------------------------------
//
// The op's signature bound in C (positional and keyword arguments, defaults), then what a bound
// call checks (every non-tensor argument equals the example's; the index values, against the
// example's sizes; every tensor like the example's: the memo key's words and its dispatch keys;
// no gradient needed where the example needed none; the write guard), then the variant, called
// the way OpSpec.invoke does. Anything else (an `out`, a binding error, a changed value or
// tensor, a bad index value, an index tensor it cannot read, an overlap) goes to the Python
// bound function it was made with, which runs or raises with its message.

struct BoundState {
  int n = 0;  // the op's parameters; names[n] is "out"
  int npos = 0;  // how many may be passed by position
  std::vector<int8_t> kind;
  std::vector<uint8_t> mutated;
  std::vector<int64_t> like;  // the example's tensors' words (tensor_words), in parameter order
  std::vector<uint64_t> keys;  // per parameter: the example tensor's dispatch keys & kBoundKeys (0: None, a value)
  bool grad = false;  // whether the example needed a gradient (a call may need one only then)
  std::vector<Guard> guards;
  std::vector<PyObject*> names;  // owned
  std::vector<PyObject*> defaults;  // owned; nullptr: required
  std::vector<int> fixed;  // the non-tensor parameters
  std::vector<PyObject*> expected;  // owned: the example's value of each
  std::vector<PyObject*> subs;  // owned or nullptr: the normalised values
  std::vector<Check> checks;
  PyObject* gate = nullptr;
  PyObject* py_checks = nullptr;
  PyObject* rule = nullptr;  // off the CPU, the op's device rule for the bound variant
  PyObject* counters = nullptr;
  PyObject* fn = nullptr;
  PyObject* vid = nullptr;
  PyObject* kwnames = nullptr;
  PyObject* fail = nullptr;
  PyObject* fallback = nullptr;

  ~BoundState() {
    for (PyObject* o : names) Py_XDECREF(o);
    for (PyObject* o : defaults) Py_XDECREF(o);
    for (PyObject* o : expected) Py_XDECREF(o);
    for (PyObject* o : subs) Py_XDECREF(o);
    Py_XDECREF(gate);
    Py_XDECREF(py_checks);
    Py_XDECREF(rule);
    Py_XDECREF(counters);
    Py_XDECREF(fn);
    Py_XDECREF(vid);
    Py_XDECREF(kwnames);
    Py_XDECREF(fail);
    Py_XDECREF(fallback);
  }
};

struct BoundCore {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* dict;  // __doc__, __signature__, op, variant: what kv.bind's function carries
  BoundState* st;
};

inline int param_index(const BoundState* st, PyObject* name) {
  int total = st->n + 1;
  for (int i = 0; i < total; ++i)
    if (st->names[i] == name) return i;  // identifiers are interned: the usual hit
  for (int i = 0; i < total; ++i)
    if (PyUnicode_Compare(st->names[i], name) == 0) return i;
  if (PyErr_Occurred()) PyErr_Clear();
  return -1;
}

// The Python bound function's test: another type (as the memo key, which holds each value's
// type: -1.0 is not -1), or `value != expected`; -1 on an error.
inline int differs(PyObject* value, PyObject* expected) {
  if (Py_TYPE(value) != Py_TYPE(expected)) return 1;
  if (value == expected &&
      (PyUnicode_CheckExact(value) || PyLong_CheckExact(value) || value == Py_None || PyBool_Check(value)))
    return 0;  // what != gives for the same str, int, bool or None, without asking
  PyObject* r = PyObject_RichCompare(value, expected, Py_NE);
  if (r == nullptr) return -1;
  int t = PyObject_IsTrue(r);
  Py_DECREF(r);
  return t;
}

// Whether the call's tensors are like the example's (ts: each, nullptr for None): the same words
// (shape, dtype, device, a written tensor's strides), the same dispatch keys, and a gradient
// needed only where the example needed one.
bool like_example(BoundState* st, PyObject* const* slot, const at::Tensor** ts) {
  Match match{st->like.data(), st->like.data() + st->like.size()};
  const bool refuse_grad = !st->grad && c10::GradMode::is_enabled();
  for (int i = 0; i < st->n; ++i) {
    if (st->kind[i] == kValue) continue;
    if (!tensor_words(slot[i], st->kind[i], st->mutated[i], match, &ts[i], false)) return false;
    if (ts[i] == nullptr) continue;
    const c10::TensorImpl* impl = ts[i]->unsafeGetTensorImpl();
    if ((impl->key_set().raw_repr() & kBoundKeys) != st->keys[i]) return false;
    if (refuse_grad && impl->requires_grad()) return false;
  }
  return match.w == match.end;
}

PyObject* bound_fallback(BoundState* st, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  return PyObject_Vectorcall(st->fallback, args, nargsf, kwnames);
}

PyObject* bound_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  BoundState* st = reinterpret_cast<BoundCore*>(self)->st;
  if (st == nullptr) {  // cleared by the GC breaking a cycle, then called from a finalizer
    PyErr_SetString(PyExc_RuntimeError, "a cleared bound op");
    return nullptr;
  }
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  int total = st->n + 1;
  PyObject* slot[kMaxParams + 1] = {};
  if (nargs > st->npos) return bound_fallback(st, args, nargsf, kwnames);  // Python says what is wrong
  for (Py_ssize_t i = 0; i < nargs; ++i) slot[i] = args[i];
  if (kwnames != nullptr) {
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nk; ++k) {
      int i = param_index(st, PyTuple_GET_ITEM(kwnames, k));
      if (i < 0 || slot[i] != nullptr) return bound_fallback(st, args, nargsf, kwnames);
      slot[i] = args[nargs + k];
    }
  }
  for (int i = 0; i < total; ++i) {
    if (slot[i] == nullptr) {
      if (st->defaults[i] == nullptr) return bound_fallback(st, args, nargsf, kwnames);
      slot[i] = st->defaults[i];
    }
  }
  if (slot[st->n] != Py_None) return bound_fallback(st, args, nargsf, kwnames);  // out=: checked in Python
  for (size_t k = 0; k < st->fixed.size(); ++k) {
    int d = differs(slot[st->fixed[k]], st->expected[k]);
    if (d != 0) {
      if (d < 0) PyErr_Clear();
      return bound_fallback(st, args, nargsf, kwnames);
    }
  }
  const at::Tensor* ts[kMaxParams] = {};
  bool ok = true;
  try {
    ok = like_example(st, slot, ts);
    if (ok && !st->checks.empty()) {
      for (const Check& c : st->checks) {  // read in place on the host only
        const at::Tensor* t = ts[c.index];
        ok = ok && t != nullptr && (t->unsafeGetTensorImpl()->key_set().raw_repr() & ~kServed) == 0;
      }
      ok = ok && !gate_counted(st->counters, st->gate) && values_pass(st->checks, ts);
    }
    ok = ok && writes_safe(st->guards, ts);
  } catch (const c10::Error&) {
    ok = false;
  }
  if (!ok) return bound_fallback(st, args, nargsf, kwnames);
  if (st->py_checks != nullptr) {
    PyObject* tup = PyTuple_New(st->n);
    if (tup == nullptr) return nullptr;
    for (int i = 0; i < st->n; ++i) PyTuple_SET_ITEM(tup, i, Py_NewRef(slot[i]));
    PyObject* r = PyObject_CallOneArg(st->py_checks, tup);
    Py_DECREF(tup);
    if (r == nullptr) return nullptr;  // the Python check's own error
    Py_DECREF(r);
  }
  PyObject* stack[kMaxParams + 1];
  stack[0] = nullptr;
  for (int i = 0; i < st->n; ++i) stack[i + 1] = st->subs[i] != nullptr ? st->subs[i] : slot[i];
  THPObjectPtr ruled;
  if (st->rule != nullptr && !apply_rule(st->rule, st->n, stack, ruled)) return nullptr;
  PyObject* r = PyObject_Vectorcall(st->fn, stack + 1, st->npos | PY_VECTORCALL_ARGUMENTS_OFFSET, st->kwnames);
  if (r == nullptr) return variant_failed(st->fail, st->vid);
  return r;
}

bool owned_tuple(PyObject* t, std::vector<PyObject*>& out, PyObject* required) {
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(t); ++k) {
    PyObject* o = PyTuple_GET_ITEM(t, k);
    out.push_back(o == required ? nullptr : Py_NewRef(o));
  }
  return true;
}

// BoundCore(names, npos, defaults, required, kinds, mutated, example, grad, guards, fixed, expected,
//           subs, checks, gate, py_checks, rule, counters, fn, vid, kwnames, fail, fallback)
// example: the example's arguments in signature order; grad: whether it needed a gradient;
// guards: its write guard's data (guards.write_plan's declared checks).
PyObject* bound_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *names, *defaults, *required, *kinds, *mutated, *example, *guards, *fixed, *expected, *subs, *checks, *gate,
      *py_checks, *rule, *counters, *fn, *vid, *kwnames, *fail, *fallback;
  int npos, grad;
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "BoundCore takes positional arguments only");
    return nullptr;
  }
  if (!PyArg_ParseTuple(args, "O!iO!OO!O!O!pO!O!O!O!OOOOO!OOO!OO", &PyTuple_Type, &names, &npos, &PyTuple_Type,
                        &defaults, &required, &PyTuple_Type, &kinds, &PyTuple_Type, &mutated, &PyTuple_Type, &example,
                        &grad, &PyTuple_Type, &guards, &PyTuple_Type, &fixed, &PyTuple_Type, &expected,
                        &PyTuple_Type, &subs, &checks, &gate, &py_checks, &rule, &PyDict_Type, &counters, &fn, &vid,
                        &PyTuple_Type, &kwnames, &fail, &fallback)) {
    return nullptr;
  }
  Py_ssize_t total = PyTuple_GET_SIZE(names);
  Py_ssize_t n = total - 1;
  if (n < 1 || n > kMaxParams || PyTuple_GET_SIZE(defaults) != total || PyTuple_GET_SIZE(kinds) != n ||
      PyTuple_GET_SIZE(mutated) != n || PyTuple_GET_SIZE(example) != n ||
      PyTuple_GET_SIZE(fixed) != PyTuple_GET_SIZE(expected) || npos < 0 || npos > n ||
      PyTuple_GET_SIZE(kwnames) != n - npos || !PyCallable_Check(fail) || !PyCallable_Check(fallback) ||
      (rule != Py_None && !PyCallable_Check(rule))) {
    PyErr_SetString(PyExc_ValueError, "BoundCore: inconsistent signature data");
    return nullptr;
  }
  auto st = std::make_unique<BoundState>();
  st->n = static_cast<int>(n);
  st->npos = npos;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int k = parse_kind(PyTuple_GET_ITEM(kinds, i), "BoundCore");
    if (k < 0) return nullptr;
    st->kind.push_back(static_cast<int8_t>(k));
    const int written = PyObject_IsTrue(PyTuple_GET_ITEM(mutated, i));
    if (written < 0) return nullptr;
    st->mutated.push_back(written == 1);
  }
  // The example's words: what each call's tensors are compared with.
  std::vector<int64_t> words(64);
  Emit emit{words, 0};
  st->keys.assign(n, 0);
  for (int i = 0; i < st->n; ++i) {
    if (st->kind[i] == kValue) continue;
    const at::Tensor* t = nullptr;
    bool plain;
    try {
      plain = tensor_words(PyTuple_GET_ITEM(example, i), st->kind[i], st->mutated[i], emit, &t, false);
    } catch (const c10::Error&) {
      plain = false;
    }
    if (!plain) {
      PyErr_SetString(PyExc_ValueError, "BoundCore: the example's tensors are not plain tensors");
      return nullptr;
    }
    if (t != nullptr) st->keys[i] = t->unsafeGetTensorImpl()->key_set().raw_repr() & kBoundKeys;
  }
  st->like.assign(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(emit.end()));
  st->grad = grad != 0;
  if (!parse_guards(st->n, st->kind, guards, st->guards)) return nullptr;
  for (Py_ssize_t k = 0; k < total; ++k) {
    PyObject* name = PyTuple_GET_ITEM(names, k);
    if (!PyUnicode_Check(name)) {
      PyErr_SetString(PyExc_TypeError, "BoundCore: parameter names are strings");
      return nullptr;
    }
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);  // the identity test of param_index then hits
    st->names.push_back(name);
  }
  owned_tuple(defaults, st->defaults, required);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(fixed); ++k) {
    long i = PyLong_AsLong(PyTuple_GET_ITEM(fixed, k));
    if (i < 0 || i >= n) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "BoundCore: a fixed index is out of range");
      return nullptr;
    }
    st->fixed.push_back(static_cast<int>(i));
    st->expected.push_back(Py_NewRef(PyTuple_GET_ITEM(expected, k)));
  }
  st->subs.assign(n, nullptr);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(subs); ++k) {
    PyObject* pair = PyTuple_GET_ITEM(subs, k);
    bool ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
    int i = ok ? static_cast<int>(as_int64(PyTuple_GET_ITEM(pair, 0), &ok)) : -1;
    if (!ok || i < 0 || i >= n) {
      PyErr_SetString(PyExc_ValueError, "BoundCore: subs must be (parameter index, value) pairs");
      return nullptr;
    }
    Py_XSETREF(st->subs[i], Py_NewRef(PyTuple_GET_ITEM(pair, 1)));
  }
  if (!parse_checks(st->n, st->kind, checks, st->checks, "BoundCore")) return nullptr;
  if (gate != Py_None) st->gate = Py_NewRef(gate);
  if (py_checks != Py_None) st->py_checks = Py_NewRef(py_checks);
  if (rule != Py_None) st->rule = Py_NewRef(rule);
  st->counters = Py_NewRef(counters);
  st->fn = Py_NewRef(fn);
  st->vid = Py_NewRef(vid);
  st->kwnames = Py_NewRef(kwnames);
  st->fail = Py_NewRef(fail);
  st->fallback = Py_NewRef(fallback);
  return new_core<BoundCore>(type, bound_vectorcall, std::move(st));  // dict: nullptr
}

int bound_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* b = reinterpret_cast<BoundCore*>(self);
  Py_VISIT(b->dict);
  if (b->st != nullptr) {
    Py_VISIT(b->st->fn);
    Py_VISIT(b->st->fail);
    Py_VISIT(b->st->fallback);
    Py_VISIT(b->st->py_checks);
    Py_VISIT(b->st->rule);
  }
  return 0;
}

int bound_clear(PyObject* self) {
  auto* b = reinterpret_cast<BoundCore*>(self);
  Py_CLEAR(b->dict);
  if (b->st != nullptr) {
    BoundState* st = b->st;
    b->st = nullptr;
    delete st;
  }
  return 0;
}

void bound_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  bound_clear(self);
  Py_TYPE(self)->tp_free(self);
}

PyObject* bound_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  return PyVectorcall_Call(self, args, kwargs);
}

PyTypeObject BoundCoreType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject CallCoreType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// The module functions below are called from Python code of the package, each wrapped in
// HANDLE_TH_ERRORS: any C++ exception (a c10::Error, an allocation failure, a Python error raised
// by a tensor subclass's dispatch) becomes a Python exception, never an abort.

// unaliased(result, *args): `result` (a tensor, or a tuple or list of tensors), each output that
// shares storage with a tensor among `args` replaced by a clone. A torch.library op's output may
// not alias an input; a compiled graph's kernel runs this after the dispatched call (no built-in
// variant's output aliases an input, a plugin's might).
// Whether a tensor is a Python tensor: the exact type first, as None and the op's other values
// would otherwise each take isinstance's slow path (a bound __instancecheck__ per call).
inline bool is_tensor(PyObject* o) {
  return THPVariable_CheckExact(o) || (o != Py_None && THPVariable_Check(o));
}

// The tensors an output is compared with: the Python arguments (unaliased), or the storages a
// core call read before its variant ran (bases, by position).
struct Inputs {
  PyObject* const* args = nullptr;
  const Base* bases = nullptr;
  Py_ssize_t n = 0;
};

bool shares_storage(const at::Tensor& o, const Inputs& in) {
  if (!o.has_storage()) return false;
  const void* mine = o.storage().data();
  for (Py_ssize_t i = 0; i < in.n; ++i) {
    if (in.bases != nullptr) {
      if (in.bases[i].present && in.bases[i].data == mine) return true;
      continue;
    }
    if (!is_tensor(in.args[i])) continue;
    const at::Tensor& t = THPVariable_Unpack(in.args[i]);
    if (t.has_storage() && t.storage().data() == mine) return true;
  }
  return false;
}

PyObject* fresh(PyObject* o, const Inputs& in) {
  // Not a tensor: handed back, for torch to say what the op's schema expected.
  if (!is_tensor(o)) return Py_NewRef(o);
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!shares_storage(t, in)) return Py_NewRef(o);
  return THPVariable_Wrap(t.clone());
}

PyObject* unalias_checked(PyObject* res, const Inputs& in) {
  HANDLE_TH_ERRORS
  if (!PyTuple_Check(res) && !PyList_Check(res)) return fresh(res, in);
  THPObjectPtr items(PySequence_Tuple(res));
  if (!items) return nullptr;
  const Py_ssize_t k = PyTuple_GET_SIZE(items.get());
  THPObjectPtr out(PyTuple_New(k));
  if (!out) return nullptr;
  for (Py_ssize_t i = 0; i < k; ++i) {
    PyObject* f = fresh(PyTuple_GET_ITEM(items.get(), i), in);
    if (f == nullptr) return nullptr;
    PyTuple_SET_ITEM(out.get(), i, f);
  }
  return out.release();
  END_HANDLE_TH_ERRORS
}

PyObject* unaliased(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "unaliased(result, *args): expected the result");
    return nullptr;
  }
  Inputs in;
  in.args = args + 1;
  in.n = nargs - 1;
  return unalias_checked(args[0], in);
}

// A core's graph call: the output compared with the storages read before the variant ran, by
// position (no Python type test or TensorImpl read per argument after the kernel).
PyObject* unalias_graph(PyObject* res, const State* st, const Base* bases) {
  Inputs in;
  in.bases = bases;
  in.n = st->n;
  return unalias_checked(res, in);
}

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
// `missed`; any other call to `entry`, the op's Python entry (the core's resolver before the
// op's first call, the Python path with the core off).
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

// The op's call core for an adapter's views: the slot's core where it keys x's device (the
// CPU; CUDA where a capture check is installed), None otherwise (the op's entry then: asking a
// core that serves no such tensor first would build the key twice).
PyObject* step_core(PyObject* core, const at::Tensor& x) {
  return x.is_cpu() || (x.is_cuda() && cuda_served()) ? core : Py_None;
}

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
//
// What an op's public function calls once its core is found (callcore.Slot): the slot's core
// served from here, the op's Python entry frame skipped (~0.25 us a call). A builtin function
// whose self is (slot, python entry, after_miss, "core"): it reads the slot's core per call (a
// reload re-arms the slot), serves through it when it is this module's CallCore, hands a call
// it misses to after_miss (the entry's Python path past its core, which would otherwise build
// the key again) and anything else (a resolver, no core) to the Python entry itself. Dynamo
// never runs it: it is told to trace a Python function in its place (_runtime/ops.py: _c_entry).

PyObject* entry_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  THPObjectPtr core(PyObject_GetAttr(PyTuple_GET_ITEM(self, 0), PyTuple_GET_ITEM(self, 3)));
  if (!core) return nullptr;
  return call_op(core.get(), PyTuple_GET_ITEM(self, 1), PyTuple_GET_ITEM(self, 2), args, static_cast<size_t>(nargs));
}

// op_entry(name, slot, python, after_miss) -> the entry above, named `name` (its def lives as
// long as the process: an op's entry is never dropped).
PyObject* op_entry(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (nargs != 4 || !PyUnicode_Check(a[0])) {
    PyErr_SetString(PyExc_TypeError, "op_entry(name, slot, python, after_miss): expected 4 arguments");
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(a[0]);
  if (name == nullptr) return nullptr;
  THPObjectPtr core_name(PyUnicode_InternFromString("core"));
  if (!core_name) return nullptr;
  THPObjectPtr self(PyTuple_Pack(4, a[1], a[2], a[3], core_name.get()));
  if (!self) return nullptr;
  auto* def = new PyMethodDef{(new std::string(name))->c_str(),
                              reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(entry_call)),
                              METH_FASTCALL, "An op's dispatched entry (kernel_variants' call core)."};
  return PyCFunction_NewEx(def, self.get(), nullptr);
}

// --- a compiled graph's kernel of the op, in C++ ---
//
// Registered by custom_ops as the CompositeExplicitAutograd kernel of `kernel_variants::<op>`
// (each overload that returns its outputs) where the core is built: a graph's call reaches the
// core from the dispatcher's stack with no Python frame on the way. A Python kernel there costs
// the frame, its globals and the slot's attribute, each a cache miss after a large kernel, on
// top of what a plain op's Python kernel costs; this kernel reads the slot's core and calls it
// as the Python kernel would, and hands anything else (the core not yet resolved, off, a miss)
// to that Python kernel's code, so both give the same results and errors (a variant's result
// that is not the op's outputs: both raise errors.result_error's TypeError).

// A Python object for a schema argument of the op's (Tensor, Tensor?, int, float, bool, str and
// their optional forms): a new reference, or nullptr with a Python error set.
PyObject* to_python(const c10::IValue& v) {
  if (v.isTensor()) return THPVariable_Wrap(v.toTensor());
  if (v.isNone()) return Py_NewRef(Py_None);
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  if (v.isInt()) return PyLong_FromLongLong(v.toInt());
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  if (v.isString()) {
    const auto& s = v.toStringRef();
    return PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
  }
  PyErr_Format(PyExc_TypeError, "kernel_variants graph kernel: an argument of type %s, where the op's schema has "
               "Tensor, int, float, bool or str", v.tagKind().c_str());
  return nullptr;
}

class GraphKernel final : public c10::OperatorKernel {
 public:
  // slot: the op's callcore.Slot (its `core` read per call); kernel: the Python kernel, called
  // where the slot holds no CallCore; miss: its Python path, called on the core's miss. Held
  // for the life of the process, as the registration is.
  // core_name: the interned "core" (an attribute read by a str made per call costs more).
  // bad(result): the exception for a result that is not the op's n_out tensors.
  GraphKernel(PyObject* slot, PyObject* kernel, PyObject* miss, PyObject* bad, PyObject* core_name, int n, int n_out)
      : slot_(Py_NewRef(slot)), kernel_(Py_NewRef(kernel)), miss_(Py_NewRef(miss)), bad_(Py_NewRef(bad)),
        core_name_(Py_NewRef(core_name)), n_(n), n_out_(n_out) {}

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    // A graph runs from Python (the GIL held: this costs a thread-state read), but a caller in
    // C++ may not hold it.
    const PyGILState_STATE gil = PyGILState_Ensure();
    struct Release {
      PyGILState_STATE g;
      ~Release() { PyGILState_Release(g); }
    } release{gil};
    PyObject* args[kMaxParams + 1];
    struct Refs {
      PyObject** a;
      int k = 0;
      ~Refs() {
        for (int i = 0; i < k; ++i) Py_DECREF(a[i]);
      }
    } refs{args};
    auto in = torch::jit::last(*stack, n_);
    for (int i = 0; i < n_; ++i) {
      args[i] = to_python(in[i]);
      if (args[i] == nullptr) throw python_error_now();
      refs.k = i + 1;
    }
    THPObjectPtr res(call(args));
    if (!res) throw python_error_now();
    torch::jit::drop(*stack, n_);
    push_outputs(res.get(), stack);
  }

 private:
  static python_error python_error_now() {
    python_error e;
    e.persist();
    return e;
  }

  PyObject* call(PyObject** args) {
    THPObjectPtr core(PyObject_GetAttr(slot_, core_name_));
    if (!core) return nullptr;
    State* st = Py_IS_TYPE(core.get(), &CallCoreType) ? reinterpret_cast<CallCore*>(core.get())->st : nullptr;
    // Another op's core (never put there, but args holds n_ + 1 slots): the Python kernel serves.
    if (st == nullptr || st->n != n_) return PyObject_Vectorcall(kernel_, args, n_, nullptr);
    args[n_] = st->graph;
    PyObject* res = serve_or_miss(st, args);
    if (res != st->miss) return res;
    Py_DECREF(res);
    return PyObject_Vectorcall(miss_, args, n_, nullptr);
  }

  // The kernel's result (a tensor; a tuple or list of n_out tensors) onto the stack, all checked
  // before any is pushed.
  void push_outputs(PyObject* res, torch::jit::Stack* stack) const {
    if (n_out_ == 1) {
      if (!is_tensor(res)) raise_bad(res);
      torch::jit::push(*stack, THPVariable_Unpack(res));
      return;
    }
    if (!(PyTuple_Check(res) || PyList_Check(res)) || PySequence_Fast_GET_SIZE(res) != n_out_) raise_bad(res);
    for (int i = 0; i < n_out_; ++i)
      if (!is_tensor(PySequence_Fast_GET_ITEM(res, i))) raise_bad(res);
    for (int i = 0; i < n_out_; ++i) torch::jit::push(*stack, THPVariable_Unpack(PySequence_Fast_GET_ITEM(res, i)));
  }

  // The Python side's exception for a bad result (errors.result_error), raised through the
  // dispatcher as itself.
  [[noreturn]] void raise_bad(PyObject* res) const {
    THPObjectPtr exc(PyObject_CallOneArg(bad_, res));
    if (exc) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.get())), exc.get());
    throw python_error_now();
  }

  PyObject* slot_;
  PyObject* kernel_;
  PyObject* miss_;
  PyObject* bad_;
  PyObject* core_name_;
  int n_;
  int n_out_;
};

// graph_kernel(name, slot, kernel, miss, bad, n, n_out): registers GraphKernel as the
// CompositeExplicitAutograd kernel of `kernel_variants::<name>` (an overload as
// "op.overload"). The registration is never undone: the Library is kept for the process, as
// the op's Python one is (undone at exit, it would run after the op's definition is gone).
PyObject* graph_kernel(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 7 || !PyUnicode_Check(a[0])) {
    PyErr_SetString(PyExc_TypeError, "graph_kernel(name, slot, kernel, miss, bad, n, n_out): expected 7 arguments");
    return nullptr;
  }
  const long n = PyLong_AsLong(a[5]);
  const long n_out = PyLong_AsLong(a[6]);
  if (PyErr_Occurred()) return nullptr;
  if (n < 0 || n > kMaxParams || n_out < 1) {
    PyErr_Format(PyExc_ValueError, "graph_kernel: n in 0..%d and n_out >= 1, got %ld and %ld", kMaxParams, n, n_out);
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(a[0]);
  if (name == nullptr) return nullptr;
  THPObjectPtr core_name(PyUnicode_InternFromString("core"));
  if (!core_name) return nullptr;
  static auto* libs = new std::vector<std::unique_ptr<torch::Library>>();
  libs->push_back(std::make_unique<torch::Library>(torch::Library::IMPL, "kernel_variants",
                                                   c10::DispatchKey::CompositeExplicitAutograd, __FILE__, __LINE__));
  libs->back()->impl(name, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<GraphKernel>(
                               a[1], a[2], a[3], a[4], core_name.get(), static_cast<int>(n), static_cast<int>(n_out))));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// capture_check(device_type, check): install (or, with None, remove) the callable that says
// whether a graph is being captured on devices of `device_type` ("cuda"); with one for CUDA,
// the cores serve CUDA tensors too. Returns the one it replaces (or None).
PyObject* capture_check(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || !PyUnicode_Check(a[0]) || (a[1] != Py_None && !PyCallable_Check(a[1]))) {
    PyErr_SetString(PyExc_TypeError, "capture_check(device_type, check): a device type and a callable or None");
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(a[0]);
  if (name == nullptr) return nullptr;
  const auto type = static_cast<int>(c10::Device(std::string(name)).type());
  PyObject* before = g_capturing[type];
  g_capturing[type] = a[1] == Py_None ? nullptr : Py_NewRef(a[1]);
  return before != nullptr ? before : Py_NewRef(Py_None);  // the table's reference, handed over
  END_HANDLE_TH_ERRORS
}

PyMethodDef module_methods[] = {
    {"capture_check", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(capture_check)), METH_FASTCALL,
     "capture_check(device_type, check) -> the check it replaces: whether a graph is being captured there"},
    {"channel_last", channel_last, METH_O, "channel_last(t) -> t.transpose(-1, -2) as a plain alias"},
    {"decode_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(decode_step)), METH_FASTCALL,
     "decode_step(core, entry, x, pool, weight, bias, activation, indices, sentinel, table) -> [B, dim] or None"},
    {"prefill_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(prefill_step)), METH_FASTCALL,
     "prefill_step(core, entry, x, weight, bias, pool, query_start_loc, indices, has_initial_state, activation, "
     "sentinel, table, lengths) -> (dim, T) or None"},
    {"graph_kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(graph_kernel)), METH_FASTCALL,
     "graph_kernel(name, slot, kernel, miss, bad, n, n_out): the op's compiled-graph kernel in C++"},
    {"op_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(op_entry)), METH_FASTCALL,
     "op_entry(name, slot, python, after_miss): an op's entry in C, serving through the slot's core"},
    {"unaliased", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unaliased)), METH_FASTCALL,
     "unaliased(result, *args) -> result, each output sharing storage with a tensor argument cloned"},
    {nullptr, nullptr, 0, nullptr},
};

PyMethodDef core_methods[] = {
    {"learn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(core_learn)), METH_FASTCALL,
     "learn(args, out, fn, vid, subs, checks, gate, py_checks, guard, python_only, rule) -> bool"},
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(core_key)), METH_FASTCALL,
     "key(args, out) -> (words, objects) or None"},
    {"lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(core_lookup)), METH_FASTCALL,
     "lookup(args, out) -> the variant id memoised for the call's key, or None"},
    {"clear", core_clear, METH_NOARGS, "forget every entry"},
    {nullptr, nullptr, 0, nullptr},
};

PySequenceMethods core_sequence = {
    core_len,  // sq_length
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT};

// The slots CallCore and BoundCore share: GC-tracked objects called through vectorcall.
void init_type(PyTypeObject& t, const char* name, Py_ssize_t size, const char* doc, newfunc make,
               destructor dealloc, traverseproc traverse, inquiry clear, Py_ssize_t vectorcall_offset,
               ternaryfunc call) {
  t.tp_name = name;
  t.tp_basicsize = size;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC;
  t.tp_doc = doc;
  t.tp_new = make;
  t.tp_dealloc = dealloc;
  t.tp_traverse = traverse;
  t.tp_clear = clear;
  t.tp_free = PyObject_GC_Del;
  t.tp_vectorcall_offset = vectorcall_offset;
  t.tp_call = call;
}

}  // namespace

#define KV_CONCAT2(a, b) a##b
#define KV_CONCAT(a, b) KV_CONCAT2(a, b)
#define KV_STR2(a) #a
#define KV_STR(a) KV_STR2(a)

PyMODINIT_FUNC KV_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  init_type(CallCoreType, KV_STR(TORCH_EXTENSION_NAME) ".CallCore", sizeof(CallCore),
            "The compiled per-call path of one op (see call_core.cpp).", core_new, core_dealloc,
            core_traverse, core_clear_refs, offsetof(CallCore, vectorcall), PyVectorcall_Call);
  CallCoreType.tp_methods = core_methods;
  CallCoreType.tp_as_sequence = &core_sequence;
  if (PyType_Ready(&CallCoreType) < 0) return nullptr;
  init_type(BoundCoreType, KV_STR(TORCH_EXTENSION_NAME) ".BoundCore", sizeof(BoundCore),
            "An op bound to one variant by kernel_variants.bind, called in C (see call_core.cpp).",
            bound_new, bound_dealloc, bound_traverse, bound_clear, offsetof(BoundCore, vectorcall),
            bound_call);
  BoundCoreType.tp_dictoffset = offsetof(BoundCore, dict);
  if (PyType_Ready(&BoundCoreType) < 0) return nullptr;
  module_def.m_name = KV_STR(TORCH_EXTENSION_NAME);
  module_def.m_doc = "kernel_variants' compiled call core";
  module_def.m_size = -1;
  module_def.m_methods = module_methods;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (PyModule_AddObjectRef(m, "CallCore", reinterpret_cast<PyObject*>(&CallCoreType)) < 0 ||
      PyModule_AddObjectRef(m, "BoundCore", reinterpret_cast<PyObject*>(&BoundCoreType)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
