// New replicas of a Python network: the transfer of its tensors and the replica modules.
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
// PyTorch builds each replica with _replicate_for_data_parallel() and setattr(), slow Python calls.
// For a class keeping nn.Module's __new__, __setattr__ and _replicate_for_data_parallel, with exact
// dicts, their outcome is known: torchdp makes the same replica with dictionary operations. Other
// modules, and all while global registration hooks exist (setattr calls them), go PyTorch's way.

// Note [Replica assignment and custom __setattr__]
// PyTorch wires replicas with setattr (children, parameters, buffers), so cooperative overrides
// (RNNBase's _flat_weights) see every assignment. One that swallows or redirects it would leave the
// original's tensor in the replica, or write the copy into the original. So an overriding class's
// replica first gets a fresh empty tensor in _buffers (the original is never written), and a
// replica not holding the broadcast copy afterwards gets it directly, with a one-time warning.

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

// object.__new__(type(m)) with m's dicts copied (Note [Two ways to build a replica]).
py::object new_plain_replica(const ModuleEntry& e, ReplicaDicts& out) {
  PyTypeObject* type = Py_TYPE(e.module.ptr());
  py::object replica = steal_or_throw(type->tp_new(type, refs().empty_tuple.ptr(), nullptr));
  for (py::object* dict : {&out.dict, &out.params, &out.buffers, &out.modules}) {
    *dict = steal_or_throw(PyDict_New());
  }
  out.former = refs().ordered_dict();
  out.state = py::list(refs().state_keys.size());
  for (const auto k : c10::irange(refs().state_keys.size())) {
    PyList_SET_ITEM(out.state.ptr(), k, py::none().release().ptr());
  }
  fill_plain_dicts(e, out);
  if (PyObject_GenericSetAttr(replica.ptr(), refs().key_dict, out.dict.ptr()) < 0) {
    throw py::error_already_set();
  }
  return replica;
}

// True when `stored` is `copy` or an identical view of its memory (nothing to repair).
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

// Re-raises `error` naming the module, chained; a non-builtin type becomes RuntimeError, whose
// constructor surely takes one message.
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

// Wiring through setattr, as PyTorch does (Note [Replica assignment and custom __setattr__]).
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
  for (const auto j : c10::irange(n)) {
    own_instance_state(e, j, copies, net, instance_dict(copies[j][i]), py::handle());
  }
}

// Note [Replicating compiled modules]
// An OptimizedModule's forward, and the _compiled_call_impl of module.compile(), are compiled calls
// of the *original*: a replica copying them would run the original. (In PyTorch's replicate,
// OptimizedModule.__setattr__ even forwards _parameters etc. into the wrapped module.) torchdp
// builds them with dictionary operations and re-derives each replica's call: _initialize(), or
// torchdp._compiled.rebind_compiled_call; replicas share dynamo's cache, so nothing recompiles.
void recompile_replicas(const Network& net, const std::vector<py::list>& copies) {
  py::object rebind;
  for (const auto i : c10::irange(net.modules.size())) {
    const auto& e = net.modules[i];
    if (e.type->optimized) {
      for (const auto& list : copies) {
        py::handle(list[i]).attr("_initialize")();
      }
    }
    const py::object compiled = compiled_call(e);
    if (!compiled) {
      continue;
    }
    if (!rebind) {
      rebind = py::module_::import("torchdp._compiled").attr("rebind_compiled_call");
    }
    for (const auto& list : copies) {
      rebind(list[i], compiled);
    }
  }
}

} // namespace

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

void wire_plain(const ModuleEntry& e, size_t j, const std::vector<py::list>& copies,
                const std::vector<std::vector<ReplicaDicts>>& dicts, size_t i, const Network& net,
                const TensorCopies& tensors, bool may_hold_originals) {
  const auto& r = refs();
  const auto& d = dicts[j][i];
  py::handle replica = copies[j][i];
  for_each_item(e.children.ptr(), [&](PyObject* key, PyObject* value) {
    dict_set(d.modules.ptr(), key,
             value == Py_None ? Py_None : copies[j][net.index.at(value)].ptr());
  });
  for_each_item(e.params.ptr(), [&](PyObject* key, PyObject* value) {
    if (value == Py_None) {
      dict_set(d.params.ptr(), key, Py_None);
      return;
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
  });
  for_each_item(e.buffers.ptr(), [&](PyObject* key, PyObject* value) {
    if (value == Py_None) {
      return; // the copied _buffers already holds None
    }
    py::handle copy = tensors.buffer(j, value);
    if (may_hold_originals) {
      const int is_parameter = PyObject_IsInstance(copy.ptr(), r.parameter_type.ptr());
      if (is_parameter < 0) {
        throw py::error_already_set();
      }
      if (is_parameter) { // a Parameter registered as a buffer: let setattr decide, as PyTorch
        py::setattr(replica, key, copy);
        return;
      }
    }
    dict_set(d.buffers.ptr(), key, copy.ptr());
  });
  own_instance_state(e, j, copies, net, d.dict, d.state);
}

// The dev0 outputs of a detached broadcast are the originals.
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
