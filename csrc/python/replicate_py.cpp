// Replication of *Python* nn.Modules, done in C++ with the same tensor layers as the C++ core
// (see csrc/python/API.md and DESIGN.md, "Replicating Python modules").
#include "bindings.h"

#include <torchdp/autograd.h>
#include <torchdp/comm.h>
#include <torchdp/devices.h>
#include <torchdp/profiling.h>
#include <torchdp/replicate.h>

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torchdp::python {
namespace {

constexpr const char* kApi = "torchdp.replicate";

// Note [Two ways to build a replica]
// PyTorch builds every replica with module._replicate_for_data_parallel() and wires it with
// setattr(), both Python code that costs microseconds per call: most of torch's replicate time.
// For a module whose class keeps nn.Module's behaviour (no __new__, __setattr__ or
// _replicate_for_data_parallel of its own, and plain dicts for _parameters / _buffers / _modules)
// those calls have a known outcome, which torchdp produces directly with dictionary operations:
//   replica = object.__new__(type(m)); replica.__dict__ = m.__dict__.copy() with a fresh
//   _parameters = {}, copies of _buffers and _modules, _is_replica = True and
//   _former_parameters = OrderedDict(); then children -> _modules[key], parameter copies ->
//   __dict__[key] (an original Parameter, under detach on devices[0], -> _parameters[key], as
//   register_parameter does) and _former_parameters[key], buffer copies -> _buffers[key].
// The result is the replica PyTorch's code builds, attribute for attribute. Any other module (a
// class with its own __setattr__, RNNs, lazy modules, ScriptModules, ...) is built the PyTorch way,
// and so is every module while global module/parameter/buffer registration hooks are installed
// (setattr would call them).

PyObject* interned(const char* text) {
  PyObject* s = PyUnicode_InternFromString(text);
  if (s == nullptr) {
    throw py::error_already_set();
  }
  return s;
}

// Python objects used on every call, looked up once. Never destroyed: they live as long as the
// interpreter (destroying them at exit, after Python is gone, would crash).
struct PythonRefs {
  PyObject* key_parameters = interned("_parameters");
  PyObject* key_buffers = interned("_buffers");
  PyObject* key_modules = interned("_modules");
  PyObject* key_former = interned("_former_parameters");
  PyObject* key_is_replica = interned("_is_replica");
  PyObject* key_dict = interned("__dict__");
  PyObject* key_compiled_call = interned("_compiled_call_impl");
  PyObject* key_clear = interned("clear");
  py::object sys_modules = py::module_::import("sys").attr("modules");
  py::object empty_tuple = py::reinterpret_steal<py::object>(PyTuple_New(0));
  py::module_ module_module = py::module_::import("torch.nn.modules.module");
  py::object module_type = module_module.attr("Module");
  py::object module_setattr = module_type.attr("__setattr__");
  py::object module_replicate = module_type.attr("_replicate_for_data_parallel");
  py::object parameter_type = py::module_::import("torch.nn").attr("Parameter");
  py::object script_module_type = py::module_::import("torch.jit").attr("ScriptModule");
  py::object jit_state = py::module_::import("torch.jit._state");
  py::object ordered_dict = py::module_::import("collections").attr("OrderedDict");
  py::object empty_like = py::module_::import("torch").attr("empty_like");
};

const PythonRefs& refs() {
  static PythonRefs* r = new PythonRefs();
  return *r;
}

py::object steal_or_throw(PyObject* o) {
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(o);
}

void dict_set(PyObject* dict, PyObject* key, PyObject* value) {
  if (PyDict_SetItem(dict, key, value) < 0) {
    throw py::error_already_set();
  }
}

// The instance __dict__ of a module (never through a __getattr__ override).
py::object instance_dict(py::handle obj) {
  return steal_or_throw(PyObject_GenericGetDict(obj.ptr(), nullptr));
}

// dict[key] when it is an exact dict, else an empty object.
py::object exact_dict_entry(py::handle dict, PyObject* key) {
  PyObject* value = PyDict_GetItemWithError(dict.ptr(), key); // borrowed
  if (value == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return py::object();
  }
  return PyDict_CheckExact(value) ? py::reinterpret_borrow<py::object>(value) : py::object();
}

bool same_attribute(py::handle type, const char* name, py::handle expected) {
  return py::getattr(type, name, py::none()).is(expected);
}

struct TypeInfo {
  bool plain = false;     // built with dictionary operations (Note [Two ways to build a replica])
  bool script = false;    // a torch.jit.ScriptModule
  bool optimized = false; // torch.compile's module wrapper (Note [Replicating compiled modules])
  bool walkable = false;  // named_modules() / modules() are nn.Module's
  bool overrides_setattr = false;
  // Instances have slots outside their __dict__ (a class with __slots__): what a forward stores
  // there would survive in a kept replica (Note [Kept replicas]).
  bool slots = false;
};

// Per-call cache of what a module class allows (classes can be patched between calls).
class TypeTable {
 public:
  const TypeInfo& of(py::handle obj) {
    PyTypeObject* type = Py_TYPE(obj.ptr());
    auto it = table_.find(type);
    if (it != table_.end()) {
      return it->second;
    }
    const auto& r = refs();
    py::handle t(reinterpret_cast<PyObject*>(type));
    TypeInfo info;
    const int script = PyObject_IsSubclass(t.ptr(), r.script_module_type.ptr());
    if (script < 0) {
      throw py::error_already_set();
    }
    info.script = script == 1;
    info.overrides_setattr = !same_attribute(t, "__setattr__", r.module_setattr);
    info.walkable = same_attribute(t, "named_modules", r.module_type.attr("named_modules")) &&
                    same_attribute(t, "modules", r.module_type.attr("modules"));
    const py::object optimized_type = optimized_module_type();
    if (optimized_type) {
      const int optimized = PyObject_IsSubclass(t.ptr(), optimized_type.ptr());
      if (optimized < 0) {
        throw py::error_already_set();
      }
      info.optimized = optimized == 1;
    }
    // OptimizedModule's __setattr__ forwards other objects' attributes to the wrapped module, so
    // PyTorch's way would write into the original; dictionary operations never call it.
    const int slots = PyObject_HasAttrString(t.ptr(), "__slots__");
    info.slots = slots == 1;
    info.plain = !info.script && (!info.overrides_setattr || info.optimized) &&
                 type->tp_new == PyBaseObject_Type.tp_new &&
                 same_attribute(t, "_replicate_for_data_parallel", r.module_replicate);
    return table_.emplace(type, info).first->second;
  }

 private:
  // torch._dynamo.eval_frame.OptimizedModule when torch.compile was ever used (else empty: no
  // module can be one), looked up once per call.
  py::object optimized_module_type() {
    if (!optimized_looked_up_) {
      optimized_looked_up_ = true;
      PyObject* eval_frame =
          PyDict_GetItemString(refs().sys_modules.ptr(), "torch._dynamo.eval_frame"); // borrowed
      if (eval_frame != nullptr) {
        optimized_type_ = py::getattr(eval_frame, "OptimizedModule", py::none());
        if (optimized_type_.is_none()) {
          optimized_type_ = py::object();
        }
      }
    }
    return optimized_type_;
  }

  std::unordered_map<PyTypeObject*, TypeInfo> table_;
  bool optimized_looked_up_ = false;
  py::object optimized_type_;
};

// One module of the network, with its own dictionaries (exact dicts, or empty objects when the
// module keeps them some other way).
struct ModuleEntry {
  py::object module;
  py::object dict;
  py::object params;
  py::object buffers;
  py::object children;
  const TypeInfo* type = nullptr;
  bool plain = false; // type->plain and all three dicts are exact dicts
};

struct Network {
  std::vector<ModuleEntry> modules; // network.modules() order
  std::unordered_map<PyObject*, size_t> index;
  bool dicts_ok = true; // every module holds exact dicts (the C++ walks are exact)
};

ModuleEntry make_entry(py::handle module, TypeTable& types) {
  ModuleEntry e;
  e.module = py::reinterpret_borrow<py::object>(module);
  e.type = &types.of(module);
  e.dict = instance_dict(module);
  if (PyDict_CheckExact(e.dict.ptr())) {
    e.params = exact_dict_entry(e.dict, refs().key_parameters);
    e.buffers = exact_dict_entry(e.dict, refs().key_buffers);
    e.children = exact_dict_entry(e.dict, refs().key_modules);
  }
  e.plain = e.type->plain && e.params && e.buffers && e.children;
  return e;
}

// network.modules(): pre-order, each module once, None children skipped. Walked in C++ over the
// _modules dicts when every class keeps nn.Module's named_modules; otherwise asked from Python.
Network walk_network(py::handle network, TypeTable& types) {
  Network net;
  bool exact = true;
  std::vector<py::handle> stack{network};
  while (exact && !stack.empty()) {
    py::handle m = stack.back();
    stack.pop_back();
    if (net.index.count(m.ptr())) {
      continue;
    }
    auto entry = make_entry(m, types);
    if (!entry.type->walkable || !entry.children) {
      exact = false;
      break;
    }
    net.index.emplace(m.ptr(), net.modules.size());
    // Children pushed in reverse so that they pop in dict order.
    std::vector<py::handle> children;
    PyObject *key = nullptr, *value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(entry.children.ptr(), &pos, &key, &value)) {
      if (value != Py_None) {
        children.emplace_back(value);
      }
    }
    net.modules.push_back(std::move(entry));
    stack.insert(stack.end(), children.rbegin(), children.rend());
  }
  if (exact) {
    for (const auto& e : net.modules) {
      net.dicts_ok = net.dicts_ok && e.params && e.buffers;
    }
    return net;
  }
  net = Network{};
  net.dicts_ok = false;
  for (auto m : network.attr("modules")()) {
    net.index.emplace(m.ptr(), net.modules.size());
    net.modules.push_back(make_entry(m, types));
  }
  return net;
}

// The rule of torch.nn.parallel.replicate._replicatable_module: with TorchScript enabled, a
// ScriptModule may only have ScriptModules below it.
void check_replicatable(const Network& net, TypeTable& types) {
  bool any_script = false;
  for (const auto& e : net.modules) {
    any_script = any_script || e.type->script;
  }
  if (!any_script || !py::bool_(refs().jit_state.attr("_enabled"))) {
    return;
  }
  for (const auto& e : net.modules) {
    if (!e.type->script) {
      continue;
    }
    for (auto below : e.module.attr("modules")()) {
      TORCH_CHECK(types.of(below).script,
                  "Cannot replicate network where python modules are children of ScriptModule");
    }
  }
}

// Note [Replica assignment and custom __setattr__]
// PyTorch wires each replica with setattr(replica, key, copy), children first, then parameters,
// then buffers, so that cooperative __setattr__ overrides (RNNBase keeps _flat_weights in sync) see
// every assignment. A module whose __setattr__ swallows or redirects the assignment (cplxmodule's
// masked layers copy into the existing `mask`) leaves the replica with the original's tensor, on
// the original's device, and may even write the copy into the original. torchdp therefore
//   * for classes that override __setattr__, first puts a fresh empty tensor of the copy's device
//   in
//     the replica's _buffers, so whatever the override reads or writes is the replica's own tensor
//     (the original is never written), then calls setattr as PyTorch does;
//   * checks that the replica now holds exactly the broadcast copy; if not, puts the copy in place
//     directly (the device-check fallback) and warns once per class and attribute.

void warn_once(const std::string& cls, const std::string& attr, const char* kind) {
  static std::mutex mutex;
  static std::set<std::pair<std::string, std::string>> warned;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!warned.emplace(cls, attr).second) {
      return;
    }
  }
  const std::string message =
      std::string(kApi) + ": " + cls + ".__setattr__ did not store the replica's " + kind + " '" +
      attr +
      "' (it kept another tensor, typically the original's, on the original's device); torchdp "
      "put the replica's own copy in place directly. This warning is shown once per class and "
      "attribute. To silence it, let __setattr__ register the assigned tensor, or keep such "
      "state out of registered buffers and re-sync it with torchdp.register_post_replicate_hook.";
  if (PyErr_WarnEx(PyExc_UserWarning, message.c_str(), 1) != 0) {
    throw py::error_already_set();
  }
}

// The dictionaries of a replica built by new_plain_replica.
struct ReplicaDicts {
  py::object dict, params, buffers, modules, former;
};

// The dictionaries of a plain replica as _replicate_for_data_parallel leaves them, plus
// _former_parameters (Note [Two ways to build a replica]), in the (empty) dictionaries `d`.
void fill_plain_dicts(const ModuleEntry& e, const ReplicaDicts& d) {
  const auto& r = refs();
  if (PyDict_Update(d.dict.ptr(), e.dict.ptr()) < 0 ||
      PyDict_Update(d.buffers.ptr(), e.buffers.ptr()) < 0 ||
      PyDict_Update(d.modules.ptr(), e.children.ptr()) < 0) {
    throw py::error_already_set();
  }
  dict_set(d.dict.ptr(), r.key_parameters, d.params.ptr());
  dict_set(d.dict.ptr(), r.key_buffers, d.buffers.ptr());
  dict_set(d.dict.ptr(), r.key_modules, d.modules.ptr());
  dict_set(d.dict.ptr(), r.key_is_replica, Py_True);
  dict_set(d.dict.ptr(), r.key_former, d.former.ptr());
}

// object.__new__(type(m)) with m's __dict__ copied as _replicate_for_data_parallel does, plus
// _former_parameters (Note [Two ways to build a replica]).
py::object new_plain_replica(const ModuleEntry& e, ReplicaDicts& out) {
  PyTypeObject* type = Py_TYPE(e.module.ptr());
  py::object replica = steal_or_throw(type->tp_new(type, refs().empty_tuple.ptr(), nullptr));
  for (py::object* dict : {&out.dict, &out.params, &out.buffers, &out.modules}) {
    *dict = steal_or_throw(PyDict_New());
  }
  out.former = refs().ordered_dict();
  fill_plain_dicts(e, out);
  if (PyObject_GenericSetAttr(replica.ptr(), refs().key_dict, out.dict.ptr()) < 0) {
    throw py::error_already_set();
  }
  return replica;
}

// The copies of the network's parameters and buffers, per device, as Python objects.
struct TensorCopies {
  std::unordered_map<PyObject*, size_t> param_index;
  std::unordered_map<PyObject*, std::pair<bool, size_t>> buffer_index; // (requires grad, index)
  std::vector<py::list> params, rg_buffers, plain_buffers;             // per device

  py::handle param(size_t j, PyObject* original) const {
    const auto it = param_index.find(original);
    if (it == param_index.end()) {
      unlisted("parameter", "parameters()");
    }
    return params[j][it->second];
  }
  py::handle buffer(size_t j, PyObject* original) const {
    const auto it = buffer_index.find(original);
    if (it == buffer_index.end()) {
      unlisted("buffer", "buffers()");
    }
    const auto where = it->second;
    return where.first ? rg_buffers[j][where.second] : plain_buffers[j][where.second];
  }

 private:
  // PyTorch's replicate takes the tensors to copy from network.parameters() and buffers(); one
  // that a module registers but those do not list has no copy (PyTorch fails with a KeyError).
  [[noreturn]] static void unlisted(const char* kind, const char* method) {
    TORCH_CHECK(false, kApi, ": a module registers a ", kind, " that the root module's ", method,
                " does not list (does the root override ", method,
                ", e.g. to yield only trainable parameters?). Replicate needs every registered ",
                kind, ": keep nn.Module's ", method,
                " and filter where the list is used (e.g. the optimizer's parameters)");
  }
};

// list(network.parameters()) and list(network.buffers()): from the modules' dicts when the walk
// was exact (whatever the root's accessors: an override that lists fewer tensors, such as only the
// trainable parameters, would leave registered ones without copies), otherwise from Python.
std::pair<py::list, py::list> parameters_and_buffers(py::handle network, const Network& net) {
  if (!net.dicts_ok) {
    return {py::list(network.attr("parameters")()), py::list(network.attr("buffers")())};
  }
  auto collect = [&](py::object ModuleEntry::* member) {
    py::list out;
    std::unordered_map<PyObject*, bool> seen;
    for (const auto& e : net.modules) {
      PyObject *key = nullptr, *value = nullptr;
      Py_ssize_t pos = 0;
      while (PyDict_Next((e.*member).ptr(), &pos, &key, &value)) {
        if (value != Py_None && seen.emplace(value, true).second) {
          out.append(py::handle(value));
        }
      }
    }
    return out;
  };
  return {collect(&ModuleEntry::params), collect(&ModuleEntry::buffers)};
}

// Children, parameters and buffers of a plain replica, with dictionary operations.
void wire_plain(const ModuleEntry& e, size_t j, const std::vector<py::list>& copies,
                const std::vector<std::vector<ReplicaDicts>>& dicts, size_t i, const Network& net,
                const TensorCopies& tensors, bool may_hold_originals) {
  const auto& r = refs();
  const auto& d = dicts[j][i];
  py::handle replica = copies[j][i];
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(e.children.ptr(), &pos, &key, &value)) {
    dict_set(d.modules.ptr(), key,
             value == Py_None ? Py_None : copies[j][net.index.at(value)].ptr());
  }
  pos = 0;
  while (PyDict_Next(e.params.ptr(), &pos, &key, &value)) {
    if (value == Py_None) {
      dict_set(d.params.ptr(), key, Py_None);
      continue;
    }
    py::handle copy = tensors.param(j, value);
    int is_parameter = 0;
    if (may_hold_originals) {
      is_parameter = PyObject_IsInstance(copy.ptr(), r.parameter_type.ptr());
      if (is_parameter < 0) {
        throw py::error_already_set();
      }
    }
    dict_set(is_parameter ? d.params.ptr() : d.dict.ptr(), key, copy.ptr());
    if (PyObject_SetItem(d.former.ptr(), key, copy.ptr()) < 0) {
      throw py::error_already_set();
    }
  }
  pos = 0;
  while (PyDict_Next(e.buffers.ptr(), &pos, &key, &value)) {
    if (value == Py_None) {
      continue; // the copied _buffers already holds None
    }
    py::handle copy = tensors.buffer(j, value);
    if (may_hold_originals) {
      const int is_parameter = PyObject_IsInstance(copy.ptr(), r.parameter_type.ptr());
      if (is_parameter < 0) {
        throw py::error_already_set();
      }
      if (is_parameter) { // a Parameter registered as a buffer: let setattr decide, as PyTorch
        py::setattr(replica, key, copy);
        continue;
      }
    }
    dict_set(d.buffers.ptr(), key, copy.ptr());
  }
}

// Children, parameters and buffers of the other replicas, through setattr as PyTorch does, key by
// key and device by device (see Note [Replica assignment and custom __setattr__]).
// True when `stored` is `copy` or another tensor over exactly the same memory, shape, dtype and
// gradient requirement (a __setattr__ that registers `value.detach().to(device)` keeps the copy's
// values under a new object: nothing to repair).
bool same_view(PyObject* stored, PyObject* copy) {
  if (stored == copy) {
    return true;
  }
  if (!THPVariable_Check(stored) || !THPVariable_Check(copy)) {
    return false;
  }
  const auto& a = THPVariable_Unpack(stored);
  const auto& b = THPVariable_Unpack(copy);
  return a.defined() && b.defined() && a.device() == b.device() &&
         a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         a.strides() == b.strides() && a.requires_grad() == b.requires_grad() && a.has_storage() &&
         b.has_storage() && a.storage().is_alias_of(b.storage()) &&
         a.storage_offset() == b.storage_offset();
}

std::string path_in(py::handle root, py::handle module);

// Re-raises `error`, raised while a replica of `module` was wired, naming the module's path in
// `root` and its class (a builtin exception keeps its type; others become RuntimeError, whose
// constructor surely takes one message), chained to the original.
[[noreturn]] void raise_with_module_path(py::error_already_set& error, py::handle root,
                                         py::handle module) {
  const auto path = path_in(root, module);
  const std::string cls = py::str(py::type::of(module).attr("__qualname__"));
  const std::string message =
      std::string(kApi) + ": assigning the replica's attributes of module '" +
      (path.empty() ? "<root>" : path) + "' (class " + cls +
      ", through its __setattr__) failed: " + py::str(error.value()).cast<std::string>();
  py::handle type = error.type();
  const bool builtin = PyType_Check(type.ptr()) &&
                       py::str(type.attr("__module__")).cast<std::string>() == "builtins";
  py::raise_from(error, builtin ? type.ptr() : PyExc_RuntimeError, message.c_str());
  throw py::error_already_set();
}

void wire_with_setattr(const ModuleEntry& e, size_t i, const std::vector<py::list>& copies,
                       const Network& net, const TensorCopies& tensors) {
  const auto& r = refs();
  py::handle module = e.module;
  const size_t n = copies.size();
  const std::string cls = py::str(py::type::of(module).attr("__qualname__"));
  py::dict children = module.attr("_modules");
  for (auto item : children) {
    for (const auto j : c10::irange(n)) {
      py::object replica = copies[j][i];
      if (item.second.is_none()) {
        replica.attr("_modules")[item.first] = py::none();
      } else {
        py::setattr(replica, item.first, copies[j][net.index.at(item.second.ptr())]);
      }
    }
  }
  py::dict own_params = module.attr("_parameters");
  for (auto item : own_params) {
    const auto key = item.first;
    for (const auto j : c10::irange(n)) {
      py::object replica = copies[j][i];
      if (item.second.is_none()) {
        replica.attr("_parameters")[key] = py::none();
        continue;
      }
      py::object copy = py::reinterpret_borrow<py::object>(tensors.param(j, item.second.ptr()));
      py::setattr(replica, key, copy);
      replica.attr("_former_parameters")[key] = copy;
      if (!py::getattr(replica, key, py::none()).is(copy)) {
        if (py::isinstance(copy, r.parameter_type)) {
          replica.attr("_parameters")[key] = copy;
        } else {
          replica.attr("__dict__")[key] = copy;
        }
        warn_once(cls, py::str(key), "parameter");
      }
    }
  }
  py::dict own_buffers = module.attr("_buffers");
  for (auto item : own_buffers) {
    const auto key = item.first;
    for (const auto j : c10::irange(n)) {
      py::object replica = copies[j][i];
      if (item.second.is_none()) {
        replica.attr("_buffers")[key] = py::none();
        continue;
      }
      py::object copy = py::reinterpret_borrow<py::object>(tensors.buffer(j, item.second.ptr()));
      py::dict replica_buffers = replica.attr("_buffers");
      if (e.type->overrides_setattr) {
        replica_buffers[key] = r.empty_like(copy);
      }
      py::setattr(replica, key, copy);
      replica_buffers = replica.attr("_buffers");
      if (!replica_buffers.contains(key) ||
          !same_view(py::object(replica_buffers[key]).ptr(), copy.ptr())) {
        replica_buffers[key] = copy;
        warn_once(cls, py::str(key), "buffer");
      }
    }
  }
}

const at::Tensor& tensor_of(py::handle value, const char* kind) {
  TORCH_CHECK_TYPE(THPVariable_Check(value.ptr()), kApi, ": a registered ", kind,
                   " of the network is not a tensor but ",
                   std::string(py::str(py::type::of(value).attr("__qualname__"))),
                   "; register tensors (or None) only");
  return THPVariable_Unpack(value.ptr());
}

bool registration_hooks_installed() {
  const auto& m = refs().module_module;
  for (const char* name :
       {"_global_module_registration_hooks", "_global_parameter_registration_hooks",
        "_global_buffer_registration_hooks"}) {
    py::object hooks = py::getattr(m, name, py::none());
    if (!hooks.is_none() && py::len(hooks) > 0) {
      return true;
    }
  }
  return false;
}

// Note [Replicating compiled modules]
// torch.compile(module) returns an OptimizedModule whose `forward` is a compiled call of the
// *original* wrapped module, and module.compile() stores a compiled call of the original's
// _call_impl in `_compiled_call_impl`. A replica that copied those attributes would run the
// original module (its parameters, its device) instead of its own. PyTorch's replicate is worse
// off: OptimizedModule.__setattr__ forwards `_parameters`, `_buffers` and `_modules` to the
// wrapped module, so _replicate_for_data_parallel() overwrites the original's dictionaries and
// the model ends up containing itself. torchdp builds OptimizedModule replicas with dictionary
// operations (no setattr), then re-derives each replica's compiled call from the replica itself:
// OptimizedModule._initialize() for the wrapper, torchdp._compiled.rebind_compiled_call for
// module.compile() (the same compiler context applied to the replica's _call_impl; replicas of
// one class share dynamo's cache, so nothing is recompiled per step).
void recompile_replicas(const Network& net, const std::vector<py::list>& copies) {
  const auto& r = refs();
  py::object rebind;
  for (const auto i : c10::irange(net.modules.size())) {
    const auto& e = net.modules[i];
    if (e.type->optimized) {
      for (const auto& list : copies) {
        py::handle(list[i]).attr("_initialize")();
      }
    }
    if (!e.dict || !PyDict_Check(e.dict.ptr())) {
      continue;
    }
    PyObject* compiled = PyDict_GetItemWithError(e.dict.ptr(), r.key_compiled_call); // borrowed
    if (compiled == nullptr) {
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      continue;
    }
    if (compiled == Py_None) {
      continue;
    }
    if (!rebind) {
      rebind = py::module_::import("torchdp._compiled").attr("rebind_compiled_call");
    }
    for (const auto& list : copies) {
      rebind(list[i], py::handle(compiled));
    }
  }
}

// Note [No garbage collection while replicas are built]
// Building the replicas creates a few container objects per module and device (the module object,
// its __dict__, _parameters, _buffers, _modules, hook dictionaries...): thousands for a model of a
// few hundred modules. Every 700 of them CPython collects its youngest generation, every tenth of
// those the middle one, and now and then it makes a full collection over every object of the
// process (torch has hundreds of thousands), while nothing built here can be garbage yet. So
// automatic collection is paused while the replicas are built and resumed afterwards (only if it
// was on: a program that turned it off keeps it off). The new objects still count towards the next
// collection, which then runs once, later, instead of several times in here. Measured on this
// project's 2-core CPU machine, 300 calls of torchdp.replicate onto two CPU devices, small tensors:
// median unchanged (1000 x Linear: 4.29 -> 4.25 ms; 200-layer MLP 1.11 -> 1.13 ms) and the slow
// calls gone (1000 x Linear: mean 9.8 -> 4.7 ms, 90th percentile 39 -> 4.3 ms; MLP mean 1.8
// -> 1.4).
class PauseGarbageCollection {
 public:
  PauseGarbageCollection() : was_enabled_(PyGC_Disable() == 1) {}
  ~PauseGarbageCollection() {
    if (was_enabled_) {
      PyGC_Enable();
    }
  }
  PauseGarbageCollection(const PauseGarbageCollection&) = delete;
  PauseGarbageCollection& operator=(const PauseGarbageCollection&) = delete;

 private:
  bool was_enabled_;
};

// Everything one replicate call learns from the network before its transfer: the modules, their
// tensors split as PyTorch splits them, and what the replicas may be built with. Filled in place
// (the entries point into `types`), never moved.
struct Source {
  TypeTable types;
  Network net;
  TensorCopies tensors;
  std::vector<c10::Device> devices;
  std::vector<at::Tensor> param_tensors, rg_buffers, plain_buffers;
  bool detach = false;
  // No global module/parameter/buffer registration hooks: plain modules take dictionary
  // operations (Note [Two ways to build a replica]).
  bool fast = true;
  // Every module takes dictionary operations and none carries a compiled call: the replicas are
  // exactly what the dictionary operations make, so their devices need no check without hooks or
  // callbacks, and they may be kept between calls (Note [Kept replicas]).
  bool plain_only = true;
  // plain_only, and no class with __slots__: the replicas may be kept (Note [Kept replicas]).
  bool keepable = true;
};

bool dict_ops(const Source& s, const ModuleEntry& e) {
  return e.plain && (s.fast || e.type->optimized);
}

bool has_compiled_call(const ModuleEntry& e) {
  if (!e.dict || !PyDict_Check(e.dict.ptr())) {
    return false;
  }
  PyObject* compiled = PyDict_GetItemWithError(e.dict.ptr(), refs().key_compiled_call); // borrowed
  if (compiled == nullptr && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return compiled != nullptr && compiled != Py_None;
}

void prepare(Source& s, py::handle network, const std::vector<c10::Device>& devices_in,
             bool detach) {
  s.devices = normalize_devices(devices_in, kApi);
  s.detach = detach;
  s.net = walk_network(network, s.types);
  check_replicatable(s.net, s.types);
  s.fast = !registration_hooks_installed();
  for (const auto& e : s.net.modules) {
    s.plain_only = s.plain_only && dict_ops(s, e) && !e.type->optimized && !has_compiled_call(e);
    s.keepable = s.keepable && !e.type->slots;
  }
  auto [params, buffers] = parameters_and_buffers(network, s.net);

  // Parameters, and buffers split as PyTorch splits them: buffers that require grad are broadcast
  // differentiably (unless detached), the others never.
  s.param_tensors.reserve(params.size());
  for (const auto i : c10::irange(params.size())) {
    s.tensors.param_index.emplace(params[i].ptr(), i);
    s.param_tensors.push_back(tensor_of(params[i], "parameter"));
  }
  for (const auto i : c10::irange(buffers.size())) {
    const auto& t = tensor_of(buffers[i], "buffer");
    const bool rg = t.requires_grad() && !detach;
    auto& group = rg ? s.rg_buffers : s.plain_buffers;
    s.tensors.buffer_index.emplace(buffers[i].ptr(), std::make_pair(rg, group.size()));
    group.push_back(t);
  }

  // Every tensor must already be on devices[0]: name the first one that is not.
  const auto& devices = s.devices;
  auto check_source = [&](const std::vector<at::Tensor>& group, const char* what) {
    for (const auto& t : group) {
      if (detail::canonical(t.device()) != devices[0]) {
        std::string name = "?";
        const char* method =
            std::string(what) == "parameter" ? "named_parameters" : "named_buffers";
        for (auto item : network.attr(method)()) {
          auto pair = item.cast<py::tuple>();
          if (THPVariable_Unpack(pair[1].ptr()).unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
            name = pair[0].cast<std::string>();
            break;
          }
        }
        TORCH_CHECK(false, kApi, ": the module's ", what, " '", name, "' is on ", t.device(),
                    " but the replicas are built from devices[0] = ", devices[0],
                    "; move the module there first (module.to(", devices[0], "))");
      }
    }
  };
  check_source(s.param_tensors, "parameter");
  check_source(s.rg_buffers, "buffer");
  check_source(s.plain_buffers, "buffer");
}

// The broadcast of every tensor (differentiable unless detached) and the Python objects of the
// copies, per device (the dev0 outputs of a detached broadcast are the originals).
void transfer(Source& s, std::optional<int64_t> grad_bucket_bytes) {
  TORCH_CHECK_VALUE(!grad_bucket_bytes || *grad_bucket_bytes >= 0, kApi,
                    ": grad_bucket_bytes must be >= 0 (0: one bucket), got ",
                    grad_bucket_bytes.value_or(0));
  const size_t n = s.devices.size();
  std::vector<std::vector<at::Tensor>> param_copies, rg_copies, plain_copies;
  {
    GilRelease no_gil;
    std::optional<autograd::GradBucketSizeGuard> bucket_size;
    if (grad_bucket_bytes) {
      bucket_size.emplace(static_cast<size_t>(*grad_bucket_bytes));
    }
    auto broadcast = [&](const std::vector<at::Tensor>& group, bool differentiable) {
      if (group.empty()) {
        return std::vector<std::vector<at::Tensor>>(n);
      }
      return differentiable ? autograd::broadcast_coalesced(group, s.devices)
                            : comm::broadcast_coalesced(group, s.devices);
    };
    param_copies = broadcast(s.param_tensors, !s.detach);
    rg_copies = broadcast(s.rg_buffers, true);
    plain_copies = broadcast(s.plain_buffers, false);
    no_gil.reacquire();
  }
  auto wrap = [](std::vector<at::Tensor>& group) {
    py::list out(group.size());
    for (const auto k : c10::irange(group.size())) {
      out[k] = steal_or_throw(THPVariable_Wrap(std::move(group[k])));
    }
    return out;
  };
  s.tensors.params.resize(n);
  s.tensors.rg_buffers.resize(n);
  s.tensors.plain_buffers.resize(n);
  for (const auto j : c10::irange(n)) {
    s.tensors.params[j] = wrap(param_copies[j]);
    s.tensors.rg_buffers[j] = wrap(rg_copies[j]);
    s.tensors.plain_buffers[j] = wrap(plain_copies[j]);
  }
}

// New replica objects, one per module and device (Note [Two ways to build a replica]), wired to
// the copies; `dicts[j][i]` gets the dictionaries of the replicas built with dictionary operations.
std::vector<py::list> build(const Source& s, std::vector<std::vector<ReplicaDicts>>& dicts) {
  const size_t n = s.devices.size();
  const size_t count = s.net.modules.size();
  std::vector<py::list> copies(n);
  dicts.assign(n, std::vector<ReplicaDicts>(count));
  for (const auto j : c10::irange(n)) {
    copies[j] = py::list(count);
  }
  for (const auto i : c10::irange(count)) {
    const auto& e = s.net.modules[i];
    TORCH_CHECK(
        !e.type->optimized || e.plain, kApi, ": cannot replicate the torch.compile wrapper ",
        std::string(py::str(py::type::of(e.module).attr("__qualname__"))),
        ": it keeps its _parameters/_buffers/_modules in non-dict containers or overrides "
        "__new__ or _replicate_for_data_parallel. Replicate the wrapped eager module instead "
        "(wrapper._orig_mod), compiled in place with module.compile() if it should run compiled");
    for (const auto j : c10::irange(n)) {
      if (dict_ops(s, e)) {
        copies[j][i] = new_plain_replica(e, dicts[j][i]);
      } else {
        py::object replica = e.module.attr("_replicate_for_data_parallel")();
        replica.attr("_former_parameters") = refs().ordered_dict();
        copies[j][i] = replica;
      }
    }
  }
  for (const auto i : c10::irange(count)) {
    const auto& e = s.net.modules[i];
    if (!dict_ops(s, e)) {
      try {
        wire_with_setattr(e, i, copies, s.net, s.tensors);
      } catch (py::error_already_set& error) {
        raise_with_module_path(error, s.net.modules.front().module, e.module);
      }
      continue;
    }
    for (const auto j : c10::irange(n)) {
      wire_plain(e, j, copies, dicts, i, s.net, s.tensors, s.detach && j == 0);
    }
  }
  recompile_replicas(s.net, copies);
  return copies;
}

struct Replicas {
  std::vector<py::list> copies;
  bool plain_only = false; // see Source::plain_only
};

Replicas replicate(py::handle network, const std::vector<c10::Device>& devices_in, bool detach,
                   std::optional<int64_t> grad_bucket_bytes) {
  if (devices_in.empty()) {
    return {};
  }
  const PauseGarbageCollection no_gc; // Note [No garbage collection while replicas are built]
  std::optional<detail::ProfilerRange> phase;
  phase.emplace("torchdp.replicate.walk");
  Source s;
  prepare(s, network, devices_in, detach);
  phase.reset();
  phase.emplace("torchdp.replicate.transfer");
  transfer(s, grad_bucket_bytes);
  phase.reset();
  phase.emplace("torchdp.replicate.build");
  std::vector<std::vector<ReplicaDicts>> dicts;
  return {build(s, dicts), s.plain_only};
}

// Note [Kept replicas]
// torchdp.DataParallel keeps its replicas between forwards, as the C++ DataParallel does: building
// them makes a module object and five dictionaries per module and device, thousands of objects per
// step that the garbage collector then counts and scans, and that are freed again at the end of
// the forward. A ReplicaCache instead
//   * lends the replicas it built or refreshed (replicate), and takes them back at the end of the
//     forward (park). Park checks that nothing but the replicas themselves still refers to any
//     replica module: the reference count of every replica module is the one it had when the
//     replicas were wired (the cache's own reference plus those of parent replicas); and that
//     each replica still has the class and the __dict__ it was given. A replica
//     still held elsewhere (by a checkpointed forward that runs again in the backward pass, a hook
//     that stored it, a failed forward's traceback, a forward running in another thread) is
//     dropped from the cache and left as it is; the next call builds new replicas. A parked replica
//     is unreachable from Python, so its dictionaries are emptied at once: the copies on the other
//     devices are freed when the autograd graph lets go of them, as with replicas that die.
//   * reuses parked replicas when the network's walk finds modules of the same classes in the
//     same order, onto the same devices, all built with dictionary operations, none compiled and
//     none of a class with __slots__ (whose slots a forward could fill and a refill would not
//     reset); anything else builds anew. Each reused replica's dictionaries are refilled exactly
//     as a new replica's are filled (its __dict__ a copy of the original's, its own _parameters,
//     _buffers and _modules, the copies of this call), all from this call's walk, so training
//     flags, plain attributes, registered tensors and children that changed since the last call
//     (even a submodule replaced by another of its class) show up as they would in new replicas,
//     and whatever the last forward wrote into a replica is gone. The cache holds no reference to
//     the network: a cache keyed weakly by its module does not keep that module alive.
// Replicas lent and never parked (the forward failed, a second call came first) are dropped by the
// next call, before its transfer, so that their copies do not stay alive next to the new ones.
// The flat buffers the copies live in are not kept: the caching allocator hands the same blocks
// back at the next call (ResNet-50 onto two devices: 15 at::empty calls, 0.08 ms of CPU), and
// keeping them would hold a copy of the model on every other device between steps.
class ReplicaCache {
 public:
  // (copies, plain_only, reused, buffers): copies as torchdp._C.replicate's; buffers, a copy of the
  // network's buffers taken before anything of this call could change them (Note [Buffers of
  // failed forwards]), refreshed in place from call to call unless a caller still holds it.
  py::tuple replicate(py::handle network, const std::vector<c10::Device>& devices_in, bool detach,
                      std::optional<int64_t> grad_bucket_bytes) {
    TORCH_CHECK_VALUE(!devices_in.empty(), kApi, ": ReplicaCache.replicate needs a device");
    const PauseGarbageCollection no_gc; // Note [No garbage collection while replicas are built]
    std::optional<detail::ProfilerRange> phase;
    phase.emplace("torchdp.replicate.walk");
    Source s;
    prepare(s, network, devices_in, detach);
    if (!buffers_ || buffers_.use_count() > 1) {
      buffers_ = std::make_shared<torchdp::BufferSnapshot>();
    }
    {
      std::vector<at::Tensor> originals(s.plain_buffers);
      originals.insert(originals.end(), s.rg_buffers.begin(), s.rg_buffers.end());
      buffers_->take(originals);
    }
    const auto buffers = buffers_;
    // Taken out of the cache for this call: a concurrent call (the transfer releases the GIL)
    // finds it empty and builds its own.
    std::unique_ptr<State> state = std::move(state_);
    if (state && !(state->parked && reusable(*state, s))) {
      state.reset(); // before the transfer: its copies go first
    }
    phase.reset();
    phase.emplace("torchdp.replicate.transfer");
    transfer(s, grad_bucket_bytes);
    phase.reset();
    phase.emplace("torchdp.replicate.build");
    const bool reused = static_cast<bool>(state);
    std::vector<py::list> copies;
    if (reused) {
      copies = refill(*state, s);
      ++reuses_;
    } else {
      std::vector<std::vector<ReplicaDicts>> dicts;
      copies = build(s, dicts);
      ++builds_;
      if (s.plain_only && s.keepable) {
        state = std::make_unique<State>();
        state->devices = s.devices;
        for (const auto& e : s.net.modules) {
          state->types.push_back(Py_TYPE(e.module.ptr()));
        }
        state->replicas.resize(copies.size());
        for (const auto j : c10::irange(copies.size())) {
          for (auto replica : copies[j]) {
            state->replicas[j].push_back(py::reinterpret_borrow<py::object>(replica));
          }
        }
        state->dicts = std::move(dicts);
      }
    }
    if (state) {
      // The reference counts with only the cache, the replicas and `copies` (one each) holding
      // them.
      state->expected.assign(copies.size(), {});
      for (const auto j : c10::irange(copies.size())) {
        for (const auto& replica : state->replicas[j]) {
          state->expected[j].push_back(Py_REFCNT(replica.ptr()) - 1);
        }
      }
      state->parked = false;
      state_ = std::move(state);
    }
    py::list out;
    for (auto& list : copies) {
      out.append(std::move(list));
    }
    return py::make_tuple(out, s.plain_only, reused, buffers);
  }

  // Takes the lent replicas back (Note [Kept replicas]); true when they are kept.
  bool park() {
    if (!state_ || state_->parked) {
      return state_ != nullptr;
    }
    const detail::ProfilerRange range("torchdp.replicate.park");
    // Out of the cache while it is checked and emptied: freeing the copies may run Python code
    // (finalizers, weakref callbacks), and with it another thread's call.
    std::unique_ptr<State> state = std::move(state_);
    for (const auto j : c10::irange(state->replicas.size())) {
      for (const auto i : c10::irange(state->replicas[j].size())) {
        PyObject* replica = state->replicas[j][i].ptr();
        if (Py_REFCNT(replica) != state->expected[j][i]) {
          return false; // still in use: left to its holders
        }
        // A forward that gave the replica another __dict__ or class: refilling would miss it.
        const py::object dict = instance_dict(replica);
        if (!dict.is(state->dicts[j][i].dict) || Py_TYPE(replica) != state->types[i]) {
          return false;
        }
      }
    }
    for (auto& device_dicts : state->dicts) {
      for (auto& d : device_dicts) {
        clear(d);
      }
    }
    state->parked = true;
    if (state_) {
      return false; // another call kept its own replicas meanwhile
    }
    state_ = std::move(state);
    return true;
  }

  void drop() {
    state_.reset();
    buffers_.reset();
  }

  int64_t builds() const {
    return builds_;
  }
  int64_t reuses() const {
    return reuses_;
  }
  // "empty", "lent" or "parked".
  std::string state() const {
    return !state_ ? "empty" : state_->parked ? "parked" : "lent";
  }

 private:
  struct State {
    std::vector<c10::Device> devices;
    // The class of each module, in network.modules() order (alive: the replicas hold them).
    std::vector<PyTypeObject*> types;
    std::vector<std::vector<py::object>> replicas; // [device][module]
    std::vector<std::vector<ReplicaDicts>> dicts;
    std::vector<std::vector<Py_ssize_t>> expected; // reference counts when lent (see park)
    bool parked = false;
  };
  // Note [Buffers of failed forwards]: the copy of the network's buffers, kept for the next call.
  std::shared_ptr<torchdp::BufferSnapshot> buffers_;

  // A refill takes everything from the network's walk of this call; the kept objects only need
  // the classes of the modules in their positions. So other module objects of the same classes
  // (a submodule replaced by a new one of its class) reuse them too, and the cache holds no
  // reference to the network.
  static bool reusable(const State& state, const Source& s) {
    if (!s.plain_only || !s.keepable || state.devices != s.devices ||
        state.types.size() != s.net.modules.size()) {
      return false;
    }
    for (const auto i : c10::irange(state.types.size())) {
      if (state.types[i] != Py_TYPE(s.net.modules[i].module.ptr())) {
        return false;
      }
    }
    return true;
  }

  static void clear(ReplicaDicts& d) {
    for (const py::object* dict : {&d.dict, &d.params, &d.buffers, &d.modules}) {
      PyDict_Clear(dict->ptr());
    }
    py::object none = steal_or_throw(PyObject_CallMethodNoArgs(d.former.ptr(), refs().key_clear));
  }

  static std::vector<py::list> refill(const State& state, const Source& s) {
    const size_t n = state.replicas.size();
    const size_t count = s.net.modules.size();
    std::vector<py::list> copies(n);
    for (const auto j : c10::irange(n)) {
      copies[j] = py::list(count);
      for (const auto i : c10::irange(count)) {
        copies[j][i] = state.replicas[j][i];
        fill_plain_dicts(s.net.modules[i], state.dicts[j][i]);
      }
    }
    for (const auto i : c10::irange(count)) {
      for (const auto j : c10::irange(n)) {
        wire_plain(s.net.modules[i], j, copies, state.dicts, i, s.net, s.tensors,
                   s.detach && j == 0);
      }
    }
    return copies;
  }

  std::unique_ptr<State> state_;
  int64_t builds_ = 0;
  int64_t reuses_ = 0;
};

[[noreturn]] void misplaced_error(const std::string& api, size_t j, c10::Device expected,
                                  const std::string& path, py::handle module,
                                  const std::string& key, const char* kind, c10::Device found) {
  const auto qualified = path.empty() ? key : path + "." + key;
  TORCH_CHECK(false, api, ": replica ", j, " must live on ", expected, ", but its ", kind, " '",
              qualified, "' (module ", path.empty() ? "<root>" : path, ", class ",
              std::string(py::str(py::type::of(module).attr("__qualname__"))), ") is on ", found,
              ". Register a post-replicate hook (torchdp.register_post_replicate_hook) that "
              "puts it on the replica's device, e.g. `t.to(device)`");
}

// The qualified name of `module` inside `root` ("" for the root itself).
std::string path_in(py::handle root, py::handle module) {
  for (auto item : root.attr("named_modules")()) {
    auto pair = item.cast<py::tuple>();
    if (py::object(pair[1]).is(module)) {
      return pair[0].cast<std::string>();
    }
  }
  return "?";
}

// The device of `value` when it is a tensor that is not on `expected`.
std::optional<c10::Device> misplaced(PyObject* value, c10::Device expected) {
  if (value == nullptr || value == Py_None || !THPVariable_Check(value)) {
    return std::nullopt;
  }
  const auto device = THPVariable_Unpack(value).device();
  if (detail::canonical(device) == expected) {
    return std::nullopt;
  }
  return device;
}

void check_replica_devices(const std::vector<py::list>& copies,
                           const std::vector<c10::Device>& devices_in, const std::string& api) {
  TORCH_CHECK(copies.size() == devices_in.size(), api, ": got ", copies.size(), " replicas but ",
              devices_in.size(), " devices");
  if (copies.empty()) {
    return;
  }
  const detail::ProfilerRange range("torchdp.replicate.device_check");
  const auto devices = normalize_devices(devices_in, api.c_str());
  const auto& r = refs();
  TypeTable types;
  for (const auto j : c10::irange(copies.size())) {
    const auto expected = devices[j];
    if (copies[j].empty()) {
      continue;
    }
    py::handle root = copies[j][0];
    // The replica's modules as it is now (hooks may have added some), walked from its root.
    const Network net = walk_network(root, types);
    for (const auto& e : net.modules) {
      auto fail = [&](py::handle key, const char* kind, c10::Device found) {
        misplaced_error(api, j, expected, path_in(root, e.module), e.module, py::str(key), kind,
                        found);
      };
      // Parameter copies live in the instance __dict__ under the keys of _former_parameters.
      py::object former = py::reinterpret_borrow<py::object>(
          PyDict_Check(e.dict.ptr()) ? PyDict_GetItemWithError(e.dict.ptr(), r.key_former)
                                     : nullptr);
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      if (former && PyDict_Check(former.ptr())) {
        PyObject *key = nullptr, *value = nullptr;
        Py_ssize_t pos = 0;
        while (PyDict_Next(former.ptr(), &pos, &key, &value)) {
          PyObject* held = PyDict_GetItemWithError(e.dict.ptr(), key);
          py::object current;
          if (held != nullptr) {
            current = py::reinterpret_borrow<py::object>(held);
          } else {
            if (PyErr_Occurred()) {
              throw py::error_already_set();
            }
            current = py::getattr(e.module, key, py::none());
          }
          if (auto found = misplaced(current.ptr(), expected)) {
            fail(key, "parameter", *found);
          }
        }
      }
      for (auto [member, kind] : {std::make_pair(&ModuleEntry::params, "parameter"),
                                  std::make_pair(&ModuleEntry::buffers, "buffer")}) {
        py::object dict = e.*member;
        if (!dict) { // not an exact dict: iterate whatever the module keeps there
          dict = e.module.attr(member == &ModuleEntry::params ? "_parameters" : "_buffers");
          for (auto item : py::list(dict.attr("items")())) {
            auto pair = item.cast<py::tuple>();
            if (auto found = misplaced(pair[1].ptr(), expected)) {
              fail(pair[0], kind, *found);
            }
          }
          continue;
        }
        PyObject *key = nullptr, *value = nullptr;
        Py_ssize_t pos = 0;
        while (PyDict_Next(dict.ptr(), &pos, &key, &value)) {
          if (auto found = misplaced(value, expected)) {
            fail(key, kind, *found);
          }
        }
      }
    }
  }
}

// True when every parameter and buffer of `module` is on `device` (the per-forward check of
// DataParallel; the caller looks for names only when this fails).
bool all_on_device(py::handle module, const c10::Device& device_in) {
  const auto device = detail::canonical(device_in);
  TypeTable types;
  const Network net = walk_network(module, types);
  if (!net.dicts_ok) {
    for (const char* method : {"parameters", "buffers"}) {
      for (auto t : module.attr(method)()) {
        if (misplaced(t.ptr(), device)) {
          return false;
        }
      }
    }
    return true;
  }
  for (const auto& e : net.modules) {
    for (const py::object* dict : {&e.params, &e.buffers}) {
      PyObject *key = nullptr, *value = nullptr;
      Py_ssize_t pos = 0;
      while (PyDict_Next(dict->ptr(), &pos, &key, &value)) {
        if (misplaced(value, device)) {
          return false;
        }
      }
    }
  }
  return true;
}

} // namespace

void init_replicate(py::module_& m) {
  // wrap_pybind_function: c10 errors become the matching Python exceptions (RuntimeError,
  // ValueError, ...) and TORCH_WARN becomes a Python warning, as in torch's own bindings.
  m.def("replicate",
        torch::wrap_pybind_function([](py::object network, const std::vector<c10::Device>& devices,
                                       bool detach, std::optional<int64_t> grad_bucket_bytes,
                                       bool report) -> py::object {
          auto result = replicate(network, devices, detach, grad_bucket_bytes);
          py::list copies;
          for (auto& list : result.copies) {
            copies.append(std::move(list));
          }
          if (report) {
            return py::make_tuple(copies, result.plain_only);
          }
          return std::move(copies);
        }),
        py::arg("network"), py::arg("devices"), py::arg("detach") = false,
        py::arg("grad_bucket_bytes") = py::none(), py::kw_only(), py::arg("report") = false,
        R"doc(Replicates a Python nn.Module onto `devices` (see csrc/python/API.md).

Returns one list per device with the replica of every module of list(network.modules()), in that
order; element [j][0] is the root replica on devices[j]. Parameters are broadcast differentiably unless
`detach`, buffers that require grad likewise, other buffers detached; the replica on devices[0] shares
storage with the original. Modules of classes that keep nn.Module's behaviour are built with direct
dictionary operations (the same result as PyTorch's Python code, much faster); the others with
_replicate_for_data_parallel() and setattr. Custom __setattr__ overrides that swallow the assignment
are repaired (with a one-time UserWarning per class and attribute). The original's tensors are never
written. Raises RuntimeError for a ScriptModule with Python modules below it. grad_bucket_bytes sets
the gradient bucket size of the parameters' backward (default 25 MiB; 0: one bucket). With report=True it returns (copies, plain_only): plain_only is True when every
module was built with dictionary operations and none is compiled, so that every registered tensor of
the replicas is on its device by construction (only hooks and callbacks can move them).)doc");
  py::class_<ReplicaCache>(m, "ReplicaCache", R"doc(Replicas kept between the forwards of one
DataParallel (replicate_py.cpp, Note [Kept replicas]).)doc")
      .def(py::init<>())
      .def("replicate",
           torch::wrap_pybind_function([](ReplicaCache& self, py::object network,
                                          const std::vector<c10::Device>& devices, bool detach,
                                          std::optional<int64_t> grad_bucket_bytes) {
             return self.replicate(network, devices, detach, grad_bucket_bytes);
           }),
           py::arg("network"), py::arg("devices"), py::arg("detach") = false,
           py::arg("grad_bucket_bytes") = py::none(),
           R"doc(As replicate(..., report=True), plus whether parked replicas were reused and a
BufferSnapshot of the network's buffers taken before the transfer: (copies, plain_only, reused,
buffers). The replicas are lent until park().)doc")
      .def("park", &ReplicaCache::park,
           R"doc(Takes the lent replicas back when nothing but the cache and the replicas refer to
them (their dictionaries are then emptied); otherwise drops them from the cache. True when kept.)doc")
      .def("drop", &ReplicaCache::drop, "Forgets the kept replicas.")
      .def_property_readonly("builds", &ReplicaCache::builds, "Replica sets built so far.")
      .def_property_readonly("reuses", &ReplicaCache::reuses, "Calls that reused parked replicas.")
      .def_property_readonly("state", &ReplicaCache::state, "'empty', 'lent' or 'parked'.");
  m.def(
      "check_replica_devices",
      torch::wrap_pybind_function([](const std::vector<py::list>& copies,
                                     const std::vector<c10::Device>& devices,
                                     const std::string& api) {
        check_replica_devices(copies, devices, api);
      }),
      py::arg("copies"), py::arg("devices"), py::arg("api") = std::string(kApi),
      R"doc(Raises RuntimeError when a registered parameter or buffer of the replica rooted at copies[j][0]
(walked from that root, so modules added by hooks count) is not on devices[j], naming its qualified
name, its device and the expected device.)doc");
  py::class_<torchdp::BufferSnapshot, std::shared_ptr<torchdp::BufferSnapshot>>(
      m, "BufferSnapshot",
      R"doc(A copy of a module's buffers that can be
written back into them (Note [Buffers of failed forwards]).)doc")
      .def(py::init<>())
      .def("take",
           torch::wrap_pybind_function(
               [](torchdp::BufferSnapshot& self, const std::vector<at::Tensor>& tensors) {
                 self.take(tensors);
               }),
           py::arg("tensors"),
           "Copies `tensors`; the same tensors as last time refresh the copies in place.")
      .def("restore", torch::wrap_pybind_function([](torchdp::BufferSnapshot& self) {
             return self.restore();
           }),
           "Writes the copy back into the buffers; returns how many (0, with a warning, when "
           "another forward used the same buffers since the copy was taken).")
      .def("release", &torchdp::BufferSnapshot::release,
           "Ends the forward the copy was taken for (its buffers are no longer marked as used).")
      .def("__len__", &torchdp::BufferSnapshot::size);
  m.def("snapshot_buffers", torch::wrap_pybind_function([](py::object network) {
          TypeTable types;
          auto net = walk_network(network, types);
          auto buffers = parameters_and_buffers(network, net).second;
          std::vector<at::Tensor> tensors;
          tensors.reserve(buffers.size());
          for (auto b : buffers) {
            tensors.push_back(tensor_of(b, "buffer"));
          }
          return std::make_shared<torchdp::BufferSnapshot>(tensors);
        }),
        py::arg("network"),
        R"doc(A BufferSnapshot of network.buffers(): DataParallel writes it back when a replicated
forward fails (Note [Buffers of failed forwards] in csrc/torchdp/replicate.h).)doc");
  m.def("all_on_device", torch::wrap_pybind_function(all_on_device), py::arg("module"),
        py::arg("device"),
        R"doc(True when every parameter and buffer of `module` (as module.parameters() and
module.buffers() list them) is on `device`.)doc");
}

} // namespace torchdp::python
