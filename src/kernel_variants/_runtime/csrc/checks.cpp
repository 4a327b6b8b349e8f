// The index value checks and the write guard a served call runs (the conditions of
// _runtime/values.py and _runtime/guards.py, which raise), and their data as the cores read it.
#include "call_core.h"

namespace kv_core {

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


namespace {

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

}  // namespace

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

namespace {

inline int64_t span_bytes(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto sizes = impl->sizes();
  auto strides = impl->strides();
  int64_t last = 0;
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  return (last + 1) * static_cast<int64_t>(impl->itemsize());
}

}  // namespace

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

// Whether the device rule counted something on this device (its gate is in counters): the
// call then goes to the Python path, so that this is reported before a host check passes.
bool gate_counted(PyObject* counters, PyObject* gate) {
  if (gate == nullptr || PyDict_GET_SIZE(counters) == 0) return false;
  const int has = PyDict_Contains(counters, gate);
  if (has < 0) PyErr_Clear();
  return has != 0;
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

THPObjectPtr field(PyObject* o, const char* name) {
  return THPObjectPtr(PyObject_GetAttrString(o, name));
}

namespace {

// o.name as an int64; false with an error set (AttributeError, or a ValueError naming `who`).
bool int_field(PyObject* o, const char* name, int64_t* v, bool* fits, const char* who) {
  THPObjectPtr f = field(o, name);
  if (!f) return false;
  if (!PyLong_Check(f.get())) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be an int", who, name);
    return false;
  }
  *v = as_int64(f.get(), fits);
  return true;
}

}  // namespace

// The index value checks (values.py's SlotIds, Offsets, Bounded: each its `kind` and fields), or
// None. `who`: the caller that raises a malformed one's error (learn, BoundCore).
bool parse_checks(int n, const std::vector<int8_t>& kind, PyObject* seq, std::vector<Check>& out, const char* who) {
  if (seq == Py_None) return true;
  if (!PyTuple_Check(seq)) {
    PyErr_Format(PyExc_TypeError, "%s: checks must be a tuple of value checks or None", who);
    return false;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(seq); ++k) {
    PyObject* item = PyTuple_GET_ITEM(seq, k);
    Check c{};
    int64_t kind_v, index;
    bool ok_kind, ok_index, ok_a = true, ok_b = true;
    if (!int_field(item, "kind", &kind_v, &ok_kind, who) || !int_field(item, "index", &index, &ok_index, who))
      return false;
    c.kind = static_cast<int>(kind_v);
    c.index = static_cast<int>(index);
    bool read = true;
    switch (c.kind) {
      case kSlots:
        read = int_field(item, "n_slots", &c.a, &ok_a, who) && int_field(item, "pad", &c.b, &ok_b, who);
        c.has_pad = ok_b;  // a pad id no int64 equals: never a pad
        ok_b = true;
        break;
      case kOffsets:
        read = int_field(item, "total", &c.a, &ok_a, who);
        break;
      case kBounded:
        read = int_field(item, "lo", &c.a, &ok_a, who) && int_field(item, "hi", &c.b, &ok_b, who);
        c.has_pad = true;
        break;
      default:
        ok_kind = false;
    }
    if (!read) return false;
    if (!ok_kind || !ok_index || !ok_a || !ok_b || c.index < 0 || c.index >= n || kind[c.index] == kValue) {
      PyErr_Format(PyExc_ValueError, "%s: a check names no tensor parameter or has a bound out of int64", who);
      return false;
    }
    out.push_back(c);
  }
  return true;
}

// The write guard's data (guards.py's Written: index, span, near), a tuple of them.
bool parse_guards(int n, const std::vector<int8_t>& kind, PyObject* seq, std::vector<Guard>& out) {
  if (!PyTuple_Check(seq)) {
    PyErr_SetString(PyExc_TypeError, "guards must be a tuple of guards.Written");
    return false;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(seq); ++k) {
    PyObject* item = PyTuple_GET_ITEM(seq, k);
    Guard g;
    int64_t index;
    bool ok_m, ok_s;
    if (!int_field(item, "index", &index, &ok_m, "guard") || !int_field(item, "span", &g.span, &ok_s, "guard"))
      return false;
    g.mutated = static_cast<int>(index);
    THPObjectPtr near = field(item, "near");
    if (!near) return false;
    if (!PyTuple_Check(near.get())) {
      PyErr_SetString(PyExc_TypeError, "a guard's near must be a tuple of parameter indices");
      return false;
    }
    bool bad = !ok_m || !ok_s || g.mutated < 0 || g.mutated >= n || kind[g.mutated] == kValue;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(near.get()) && !bad; ++j) {
      bool ok;
      int i = static_cast<int>(as_int64(PyTuple_GET_ITEM(near.get(), j), &ok));
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

// Per parameter, the value the variant gets in place of the call's (`keep`: the call's own): a
// tuple of n. Into subs (n entries, owned or nullptr).
bool parse_subs(int n, PyObject* seq, PyObject* keep, std::vector<PyObject*>& subs, const char* who) {
  if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != n) {
    PyErr_Format(PyExc_ValueError, "%s: subs must hold one value per parameter", who);
    return false;
  }
  subs.assign(n, nullptr);
  for (int i = 0; i < n; ++i) {
    PyObject* v = PyTuple_GET_ITEM(seq, i);
    if (v != keep) subs[i] = Py_NewRef(v);
  }
  return true;
}

}  // namespace kv_core
