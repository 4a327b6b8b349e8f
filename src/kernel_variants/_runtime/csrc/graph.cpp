// The graph kernel: the op's compiled-graph kernel in C++, calling the entry's call core.
//
// Registered by custom_ops as the CompositeExplicitAutograd kernel of `kernel_variants::<op>`
// (each overload that returns its outputs) where the core is built: a graph's call reaches the
// core from the dispatcher's stack with no Python frame on the way. A Python kernel there costs
// the frame, its globals and the entry's attribute, each a cache miss after a large kernel, on
// top of what a plain op's Python kernel costs; this kernel reads the entry's core and calls it
// as the Python kernel would, and hands anything else (no core bound to the entry, off, a miss)
// to that Python kernel's code, so both give the same results and errors (a variant's result
// that is not the op's outputs: both raise errors.result_error's TypeError).

#include "call_core.h"

// Only the graph kernel registers with the dispatcher: its headers stay out of the other files
// (each costs every file that includes it seconds of compile time).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

namespace kv_core {

namespace {

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
  // entry: the op's callcore.Entry (its `core` read per call); kernel: the Python kernel, called
  // where the entry holds no CallCore; miss: its Python path, called on the core's miss. Held
  // for the life of the process, as the registration is.
  // core_name: the interned "core" (an attribute read by a str made per call costs more).
  // bad(result): the exception for a result that is not the op's n_out tensors.
  GraphKernel(PyObject* entry, PyObject* kernel, PyObject* miss, PyObject* bad, PyObject* core_name, int n, int n_out)
      : entry_(Py_NewRef(entry)), kernel_(Py_NewRef(kernel)), miss_(Py_NewRef(miss)), bad_(Py_NewRef(bad)),
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
    THPObjectPtr core(PyObject_GetAttr(entry_, core_name_));
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

  PyObject* entry_;
  PyObject* kernel_;
  PyObject* miss_;
  PyObject* bad_;
  PyObject* core_name_;
  int n_;
  int n_out_;
};

}  // namespace

// graph_kernel(name, spec): registers GraphKernel as the CompositeExplicitAutograd kernel of
// `kernel_variants::<name>` (an overload as "op.overload"); spec a core_specs.GraphSpec, read by
// field name (entry, kernel, miss, bad, n, n_out). The registration is never undone: the Library
// is kept for the process, as the op's Python one is (undone at exit, it would run after the
// op's definition is gone).
PyObject* graph_kernel(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || !PyUnicode_Check(a[0])) {
    PyErr_SetString(PyExc_TypeError, "graph_kernel(name, spec): the op's name and one core_specs.GraphSpec");
    return nullptr;
  }
  Fields f(a[1]);
  PyObject *entry = f("entry"), *kernel = f("kernel"), *miss = f("miss"), *bad = f("bad"), *n_o = f("n"),
           *n_out_o = f("n_out");
  if (!f.ok()) return nullptr;
  const long n = PyLong_AsLong(n_o);
  const long n_out = PyLong_AsLong(n_out_o);
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
                               entry, kernel, miss, bad, core_name.get(), static_cast<int>(n), static_cast<int>(n_out))));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* g_capturing[static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)] = {};

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


}  // namespace kv_core
