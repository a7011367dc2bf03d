// Replication of *Python* nn.Modules, done in C++ with the same tensor layers as the C++ core
// (see csrc/python/API.md and DESIGN.md, "Replicating Python modules").
#include "bindings.h"

#include <torchdp/autograd.h>
#include <torchdp/comm.h>
#include <torchdp/devices.h>

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torchdp::python {
namespace {

constexpr const char* kApi = "torchdp.replicate";

// Note [Replica assignment and custom __setattr__]
// PyTorch wires each replica with setattr(replica, key, copy), children first, then parameters,
// then buffers, so that cooperative __setattr__ overrides (RNNBase keeps _flat_weights in sync) see
// every assignment. A module whose __setattr__ swallows or redirects the assignment (cplxmodule's
// masked layers copy into the existing `mask`) leaves the replica with the original's tensor, on
// the original's device, and may even write the copy into the original. torchdp therefore
//   * for classes that override __setattr__, first puts a fresh empty tensor of the copy's device in
//     the replica's _buffers, so whatever the override reads or writes is the replica's own tensor
//     (the original is never written), then calls setattr as PyTorch does;
//   * checks that the replica now holds exactly the broadcast copy; if not, puts the copy in place
//     directly (the device-check fallback) and warns once per class and attribute.

bool overrides_setattr(py::handle replica, py::handle module_setattr) {
  py::object setattr_fn = py::type::of(replica).attr("__setattr__");
  return !setattr_fn.is(module_setattr);
}

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

std::vector<py::list> replicate(py::object network, const std::vector<c10::Device>& devices_in,
                                bool detach) {
  if (devices_in.empty()) {
    return {};
  }
  const auto devices = normalize_devices(devices_in, kApi);
  const size_t n = devices.size();

  py::module_ torch_nn = py::module_::import("torch.nn");
  py::object module_setattr = torch_nn.attr("Module").attr("__setattr__");
  py::object ordered_dict = py::module_::import("collections").attr("OrderedDict");

  py::list modules = py::list(network.attr("modules")());
  py::list params = py::list(network.attr("parameters")());
  py::list buffers = py::list(network.attr("buffers")());

  std::unordered_map<PyObject*, size_t> module_index;
  for (const auto i : c10::irange(modules.size())) {
    module_index.emplace(modules[i].ptr(), i);
  }

  // Parameters, and buffers split as PyTorch splits them: buffers that require grad are broadcast
  // differentiably (unless detached), the others never.
  std::vector<at::Tensor> param_tensors;
  std::unordered_map<PyObject*, size_t> param_index;
  for (const auto i : c10::irange(params.size())) {
    param_index.emplace(params[i].ptr(), i);
    param_tensors.push_back(py::cast<at::Tensor>(params[i]));
  }
  std::vector<at::Tensor> rg_buffers, plain_buffers;
  std::unordered_map<PyObject*, std::pair<bool, size_t>> buffer_index;
  for (const auto i : c10::irange(buffers.size())) {
    auto t = py::cast<at::Tensor>(buffers[i]);
    const bool rg = t.requires_grad() && !detach;
    auto& group = rg ? rg_buffers : plain_buffers;
    buffer_index.emplace(buffers[i].ptr(), std::make_pair(rg, group.size()));
    group.push_back(std::move(t));
  }

  // Every tensor must already be on devices[0]: name the first one that is not.
  auto check_source = [&](const std::vector<at::Tensor>& tensors, const char* what) {
    for (const auto& t : tensors) {
      if (detail::canonical(t.device()) != devices[0]) {
        std::string name = "?";
        const char* method = std::string(what) == "parameter" ? "named_parameters" : "named_buffers";
        for (auto item : network.attr(method)()) {
          auto pair = item.cast<py::tuple>();
          if (py::cast<at::Tensor>(pair[1]).unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
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
  check_source(param_tensors, "parameter");
  check_source(rg_buffers, "buffer");
  check_source(plain_buffers, "buffer");

  std::vector<std::vector<at::Tensor>> param_copies, rg_copies, plain_copies;
  {
    py::gil_scoped_release no_gil;
    auto broadcast = [&](const std::vector<at::Tensor>& tensors, bool differentiable) {
      if (tensors.empty()) {
        return std::vector<std::vector<at::Tensor>>(n);
      }
      return differentiable ? autograd::broadcast_coalesced(tensors, devices)
                            : comm::broadcast_coalesced(tensors, devices);
    };
    param_copies = broadcast(param_tensors, !detach);
    rg_copies = broadcast(rg_buffers, true);
    plain_copies = broadcast(plain_buffers, false);
  }

  // Python objects for the copies (the dev0 outputs of a detached broadcast are the originals).
  std::vector<py::list> py_params(n), py_rg(n), py_plain(n);
  for (const auto j : c10::irange(n)) {
    for (auto& t : param_copies[j]) {
      py_params[j].append(py::cast(t));
    }
    for (auto& t : rg_copies[j]) {
      py_rg[j].append(py::cast(t));
    }
    for (auto& t : plain_copies[j]) {
      py_plain[j].append(py::cast(t));
    }
  }

  // One shallow copy per module and device; _replicate_for_data_parallel keeps the overrides of
  // RNNBase, lazy modules, spectral norm, ScriptModule...
  std::vector<py::list> copies(n);
  for (const auto i : c10::irange(modules.size())) {
    py::handle module = modules[i];
    for (const auto j : c10::irange(n)) {
      py::object replica = module.attr("_replicate_for_data_parallel")();
      replica.attr("_former_parameters") = ordered_dict();
      copies[j].append(replica);
    }
  }

  py::object empty_like = py::module_::import("torch").attr("empty_like");
  for (const auto i : c10::irange(modules.size())) {
    py::handle module = modules[i];
    const std::string cls = py::str(py::type::of(module).attr("__qualname__"));
    // Children first, then parameters, then buffers (see Note [Replica assignment ...]).
    py::dict children = module.attr("_modules");
    for (auto item : children) {
      const auto key = item.first;
      for (const auto j : c10::irange(n)) {
        py::object replica = copies[j][i];
        if (item.second.is_none()) {
          replica.attr("_modules")[key] = py::none();
        } else {
          py::setattr(replica, key, copies[j][module_index.at(item.second.ptr())]);
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
        py::object copy = py_params[j][param_index.at(item.second.ptr())];
        py::setattr(replica, key, copy);
        replica.attr("_former_parameters")[key] = copy;
        if (!py::getattr(replica, key, py::none()).is(copy)) {
          if (py::isinstance(copy, torch_nn.attr("Parameter"))) {
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
        const auto where = buffer_index.at(item.second.ptr());
        py::object copy = where.first ? py_rg[j][where.second] : py_plain[j][where.second];
        py::dict replica_buffers = replica.attr("_buffers");
        if (overrides_setattr(replica, module_setattr)) {
          replica_buffers[key] = empty_like(copy);
        }
        py::setattr(replica, key, copy);
        replica_buffers = replica.attr("_buffers");
        if (!replica_buffers.contains(key) || !py::object(replica_buffers[key]).is(copy)) {
          replica_buffers[key] = copy;
          warn_once(cls, py::str(key), "buffer");
        }
      }
    }
  }
  return copies;
}

void check_replica_devices(const std::vector<py::list>& copies,
                           const std::vector<c10::Device>& devices_in, const std::string& api) {
  TORCH_CHECK(copies.size() == devices_in.size(), api, ": got ", copies.size(),
              " replicas but ", devices_in.size(), " devices");
  if (copies.empty()) {
    return;
  }
  const auto devices = normalize_devices(devices_in, api.c_str());
  for (const auto j : c10::irange(copies.size())) {
    const auto expected = devices[j];
    if (copies[j].empty()) {
      continue;
    }
    for (auto item : copies[j][0].attr("named_modules")()) {
      auto pair = item.cast<py::tuple>();
      const auto path = pair[0].cast<std::string>();
      py::object m = pair[1];
      auto check = [&](const std::string& key, py::handle value, const char* kind) {
        if (value.is_none() || !THPVariable_Check(value.ptr())) {
          return;
        }
        const auto t = py::cast<at::Tensor>(value);
        if (detail::canonical(t.device()) == expected) {
          return;
        }
        const auto qualified = path.empty() ? key : path + "." + key;
        TORCH_CHECK(false, api, ": replica ", j, " must live on ", expected, ", but its ", kind,
                    " '", qualified, "' (module ", path.empty() ? "<root>" : path, ", class ",
                    std::string(py::str(py::type::of(m).attr("__qualname__"))), ") is on ",
                    t.device(),
                    ". Register a post-replicate hook (torchdp.register_post_replicate_hook) that "
                    "puts it on the replica's device, e.g. `t.to(device)`");
      };
      py::dict former = m.attr("__dict__").attr("get")("_former_parameters", py::dict());
      for (auto p : former) {
        const auto key = py::str(p.first).cast<std::string>();
        check(key, py::getattr(m, p.first, py::none()), "parameter");
      }
      py::dict own_params = m.attr("_parameters");
      for (auto p : own_params) {
        check(py::str(p.first), p.second, "parameter");
      }
      py::dict own_buffers = m.attr("_buffers");
      for (auto b : own_buffers) {
        check(py::str(b.first), b.second, "buffer");
      }
    }
  }
}

} // namespace

void init_replicate(py::module_& m) {
  // wrap_pybind_function: c10 errors become the matching Python exceptions (RuntimeError,
  // ValueError, ...) and TORCH_WARN becomes a Python warning, as in torch's own bindings.
  m.def("replicate", torch::wrap_pybind_function(replicate), py::arg("network"), py::arg("devices"), py::arg("detach") = false,
        R"doc(Replicates a Python nn.Module onto `devices` (see csrc/python/API.md).

Returns one list per device with the replica of every module of list(network.modules()), in that
order; element [j][0] is the root replica on devices[j]. Parameters are broadcast differentiably unless
`detach`, buffers that require grad likewise, other buffers detached; the replica on devices[0] shares
storage with the original. Custom __setattr__ overrides that swallow the assignment are repaired
(with a one-time UserWarning per class and attribute). The original's tensors are never written.)doc");
  m.def(
      "check_replica_devices",
      torch::wrap_pybind_function(
          [](const std::vector<py::list>& copies, const std::vector<c10::Device>& devices,
             const std::string& api) { check_replica_devices(copies, devices, api); }),
      py::arg("copies"), py::arg("devices"), py::arg("api") = std::string(kApi),
      R"doc(Raises RuntimeError when a registered parameter or buffer of copies[j] is not on devices[j],
naming its qualified name, its device and the expected device.)doc");
}

} // namespace torchdp::python
