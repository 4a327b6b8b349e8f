// The CallCore type: a call's key, its entry looked up, the checks run and the variant called;
// learn() fills the map from the Python path's decisions.
#include "call_core.h"

namespace kv_core {

namespace {

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

// The entry of the key in st's scratch, borrowed (nullptr: none).
Entry* find(State* st, uint64_t hash) {
  auto it = st->map.find(hash);
  if (it == st->map.end()) return nullptr;
  for (Entry* e : it->second) {
    if (same_words(*e, st) && same_objects(e->objs, st->objs)) return e;
  }
  return nullptr;
}


PyObject* call_py_checks(State* st, const Entry& e, PyObject* const* args) {
  PyObject* tup = PyTuple_New(st->n);
  if (tup == nullptr) return nullptr;
  for (int i = 0; i < st->n; ++i) PyTuple_SET_ITEM(tup, i, Py_NewRef(args[i]));
  PyObject* r = PyObject_CallOneArg(e.py_checks, tup);
  Py_DECREF(tup);
  return r;
}

}  // namespace


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

namespace {

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

}  // namespace

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

namespace {

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

// learn(learned) -> bool: remember what the Python path decided for this call's key (False: not a
// call it serves). learned: a core_specs.Learned, read by field name.
PyObject* core_learn(PyObject* self, PyObject* learned) {
  State* st = reinterpret_cast<CallCore*>(self)->st;
  Fields f(learned);
  PyObject *args = f("args"), *out = f("out"), *fn = f("fn"), *vid = f("vid"), *subs = f("subs"),
           *checks = f("checks"), *gate = f("gate"), *py_checks = f("py_checks"), *guards = f("guards"),
           *python_only = f("python_only"), *rule = f("rule");
  if (!f.ok() || !unpack_call(st, args, "learn")) return nullptr;
  const at::Tensor* ts[kMaxParams];
  uint64_t hash;
  int built;
  try {
    built = build_key(st, &PyTuple_GET_ITEM(args, 0), out, ts, &hash);
  } catch (const c10::Error&) {
    built = 0;
  }
  if (built != 1) Py_RETURN_FALSE;
  std::unique_ptr<Entry> e(new Entry());
  e->words.assign(st->words.begin(), st->words.begin() + static_cast<std::ptrdiff_t>(st->nwords));
  e->objs = st->objs;
  for (PyObject* o : e->objs) Py_INCREF(o);
  const int only = PyObject_IsTrue(python_only);
  if (only < 0) return nullptr;  // its __bool__ raised: e (and the references it holds) dropped
  e->python_only = only == 1;
  e->fn = Py_NewRef(fn);
  e->vid = Py_NewRef(vid);
  if (!parse_subs(st->n, subs, st->keep, e->subs, "learn") || !parse_checks(st->n, st->kind, checks, e->checks, "learn") ||
      !parse_guards(st->n, st->kind, guards, e->guards))
    return nullptr;
  if (gate != Py_None) e->gate = Py_NewRef(gate);
  if (py_checks != Py_None) e->py_checks = Py_NewRef(py_checks);
  if (rule != Py_None) e->rule = Py_NewRef(rule);
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
// this call (tests compare its classes with the Python memo key's). lookup(args, out) -> the
// variant id memoised for this call's key, or None.
template <bool kLookup>
PyObject* core_inspect(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  State* st = reinterpret_cast<CallCore*>(self)->st;
  uint64_t hash;
  int got = inspected_key(st, a, nargs, kLookup ? "lookup" : "key", &hash);
  if (got < 0) return nullptr;
  if (got == 0) Py_RETURN_NONE;
  if (!kLookup) return key_tuple(st);
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

// CallCore(spec): spec a core_specs.CoreSpec, read by field name:
//   kinds: per parameter 0 (not a tensor), 1 (a tensor), 2 (a tensor or None)
//   mutated: per parameter, whether the op writes it (its strides are part of the key)
//   graph: passed as `out`, a compiled graph's call: no `out`, each output aliasing an argument cloned
PyObject* core_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* spec;
  static const char* names[] = {"spec", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", const_cast<char**>(names), &spec)) return nullptr;
  Fields f(spec);
  PyObject *kinds = f("kinds"), *mutated = f("mutated"), *npos_o = f("npos"), *kwnames = f("kwnames"),
           *pins_var = f("pins"), *counters = f("counters"), *fail = f("fail"), *miss = f("miss"), *graph = f("graph"),
           *keep = f("keep");
  if (!f.ok()) return nullptr;
  const long npos = PyLong_AsLong(npos_o);
  if (npos == -1 && PyErr_Occurred()) return nullptr;
  if (!PyTuple_Check(kinds) || !PyTuple_Check(mutated) || !PyTuple_Check(kwnames) || !PyDict_Check(counters)) {
    PyErr_SetString(PyExc_TypeError, "CallCore: kinds, mutated and kwnames are tuples, counters a dict");
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
  st->npos = static_cast<int>(npos);
  keep_refs({{&st->kwnames, kwnames}, {&st->keep, keep}, {&st->pins_var, pins_var}, {&st->counters, counters},
             {&st->fail, fail}, {&st->miss, miss}});
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
    drop_refs({st->kwnames, st->pins_var, st->counters, st->fail, st->miss, st->keep, st->graph, st->last_pins});
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
PyMethodDef core_methods[] = {
    {"learn", core_learn, METH_O, "learn(learned) -> bool: a core_specs.Learned remembered for its call's key"},
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(core_inspect<false>)), METH_FASTCALL,
     "key(args, out) -> (words, objects) or None"},
    {"lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(core_inspect<true>)), METH_FASTCALL,
     "lookup(args, out) -> the variant id memoised for the call's key, or None"},
    {"clear", core_clear, METH_NOARGS, "forget every entry"},
    {nullptr, nullptr, 0, nullptr},
};
PySequenceMethods core_sequence = {
    core_len,  // sq_length
};

}  // namespace

PyTypeObject CallCoreType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool add_call_core(PyObject* module) {
  init_type(CallCoreType, KV_STR(TORCH_EXTENSION_NAME) ".CallCore", sizeof(CallCore),
            "The compiled per-call path of one op (see _runtime/csrc/key.cpp).", core_new, core_dealloc,
            core_traverse, core_clear_refs, offsetof(CallCore, vectorcall), PyVectorcall_Call);
  CallCoreType.tp_methods = core_methods;
  CallCoreType.tp_as_sequence = &core_sequence;
  return PyType_Ready(&CallCoreType) == 0 &&
         PyModule_AddObjectRef(module, "CallCore", reinterpret_cast<PyObject*>(&CallCoreType)) == 0;
}

}  // namespace kv_core
