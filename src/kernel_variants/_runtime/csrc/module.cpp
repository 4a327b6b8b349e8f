// The module kernel_variants' call core is imported as: its functions, and the two types.
#include "call_core.h"

namespace kv_core {
namespace {

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
     "graph_kernel(name, spec): the op's compiled-graph kernel in C++ (spec a core_specs.GraphSpec)"},
    {"unaliased", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unaliased)), METH_FASTCALL,
     "unaliased(result, *args) -> result, each output sharing storage with a tensor argument cloned"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT};

}  // namespace
}  // namespace kv_core

PyMODINIT_FUNC KV_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  using namespace kv_core;
  module_def.m_name = KV_STR(TORCH_EXTENSION_NAME);
  module_def.m_doc = "kernel_variants' compiled call core";
  module_def.m_size = -1;
  module_def.m_methods = module_methods;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (!kv_core::add_call_core(m) || !kv_core::add_bound_core(m)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
