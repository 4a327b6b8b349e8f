// Outputs that alias an input, cloned: a torch.library op's output may not alias an input.
#include "call_core.h"

namespace kv_core {

namespace {

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
}  // namespace

// The module functions below are called from Python code of the package, each wrapped in
// HANDLE_TH_ERRORS: any C++ exception (a c10::Error, an allocation failure, a Python error raised
// by a tensor subclass's dispatch) becomes a Python exception, never an abort.

// unaliased(result, *args): `result` (a tensor, or a tuple or list of tensors), each output that
// shares storage with a tensor among `args` replaced by a clone. A torch.library op's output may
// not alias an input; a compiled graph's kernel runs this after the dispatched call (no built-in
// variant's output aliases an input, a plugin's might).
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


}  // namespace kv_core
