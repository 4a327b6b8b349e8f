// BoundCore: what kv.bind returns where the core is built.
#include "call_core.h"

namespace kv_core {

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

namespace {

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
    for (const auto* owned : {&names, &defaults, &expected, &subs}) drop_refs(*owned);
    drop_refs({gate, py_checks, rule, counters, fn, vid, kwnames, fail, fallback});
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

// BoundCore(spec): spec a core_specs.BoundSpec, read by field name. example: the example's
// arguments in signature order; grad: whether it needed a gradient; guards: its write guard's
// data (guards.Written); subs: per parameter, the normalised value or `keep`.
PyObject* bound_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if ((kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) || PyTuple_GET_SIZE(args) != 1) {
    PyErr_SetString(PyExc_TypeError, "BoundCore(spec): one core_specs.BoundSpec");
    return nullptr;
  }
  Fields f(PyTuple_GET_ITEM(args, 0));
  PyObject *names = f("names"), *npos_o = f("npos"), *defaults = f("defaults"), *required = f("required"),
           *kinds = f("kinds"), *mutated = f("mutated"), *example = f("example"), *grad_o = f("grad"),
           *guards = f("guards"), *fixed = f("fixed"), *expected = f("expected"), *subs = f("subs"),
           *checks = f("checks"), *gate = f("gate"), *py_checks = f("py_checks"), *rule = f("rule"),
           *counters = f("counters"), *fn = f("fn"), *vid = f("vid"), *kwnames = f("kwnames"), *fail = f("fail"),
           *fallback = f("fallback"), *keep = f("keep");
  if (!f.ok()) return nullptr;
  for (PyObject* t : {names, defaults, kinds, mutated, example, guards, fixed, expected, subs, kwnames}) {
    if (!PyTuple_Check(t)) {
      PyErr_SetString(PyExc_TypeError, "BoundCore: the spec's sequences are tuples");
      return nullptr;
    }
  }
  if (!PyDict_Check(counters)) {
    PyErr_SetString(PyExc_TypeError, "BoundCore: counters is a dict");
    return nullptr;
  }
  const long npos = PyLong_AsLong(npos_o);
  const int grad = PyObject_IsTrue(grad_o);
  if ((npos == -1 || grad < 0) && PyErr_Occurred()) return nullptr;
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
  st->npos = static_cast<int>(npos);
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
  if (!parse_subs(st->n, subs, keep, st->subs, "BoundCore")) return nullptr;
  if (!parse_checks(st->n, st->kind, checks, st->checks, "BoundCore")) return nullptr;
  for (auto [member, value] : {std::pair{&st->gate, gate}, {&st->py_checks, py_checks}, {&st->rule, rule}}) {
    if (value != Py_None) *member = Py_NewRef(value);  // None: nothing to run
  }
  keep_refs({{&st->counters, counters}, {&st->fn, fn}, {&st->vid, vid}, {&st->kwnames, kwnames}, {&st->fail, fail},
             {&st->fallback, fallback}});
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
}  // namespace

PyTypeObject BoundCoreType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool add_bound_core(PyObject* module) {
  init_type(BoundCoreType, KV_STR(TORCH_EXTENSION_NAME) ".BoundCore", sizeof(BoundCore),
            "An op bound to one variant by kernel_variants.bind, called in C (see _runtime/csrc/bound.cpp).",
            bound_new, bound_dealloc, bound_traverse, bound_clear, offsetof(BoundCore, vectorcall), bound_call);
  BoundCoreType.tp_dictoffset = offsetof(BoundCore, dict);
  return PyType_Ready(&BoundCoreType) == 0 &&
         PyModule_AddObjectRef(module, "BoundCore", reinterpret_cast<PyObject*>(&BoundCoreType)) == 0;
}

}  // namespace kv_core
