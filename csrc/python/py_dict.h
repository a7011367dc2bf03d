#pragma once

// Dictionary access that stays safe without the GIL (Note [Free-threaded Python]).
#include "bindings.h"

#include <utility>
#include <vector>

namespace torchdp::python {

// Note [Free-threaded Python]
// torchdp._C declares that it runs without the GIL (py::mod_gil_not_used). On a free-threaded
// build another thread may change a dict while the bindings read it (a module's _modules,
// _parameters, _buffers or __dict__), so the bindings
// - take strong references from dict lookups (PyDict_GetItemRef), never borrowed ones that a
//   concurrent deletion would free;
// - iterate such dicts through for_each_item, which copies the items under the dict's critical
//   section and calls back outside it (the callback may run Python code, which would suspend it);
// - guard their own shared state with a lock that is never held while Python code runs (a
//   thread that waits on such a lock while attached would stall a stop-the-world pause);
// - keep no replicas between forwards there (Note [Kept replicas]).
// On a GIL build these helpers compile to the plain calls that the GIL made safe.

/// dict[key] as a new reference, or an empty object when absent; throws on a lookup error.
inline pybind11::object dict_get_ref(PyObject* dict, PyObject* key) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* value = nullptr;
  if (PyDict_GetItemRef(dict, key, &value) < 0) {
    throw pybind11::error_already_set();
  }
  return pybind11::reinterpret_steal<pybind11::object>(value);
#else
  PyObject* value = PyDict_GetItemWithError(dict, key); // borrowed: safe under the GIL
  if (value == nullptr && PyErr_Occurred()) {
    throw pybind11::error_already_set();
  }
  return pybind11::reinterpret_borrow<pybind11::object>(value);
#endif
}

/// dict[key] for a C string key, as dict_get_ref.
inline pybind11::object dict_get_ref(PyObject* dict, const char* key) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* value = nullptr;
  if (PyDict_GetItemStringRef(dict, key, &value) < 0) {
    throw pybind11::error_already_set();
  }
  return pybind11::reinterpret_steal<pybind11::object>(value);
#else
  const pybind11::str name(key);
  return dict_get_ref(dict, name.ptr());
#endif
}

/// Calls f(key, value) with each item of the dict `dict`, in order. Without the GIL the items
/// are copied (strong references) under the dict's critical section first, so f sees a snapshot
/// and may run Python code or throw; with the GIL f sees the live items (borrowed).
template <typename F>
void for_each_item(PyObject* dict, F&& f) {
#ifdef Py_GIL_DISABLED
  std::vector<std::pair<pybind11::object, pybind11::object>> items;
  items.reserve(static_cast<size_t>(PyDict_GET_SIZE(dict)) + 1);
  Py_BEGIN_CRITICAL_SECTION(dict);
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    items.emplace_back(pybind11::reinterpret_borrow<pybind11::object>(key),
                       pybind11::reinterpret_borrow<pybind11::object>(value));
  }
  Py_END_CRITICAL_SECTION();
  for (const auto& [k, v] : items) {
    f(k.ptr(), v.ptr());
  }
#else
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    f(key, value);
  }
#endif
}

} // namespace torchdp::python
