// The walk of a network to replicate: its modules, their classes and their tensors.
#include "replication.h"

#include <torchdp/devices.h>

#include <c10/util/irange.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>

namespace torchdp::python::replication {
namespace {

// dict[key] when it is an exact dict, else an empty object.
py::object exact_dict_entry(py::handle dict, PyObject* key) {
  py::object value = dict_get_ref(dict.ptr(), key);
  return value && PyDict_CheckExact(value.ptr()) ? value : py::object();
}

bool same_attribute(py::handle type, const char* name, py::handle expected) {
  return py::getattr(type, name, py::none()).is(expected);
}

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

} // namespace

py::object compiled_call(const ModuleEntry& e) {
  if (!e.dict || !PyDict_Check(e.dict.ptr())) {
    return py::object();
  }
  py::object compiled = dict_get_ref(e.dict.ptr(), refs().key_compiled_call);
  return compiled.is_none() ? py::object() : compiled;
}

PyObject* interned(const char* text) {
  PyObject* s = PyUnicode_InternFromString(text);
  if (s == nullptr) {
    throw py::error_already_set();
  }
  return s;
}

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

py::object instance_dict(py::handle obj) {
  return steal_or_throw(PyObject_GenericGetDict(obj.ptr(), nullptr));
}

const TypeInfo& TypeTable::of(py::handle obj) {
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

// torch._dynamo.eval_frame.OptimizedModule, or empty when torch.compile was never used.
py::object TypeTable::optimized_module_type() {
  if (!optimized_looked_up_) {
    optimized_looked_up_ = true;
    const py::object eval_frame =
        dict_get_ref(refs().sys_modules.ptr(), "torch._dynamo.eval_frame");
    if (eval_frame) {
      optimized_type_ = py::getattr(eval_frame, "OptimizedModule", py::none());
      if (optimized_type_.is_none()) {
        optimized_type_ = py::object();
      }
    }
  }
  return optimized_type_;
}

// In C++ over the _modules dicts when every class keeps nn.Module's named_modules, else Python's.
Network walk_network(py::handle network, TypeTable& types) {
  Network net;
  bool exact = true;
  // Strong references: another thread may drop a child from its parent meanwhile.
  std::vector<py::object> stack{py::reinterpret_borrow<py::object>(network)};
  while (exact && !stack.empty()) {
    const py::object m = std::move(stack.back());
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
    std::vector<py::object> children;
    for_each_item(entry.children.ptr(), [&](PyObject*, PyObject* value) {
      if (value != Py_None) {
        children.push_back(py::reinterpret_borrow<py::object>(value));
      }
    });
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

// From the dicts whatever the root's accessors: an override listing fewer tensors (only the
// trainable ones) would leave registered tensors without copies.
std::pair<py::list, py::list> parameters_and_buffers(py::handle network, const Network& net) {
  if (!net.dicts_ok) {
    return {py::list(network.attr("parameters")()), py::list(network.attr("buffers")())};
  }
  auto collect = [&](py::object ModuleEntry::* member) {
    py::list out;
    std::unordered_map<PyObject*, bool> seen;
    for (const auto& e : net.modules) {
      for_each_item((e.*member).ptr(), [&](PyObject*, PyObject* value) {
        if (value != Py_None && seen.emplace(value, true).second) {
          out.append(py::handle(value));
        }
      });
    }
    return out;
  };
  return {collect(&ModuleEntry::params), collect(&ModuleEntry::buffers)};
}

std::string path_in(py::handle root, py::handle module) {
  for (auto item : root.attr("named_modules")()) {
    auto pair = item.cast<py::tuple>();
    if (py::object(pair[1]).is(module)) {
      return pair[0].cast<std::string>();
    }
  }
  return "?";
}

const at::Tensor& tensor_of(py::handle value, const char* kind) {
  TORCH_CHECK_TYPE(THPVariable_Check(value.ptr()), kApi, ": a registered ", kind,
                   " of the network is not a tensor but ",
                   std::string(py::str(py::type::of(value).attr("__qualname__"))),
                   "; register tensors (or None) only");
  return THPVariable_Unpack(value.ptr());
}

void prepare(Source& s, py::handle network, const std::vector<c10::Device>& devices_in,
             bool detach) {
  s.devices = normalize_devices(devices_in, kApi);
  s.detach = detach;
  s.net = walk_network(network, s.types);
  check_replicatable(s.net, s.types);
  s.fast = !registration_hooks_installed();
  for (const auto& e : s.net.modules) {
    s.plain_only = s.plain_only && dict_ops(s, e) && !e.type->optimized && !compiled_call(e);
    s.keepable = s.keepable && !e.type->slots;
  }
  auto [params, buffers] = parameters_and_buffers(network, s.net);

  // Buffers split as PyTorch does: those that require grad are broadcast differentiably.
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

} // namespace torchdp::python::replication
