// The compiled call core: the per-call work of a dispatched op, in C++ (one extension,
// kernel_variants._runtime.core_build.CORE; loaded by _runtime/callcore.py).
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
// together (the dispatcher's memo cleared, a new dispatcher, calibration: callcore.clear_all),
// so the core never decides.
//
// The files, one job each, share this header's declarations (namespace kv_core):
//   key.cpp      the CallCore type: the key of a call, its lookup, learn, running the variant
//   checks.cpp   the index value checks and the write guard, run on each call; their data read
//   bound.cpp    the BoundCore type: an op bound to one variant by kv.bind, called in C
//   unalias.cpp  outputs that alias an input replaced by clones (a compiled graph's call)
//   layout.cpp   the engine adapters' layout steps (channel_last, decode_step, prefill_step)
//   graph.cpp    the compiled graph's kernel of an op, and the capture checks per device
//   module.cpp   the module: its functions and types
#pragma once

#include <torch/csrc/autograd/python_variable.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/object_ptr.h>

#include <algorithm>
#include <typeinfo>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kv_core {

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

// What an owner keeps of the objects Python handed it, and gives back when it goes: new
// references taken (`keep_refs`), references dropped (`drop_refs`, nullptr skipped). One list
// per owner, so that a field added to an owner is added in one place each way.
inline void keep_refs(std::initializer_list<std::pair<PyObject**, PyObject*>> fields) {
  for (auto [member, value] : fields) *member = Py_NewRef(value);
}
inline void drop_refs(std::initializer_list<PyObject*> objs) {
  for (PyObject* o : objs) Py_XDECREF(o);
}
inline void drop_refs(const std::vector<PyObject*>& objs) {
  for (PyObject* o : objs) Py_XDECREF(o);
}

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
    drop_refs(objs);
    drop_refs(subs);
    drop_refs({fn, vid, gate, py_checks, rule});
  }
};

inline void release(Entry* e) {
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
  PyObject* keep = nullptr;  // in a learned entry's subs: the call's own value
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

// CallCore's and BoundCore's types (key.cpp, bound.cpp), each added to the module by its file.
extern PyTypeObject CallCoreType;
extern PyTypeObject BoundCoreType;
bool add_call_core(PyObject* module);
bool add_bound_core(PyObject* module);

// Dense CPU tensors, with or without autograd (every CPU tensor carries the autocast key):
// what the key's fields fully describe. Anything with another dispatch key (a wrapper of
// torch.func, a Python-dispatch tensor, sparse, another device) is served by the Python path.
// Compared as raw bits: DispatchKeySet's difference keeps the backend bits.
inline const uint64_t kServed = c10::DispatchKeySet({c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                                              c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU})
                             .raw_repr();
// The same for dense CUDA tensors, served where a capture check for CUDA is installed.
inline const uint64_t kServedCuda = c10::DispatchKeySet({c10::DispatchKey::CUDA, c10::DispatchKey::AutogradCUDA,
                                                  c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCUDA})
                                 .raw_repr();

// Per device type, what says whether a graph is being captured on it now (a callable returning a
// bool; for CUDA the builtin behind torch.cuda.is_current_stream_capturing), installed by
// capture_check() (callcore.py installs CUDA's at the first CUDA call its Python path sees). A
// call on a device with one is keyed only while it says no: a decision made in a capture may be
// provisional (a variant not yet qualified is passed over there), and the Python path keeps such
// calls. Process-wide, as the devices are.
extern PyObject* g_capturing[static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)];

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
inline const uint64_t kBoundKeys = ~(c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView) | c10::autograd_dispatch_keyset |
                              c10::autocast_dispatch_keyset)
                                 .raw_repr();

constexpr uint64_t kMul = 0x9e3779b97f4a7c15ULL;

inline uint64_t mix(uint64_t h, uint64_t v) {
  return (h ^ v) * kMul;
}

// Four independent lanes: a key is tens of words, and one chained multiply per word would be
// the call's longest dependency.
inline uint64_t hash_words(const int64_t* w, size_t n) {
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

// key.cpp
bool same_objects(const std::vector<PyObject*>& a, const std::vector<PyObject*>& b);
PyObject* variant_failed(PyObject* fail, PyObject* vid);
bool apply_rule(PyObject* rule, int n, PyObject** stack, THPObjectPtr& ruled);
// serve() for a call of the op's arguments and out (args[st->n]): its result, or the miss.
PyObject* serve_or_miss(State* st, PyObject* const* args);

// checks.cpp
bool values_pass(const std::vector<Check>& checks, const at::Tensor* const* ts);
bool writes_safe(const std::vector<Guard>& guards, const at::Tensor* const* ts);
bool gate_counted(PyObject* counters, PyObject* gate);
int64_t as_int64(PyObject* o, bool* ok);
int parse_kind(PyObject* o, const char* who);
bool parse_checks(int n, const std::vector<int8_t>& kind, PyObject* seq, std::vector<Check>& out, const char* who);
bool parse_guards(int n, const std::vector<int8_t>& kind, PyObject* seq, std::vector<Guard>& out);
bool parse_subs(int n, PyObject* seq, PyObject* keep, std::vector<PyObject*>& subs, const char* who);
// o.name, a new reference (nullptr with the error set): what Python hands the core is read by name.
THPObjectPtr field(PyObject* o, const char* name);
// The fields of one object Python hands the core (core_specs.CoreSpec, BoundSpec, Learned,
// GraphSpec), read by name once, each held until the reader goes; a missing one leaves its error
// set (ok() false).
class Fields {
 public:
  explicit Fields(PyObject* o) : o_(o) {}
  PyObject* operator()(const char* name) {
    owned_.emplace_back(PyObject_GetAttrString(o_, name));
    if (!owned_.back()) bad_ = true;
    return owned_.back() ? owned_.back().get() : Py_None;
  }
  bool ok() const { return !bad_; }

 private:
  PyObject* o_;
  std::vector<THPObjectPtr> owned_;
  bool bad_ = false;
};

// unalias.cpp
// A tensor argument's storage (data: its first byte; present: a tensor with storage there).
struct Base {
  const void* data;
  bool present;
};
// A core's graph call: its result, each output sharing a storage in `bases` (by position) cloned.
PyObject* unalias_graph(PyObject* res, const State* st, const Base* bases);
PyObject* unaliased(PyObject*, PyObject* const* args, Py_ssize_t nargs);

// Whether a tensor is a Python tensor: the exact type first, as None and the op's other values
// would otherwise each take isinstance's slow path (a bound __instancecheck__ per call).
inline bool is_tensor(PyObject* o) {
  return THPVariable_CheckExact(o) || (o != Py_None && THPVariable_Check(o));
}

// layout.cpp
PyObject* channel_last(PyObject*, PyObject* o);
PyObject* decode_step(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* prefill_step(PyObject*, PyObject* const* args, Py_ssize_t nargs);

// graph.cpp
PyObject* graph_kernel(PyObject*, PyObject* const* a, Py_ssize_t nargs);
PyObject* capture_check(PyObject*, PyObject* const* a, Py_ssize_t nargs);

// A new object of `type` (a CallCore or a BoundCore, Obj) that owns st and is called through vc;
// nullptr with the error set if it cannot be allocated. tp_alloc zeroes the object.
template <class Obj, class St>
inline PyObject* new_core(PyTypeObject* type, vectorcallfunc vc, std::unique_ptr<St> st) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  auto* o = reinterpret_cast<Obj*>(self);
  o->vectorcall = vc;
  o->st = st.release();
  return self;
}

// The slots CallCore and BoundCore share: GC-tracked objects called through vectorcall.
inline void init_type(PyTypeObject& t, const char* name, Py_ssize_t size, const char* doc, newfunc make,
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

}  // namespace kv_core

#define KV_CONCAT2(a, b) a##b
#define KV_CONCAT(a, b) KV_CONCAT2(a, b)
#define KV_STR2(a) #a
#define KV_STR(a) KV_STR2(a)
