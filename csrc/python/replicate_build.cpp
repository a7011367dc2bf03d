// New replicas of a Python network: the transfer of its tensors and the building of the replica
// modules (csrc/python/replication.h).
#include "replication.h"

#include <torchdp/autograd.h>
#include <torchdp/comm.h>

#include <c10/util/irange.h>
#include <torch/csrc/autograd/python_variable.h>

#include <mutex>
#include <set>
#include <string>

namespace torchdp::python::replication {
namespace {

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

// Note [Replica assignment and custom __setattr__]
// PyTorch wires each replica with setattr(replica, key, copy), children first, then parameters,
// then buffers, so that cooperative __setattr__ overrides (RNNBase keeps _flat_weights in sync) see
// every assignment. A module whose __setattr__ swallows or redirects the assignment (cplxmodule's
// masked layers copy into the existing `mask`) leaves the replica with the original's tensor, on
// the original's device, and may even write the copy into the original. torchdp therefore
//   * for classes that override __setattr__, first puts a fresh empty tensor of the copy's device
//     in the replica's _buffers, so whatever the override reads or writes is the replica's own
//     tensor (the original is never written), then calls setattr as PyTorch does;
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

// Children, parameters and buffers of the other replicas, through setattr as PyTorch does, key by
// key and device by device (see Note [Replica assignment and custom __setattr__]).
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

} // namespace

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

} // namespace torchdp::python::replication
