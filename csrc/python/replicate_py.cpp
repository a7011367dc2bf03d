// Bindings of the Python nn.Module replication: replicate, the device checks, buffer snapshots.
#include "replication.h"

#include <torchdp/devices.h>
#include <torchdp/enclosing_forward.h>
#include <torchdp/profiling.h>
#include <torchdp/replicate.h>

#include <c10/util/irange.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torchdp::python {
namespace {

using namespace replication;

struct Replicas {
  std::vector<py::list> copies;
  bool plain_only = false; // see Source::plain_only
};

Replicas replicate(py::handle network, const std::vector<c10::Device>& devices_in, bool detach,
                   std::optional<int64_t> grad_bucket_bytes) {
  if (devices_in.empty()) {
    return {};
  }
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
      const py::object former =
          PyDict_Check(e.dict.ptr()) ? dict_get_ref(e.dict.ptr(), r.key_former) : py::object();
      if (former && PyDict_Check(former.ptr())) {
        for_each_item(former.ptr(), [&](PyObject* key, PyObject*) {
          py::object current = dict_get_ref(e.dict.ptr(), key);
          if (!current) {
            current = py::getattr(e.module, key, py::none());
          }
          if (auto found = misplaced(current.ptr(), expected)) {
            fail(key, "parameter", *found);
          }
        });
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
        for_each_item(dict.ptr(), [&](PyObject* key, PyObject* value) {
          if (auto found = misplaced(value, expected)) {
            fail(key, kind, *found);
          }
        });
      }
    }
  }
}

// True when every parameter and buffer of `module` is on `device` (per-forward, so dicts only).
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
  bool on_device = true;
  for (const auto& e : net.modules) {
    for (const py::object* dict : {&e.params, &e.buffers}) {
      for_each_item(dict->ptr(), [&](PyObject*, PyObject* value) {
        on_device = on_device && !misplaced(value, device);
      });
      if (!on_device) {
        return false;
      }
    }
  }
  return true;
}

// The first named_parameters() / named_buffers() entry not on `device` (names only on failure).
std::optional<std::tuple<std::string, std::string, c10::Device>> misplaced_tensor(
    py::handle module, const c10::Device& device) {
  if (all_on_device(module, device)) {
    return std::nullopt;
  }
  const auto expected = detail::canonical(device);
  for (auto [method, kind] : {std::make_pair("named_parameters", "parameter"),
                              std::make_pair("named_buffers", "buffer")}) {
    for (auto item : module.attr(method)(py::arg("remove_duplicate") = false)) {
      const auto entry = py::reinterpret_borrow<py::tuple>(item);
      if (auto found = misplaced(entry[1].ptr(), expected)) {
        return std::make_tuple(std::string(kind), entry[0].cast<std::string>(), *found);
      }
    }
  }
  return std::nullopt; // a module whose named_* disagree with parameters()/buffers()
}

// The Python form of detail::EnclosingForwardGuard, a context manager (Note [Nested forwards]).
struct EnclosingForward {
  explicit EnclosingForward(uint64_t take) : take(take) {}
  uint64_t take;
  std::optional<torchdp::detail::EnclosingForwardGuard> guard;
};

} // namespace

void init_replicate(py::module_& m) {
  // wrap_pybind_function: torch's error and warning translation, as in torch's own bindings.
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
          // Converting to the return type explicitly: an implicit move from py::list to
          // py::object is C++20 only, and there std::move is redundant.
          return py::object(std::move(copies));
        }),
        py::arg("network"), py::arg("devices"), py::arg("detach") = false,
        py::arg("grad_bucket_bytes") = py::none(), py::kw_only(), py::arg("report") = false,
        "Replicas of every module of list(network.modules()) on every device (see "
        "python/torchdp/_C.pyi).");
  replication::init_replica_cache(m);
  m.def("check_replica_devices",
        torch::wrap_pybind_function([](const std::vector<py::list>& copies,
                                       const std::vector<c10::Device>& devices,
                                       const std::string& api) {
          check_replica_devices(copies, devices, api);
        }),
        py::arg("copies"), py::arg("devices"), py::arg("api") = std::string(kApi),
        "RuntimeError naming the tensor when a parameter or buffer of the replica rooted at "
        "copies[j][0] is not on devices[j].");
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
  py::class_<EnclosingForward>(m, "EnclosingForward",
                               R"doc(with EnclosingForward(snapshot): the replicas run inside the
block belong to the forward `snapshot` was taken for (Note [Nested forwards]).)doc")
      .def(py::init([](const torchdp::BufferSnapshot& snapshot) {
             return new EnclosingForward(snapshot.take_id());
           }),
           py::arg("snapshot"))
      .def("__enter__",
           [](EnclosingForward& self) {
             self.guard.emplace(self.take);
           })
      .def("__exit__", [](EnclosingForward& self, const py::args&) {
        self.guard.reset();
      });
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
  m.def("misplaced_tensor", torch::wrap_pybind_function(misplaced_tensor), py::arg("module"),
        py::arg("device"),
        R"doc(None when every parameter and buffer of `module` is on `device`, else the first one
that is not, as (kind, qualified name, device): DataParallel's placement check.)doc");
}

} // namespace torchdp::python
