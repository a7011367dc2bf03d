// What a replica owns beyond its tensors: nn.Module's hook containers and the callables of its
// instance __dict__ that are bound to a module of the network.
#include "replication.h"

#include <c10/util/irange.h>

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchdp::python::replication {

// Note [Replicas own their instance state]
// _replicate_for_data_parallel copies a module's __dict__, so a replica shares every value in it
// with the original. Two kinds of values then act on the original:
// - nn.Module's own hook containers (_forward_hooks, ..., _non_persistent_buffers_set). A hook or
//   buffer that a replica's forward registers would land in the user's module, once per replica
//   and step (transformers installs its output-capturing hooks at the first forward that asks,
//   and marks the object it ran on: each replica is a new object). Each replica gets its own
//   copies, refreshed from the original at every replicate (kept with a kept replica).
// - Callables bound to a module of the network: a bound method (model.forward =
//   types.MethodType(f, model)), a functools.partial over the module (accelerate's hooked forward,
//   with its __wrapped__ and _old_forward), a function whose closure or defaults hold it. Called
//   in a replica, they would run the original's parameters. The rule, one for all of them: a
//   value in a replica's __dict__ or hook containers that refers to a module of the network -- the
//   module itself, a bound method of it, or a partial, method or function holding such a value --
//   is remade over that module's replica on the replica's device. Other values stay shared, as in
//   PyTorch. A callable object of another kind that holds such a module cannot be remade: the
//   replicate fails naming the attribute and what to store instead.

namespace {

// Deep enough for a partial of a method of a wrapped function; deeper values are left shared.
constexpr int kMaxDepth = 8;

// Keys of a module's __dict__ that replication itself writes, or that have their own rule.
bool skipped_key(PyObject* key) {
  const auto& r = refs();
  return key == r.key_parameters || key == r.key_buffers || key == r.key_modules ||
         key == r.key_former || key == r.key_is_replica || key == r.key_compiled_call;
}

bool is_state_key(PyObject* key) {
  for (const auto& k : refs().state_keys) {
    if (k.ptr() == key) {
      return true;
    }
  }
  return false;
}

std::string qualname(py::handle obj) {
  return py::str(py::type::of(obj).attr("__qualname__"));
}

// Rebinds the values of one replica (device j) to the replicas of device j.
class Rebinder {
 public:
  Rebinder(const Network& net, const std::vector<py::list>& copies, size_t j, const ModuleEntry& e)
      : net_(net), copies_(copies), j_(j), owner_(e) {}

  // The value over the replicas, or an empty object when `value` refers to no module of the
  // network. `where` is the attribute's name, for errors.
  py::object rebind(py::handle value, py::handle where, int depth = 0) {
    PyObject* v = value.ptr();
    if (depth > kMaxDepth) {
      return py::object();
    }
    const auto in_net = net_.index.find(v);
    if (in_net != net_.index.end()) {
      return py::reinterpret_borrow<py::object>(copies_[j_][in_net->second]);
    }
    const bool method = PyMethod_Check(v);
    const bool function = !method && PyFunction_Check(v);
    int partial = 0;
    if (!method && !function && PyCallable_Check(v) && !PyType_Check(v)) {
      partial = PyObject_IsInstance(v, refs().partial_type.ptr());
      if (partial < 0) {
        throw py::error_already_set();
      }
      if (!partial) {
        refuse_if_bound(value, where);
      }
    }
    if (!method && !function && !partial) {
      return py::object(); // tensors, numbers, containers, other objects: shared, as in PyTorch
    }
    const auto seen = done_.find(v);
    if (seen != done_.end()) {
      return seen->second; // also a value being remade: a cycle stays as it is
    }
    done_.emplace(v, py::object());
    py::object out = method     ? this->method(value, where, depth)
                     : function ? this->function(value, where, depth)
                                : partial_of(value, where, depth);
    done_[v] = out;
    return out;
  }

 private:
  py::object method(py::handle m, py::handle where, int depth) {
    py::handle self = PyMethod_GET_SELF(m.ptr());
    py::handle func = PyMethod_GET_FUNCTION(m.ptr());
    py::object new_self = rebind(self, where, depth + 1);
    py::object new_func = rebind(func, where, depth + 1);
    if (!new_self && !new_func) {
      return py::object();
    }
    PyObject* bound_func = new_func ? new_func.ptr() : func.ptr();
    PyObject* bound_self = new_self ? new_self.ptr() : self.ptr();
    return steal_or_throw(PyMethod_New(bound_func, bound_self));
  }

  // Each element of a tuple rebound; empty when none changes.
  py::object tuple_of(py::handle items, py::handle where, int depth) {
    if (!items || !PyTuple_Check(items.ptr())) {
      return py::object();
    }
    const auto n = PyTuple_GET_SIZE(items.ptr());
    std::vector<py::object> changed(static_cast<size_t>(n));
    bool any = false;
    for (const auto k : c10::irange(n)) {
      changed[k] = rebind(PyTuple_GET_ITEM(items.ptr(), k), where, depth + 1);
      any = any || static_cast<bool>(changed[k]);
    }
    if (!any) {
      return py::object();
    }
    py::tuple out(n);
    for (const auto k : c10::irange(n)) {
      out[k] = changed[k] ? changed[k]
                          : py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(items.ptr(), k));
    }
    return std::move(out);
  }

  // A copy of a dict with its values rebound; empty when none changes.
  py::object dict_of(py::handle dict, py::handle where, int depth) {
    if (!dict || !PyDict_Check(dict.ptr()) || PyDict_Size(dict.ptr()) == 0) {
      return py::object();
    }
    py::object out;
    PyObject *key = nullptr, *value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(dict.ptr(), &pos, &key, &value)) {
      py::object changed = rebind(value, where, depth + 1);
      if (!changed) {
        continue;
      }
      if (!out) {
        out = steal_or_throw(PyDict_Copy(dict.ptr()));
      }
      dict_set(out.ptr(), key, changed.ptr());
    }
    return out;
  }

  // functools.partial (or a subclass): rebuilt through its own pickling state.
  py::object partial_of(py::handle p, py::handle where, int depth) {
    py::tuple reduced = p.attr("__reduce__")();
    py::tuple state = reduced[2];
    if (state.size() != 4) {
      return py::object();
    }
    py::object func = rebind(state[0], where, depth);
    py::object args = tuple_of(state[1], where, depth);
    py::object keywords = dict_of(state[2], where, depth);
    py::object attributes = dict_of(state[3], where, depth);
    if (!func && !args && !keywords && !attributes) {
      return py::object();
    }
    py::object new_func = func ? func : py::object(state[0]);
    py::object remade = reduced[0](new_func);
    remade.attr("__setstate__")(py::make_tuple(new_func, args ? args : py::object(state[1]),
                                               keywords ? keywords : py::object(state[2]),
                                               attributes ? attributes : py::object(state[3])));
    return remade;
  }

  // A function whose closure cells, defaults or attributes (__wrapped__) hold the network's
  // modules: the same code over new cells for those values (the other cells stay shared).
  py::object function(py::handle f, py::handle where, int depth) {
    PyObject* fn = f.ptr();
    PyObject* closure = PyFunction_GET_CLOSURE(fn);
    py::object cells;
    if (closure != nullptr) {
      const auto n = PyTuple_GET_SIZE(closure);
      for (const auto k : c10::irange(n)) {
        PyObject* cell = PyTuple_GET_ITEM(closure, k);
        PyObject* content = PyCell_GET(cell);
        py::object changed = content ? rebind(content, where, depth + 1) : py::object();
        if (!changed) {
          continue;
        }
        if (!cells) {
          // A new tuple (a full slice would be the closure itself), filled in place below.
          cells = steal_or_throw(PyTuple_New(n));
          for (const auto m : c10::irange(n)) {
            PyObject* same = PyTuple_GET_ITEM(closure, m);
            Py_INCREF(same);
            PyTuple_SET_ITEM(cells.ptr(), m, same);
          }
        }
        py::object new_cell = steal_or_throw(PyCell_New(changed.ptr()));
        PyObject* old = PyTuple_GET_ITEM(cells.ptr(), k);
        PyTuple_SET_ITEM(cells.ptr(), k, new_cell.release().ptr());
        Py_DECREF(old);
      }
    }
    py::object defaults = tuple_of(PyFunction_GET_DEFAULTS(fn), where, depth);
    py::object kwdefaults = dict_of(PyFunction_GET_KW_DEFAULTS(fn), where, depth);
    py::object attributes = dict_of(py::getattr(f, "__dict__", py::none()), where, depth);
    if (!cells && !defaults && !kwdefaults && !attributes) {
      return py::object();
    }
    PyObject* old_defaults = PyFunction_GET_DEFAULTS(fn);
    py::object remade = refs().function_type(
        py::handle(PyFunction_GET_CODE(fn)), py::handle(PyFunction_GET_GLOBALS(fn)),
        f.attr("__name__"),
        defaults ? defaults
                 : py::reinterpret_borrow<py::object>(old_defaults ? old_defaults : Py_None),
        cells ? cells : py::reinterpret_borrow<py::object>(closure ? closure : Py_None));
    for (const char* name : {"__qualname__", "__module__", "__doc__"}) {
      py::setattr(remade, name, f.attr(name));
    }
    PyObject* kw = PyFunction_GET_KW_DEFAULTS(fn);
    if (kwdefaults || kw != nullptr) {
      py::setattr(remade, "__kwdefaults__", kwdefaults ? kwdefaults : py::handle(kw));
    }
    py::object own_dict = attributes ? attributes : py::getattr(f, "__dict__", py::none());
    if (!own_dict.is_none() && PyDict_Size(own_dict.ptr()) > 0) {
      py::setattr(remade, "__dict__", attributes ? attributes : py::dict(own_dict));
    }
    return remade;
  }

  // A callable object of another kind that holds a module of the network (or a method of one)
  // in its __dict__ cannot be remade: each replica would call into the original module.
  void refuse_if_bound(py::handle value, py::handle where) {
    const int module = PyObject_IsInstance(value.ptr(), refs().module_type.ptr());
    if (module != 0) {
      if (module < 0) {
        throw py::error_already_set();
      }
      return; // a module outside the network: shared, as in PyTorch
    }
    PyObject* dict = PyObject_GenericGetDict(value.ptr(), nullptr);
    if (dict == nullptr) {
      PyErr_Clear(); // no instance __dict__: nothing to look into
      return;
    }
    py::object attributes = py::reinterpret_steal<py::object>(dict);
    if (!PyDict_Check(dict)) {
      return;
    }
    PyObject *key = nullptr, *held = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(dict, &pos, &key, &held)) {
      PyObject* target = PyMethod_Check(held) ? PyMethod_GET_SELF(held) : held;
      const auto it = net_.index.find(target);
      if (it == net_.index.end()) {
        continue;
      }
      const auto path = path_in(net_.modules.front().module, net_.modules[it->second].module);
      const auto owner = path_in(net_.modules.front().module, owner_.module);
      TORCH_CHECK_TYPE(
          false, kApi, ": attribute '", std::string(py::str(where)), "' of module '",
          owner.empty() ? "<root>" : owner, "' (class ", qualname(owner_.module), ") is a ",
          qualname(value), " object whose attribute '", std::string(py::str(key)),
          "' holds module '", path.empty() ? "<root>" : path,
          "' of the replicated network, so every replica would run the original module's "
          "parameters. torchdp rebinds bound methods, functools.partial objects and functions "
          "holding the network's modules to each replica: store one of those (e.g. "
          "types.MethodType(fn, module) or functools.partial(fn, module)), or pass the module to "
          "the callable when forward calls it");
    }
  }

  const Network& net_;
  const std::vector<py::list>& copies_;
  size_t j_;
  const ModuleEntry& owner_;
  std::unordered_map<PyObject*, py::object> done_;
};

// The replica's copy of one of nn.Module's hook containers: `kept` (the last call's copy) refilled
// when given, else a new one; its values rebound when it has any.
py::object own_container(py::handle original, py::object kept, Rebinder& rebinder,
                         py::handle where) {
  PyObject* o = original.ptr();
  const bool is_set = PyAnySet_Check(o);
  const bool empty = PyObject_Size(o) == 0;
  if (!kept || kept.is_none() || Py_TYPE(kept.ptr()) != Py_TYPE(o)) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(o));
    // OrderedDict(original) keeps the order; a new empty one is the common case.
    kept = steal_or_throw(is_set  ? PySet_New(o)
                          : empty ? PyObject_CallNoArgs(type)
                                  : PyObject_CallOneArg(type, o));
    if (empty && PyObject_GC_IsTracked(kept.ptr())) {
      // As CPython does for an empty dict: nothing in it can be part of a cycle yet, and the
      // collector need not see the thousands made per call (a dict is tracked again when an
      // object that may be is stored in it; the set holds buffer names).
      PyObject_GC_UnTrack(kept.ptr());
    }
  } else if (!empty || PyObject_Size(kept.ptr()) != 0) {
    kept.attr("clear")();
    kept.attr("update")(original);
  }
  if (!is_set && !empty) {
    py::list items(kept.attr("items")());
    for (auto item : items) {
      auto pair = item.cast<py::tuple>();
      py::object changed = rebinder.rebind(pair[1], where);
      if (changed) {
        kept[pair[0]] = changed;
      }
    }
  }
  return kept;
}

} // namespace

std::vector<py::object> module_state_keys(py::handle module_type) {
  // The containers nn.Module.__init__ gives every instance, other than the three registries.
  py::object probe = module_type();
  std::vector<py::object> keys;
  for (auto item : instance_dict(probe).cast<py::dict>()) {
    const std::string name = py::str(item.first);
    if (name == "_parameters" || name == "_buffers" || name == "_modules") {
      continue;
    }
    if (PyDict_Check(item.second.ptr()) || PyAnySet_Check(item.second.ptr())) {
      keys.push_back(py::reinterpret_steal<py::object>(interned(name.c_str())));
    }
  }
  return keys;
}

void own_instance_state(const ModuleEntry& e, size_t j, const std::vector<py::list>& copies,
                        const Network& net, py::handle replica_dict, py::handle kept) {
  if (e.type->script || e.type->optimized || !PyDict_Check(replica_dict.ptr())) {
    return; // their own rules (TorchScript; Note [Replicating compiled modules])
  }
  const auto& r = refs();
  Rebinder rebinder(net, copies, j, e);
  const bool keeps = kept && PyList_Check(kept.ptr()) &&
                     PyList_GET_SIZE(kept.ptr()) == static_cast<Py_ssize_t>(r.state_keys.size());
  for (const auto k : c10::irange(r.state_keys.size())) {
    PyObject* key = r.state_keys[k].ptr();
    PyObject* original = PyDict_GetItemWithError(replica_dict.ptr(), key); // borrowed
    if (original == nullptr) {
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      continue;
    }
    if (!PyDict_Check(original) && !PyAnySet_Check(original)) {
      continue;
    }
    py::object previous =
        keeps ? py::reinterpret_borrow<py::object>(PyList_GET_ITEM(kept.ptr(), k)) : py::object();
    py::object own = own_container(original, previous, rebinder, r.state_keys[k]);
    dict_set(replica_dict.ptr(), key, own.ptr());
    if (keeps && !own.is(previous)) {
      PyList_SetItem(kept.ptr(), k, own.inc_ref().ptr()); // steals the new reference
    }
  }
  // The other values: changes collected first, the dict is not resized while walked.
  std::vector<std::pair<py::object, py::object>> changes;
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(replica_dict.ptr(), &pos, &key, &value)) {
    if (skipped_key(key) || is_state_key(key) || !PyUnicode_Check(key)) {
      continue;
    }
    py::object changed = rebinder.rebind(value, key);
    if (changed) {
      changes.emplace_back(py::reinterpret_borrow<py::object>(key), std::move(changed));
    }
  }
  for (const auto& [k, v] : changes) {
    dict_set(replica_dict.ptr(), k.ptr(), v.ptr());
  }
}

} // namespace torchdp::python::replication
