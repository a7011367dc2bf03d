#pragma once

// Replication of *Python* nn.Modules (python/torchdp/_C.pyi, DESIGN.md "Replicating Python
// modules"): replicate_walk.cpp, replicate_build.cpp, replicate_cache.cpp; replicate_py.cpp binds.
#include "bindings.h"
#include "py_dict.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchdp::python::replication {

namespace py = pybind11;

inline constexpr const char* kApi = "torchdp.replicate";

PyObject* interned(const char* text);

// The names of the hook containers nn.Module.__init__ gives every instance (_forward_hooks, ...,
// _non_persistent_buffers_set), read from a new module (Note [Replicas own their instance state]).
std::vector<py::object> module_state_keys(py::handle module_type);

// Python objects used on every call, looked up once and never destroyed (at exit that would crash).
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
  py::object partial_type = py::module_::import("functools").attr("partial");
  py::object function_type = py::module_::import("types").attr("FunctionType");
  std::vector<py::object> state_keys = module_state_keys(module_type);
};

const PythonRefs& refs();

py::object steal_or_throw(PyObject* o);
void dict_set(PyObject* dict, PyObject* key, PyObject* value);
// The instance __dict__ of a module (never through a __getattr__ override).
py::object instance_dict(py::handle obj);

struct TypeInfo {
  bool plain = false;     // built with dictionary operations (Note [Two ways to build a replica])
  bool script = false;    // a torch.jit.ScriptModule
  bool optimized = false; // torch.compile's module wrapper (Note [Replicating compiled modules])
  bool walkable = false;  // named_modules() / modules() are nn.Module's
  bool overrides_setattr = false;
  // __slots__: what a forward stores there would survive in a kept replica (Note [Kept replicas]).
  bool slots = false;
};

// Per-call cache of what a module class allows (classes can be patched between calls).
class TypeTable {
 public:
  const TypeInfo& of(py::handle obj);

 private:
  py::object optimized_module_type();

  std::unordered_map<PyTypeObject*, TypeInfo> table_;
  bool optimized_looked_up_ = false;
  py::object optimized_type_;
};

// One module of the network; each dict is an exact dict, or an empty object when it is not one.
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

// network.modules(): pre-order, each module once, None children skipped.
Network walk_network(py::handle network, TypeTable& types);

// list(network.parameters()) and list(network.buffers()), from the dicts when the walk was exact.
std::pair<py::list, py::list> parameters_and_buffers(py::handle network, const Network& net);

// The qualified name of `module` inside `root` ("" for the root itself).
std::string path_in(py::handle root, py::handle module);

// The tensor of a registered parameter or buffer; a TypeError for anything else.
const at::Tensor& tensor_of(py::handle value, const char* kind);

// The dictionaries of a replica built with dictionary operations.
struct ReplicaDicts {
  py::object dict, params, buffers, modules, former;
  // The replica's own hook containers, one per refs().state_keys entry (None until made), kept
  // with a kept replica (Note [Replicas own their instance state]).
  py::object state;
};

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
  // A tensor that parameters() / buffers() do not list has no copy (PyTorch raises KeyError).
  [[noreturn]] static void unlisted(const char* kind, const char* method) {
    TORCH_CHECK(false, kApi, ": a module registers a ", kind, " that the root module's ", method,
                " does not list (does the root override ", method,
                ", e.g. to yield only trainable parameters?). Replicate needs every registered ",
                kind, ": keep nn.Module's ", method,
                " and filter where the list is used (e.g. the optimizer's parameters)");
  }
};

// What one replicate call learns before its transfer; never moved (entries point into `types`).
struct Source {
  TypeTable types;
  Network net;
  TensorCopies tensors;
  std::vector<c10::Device> devices;
  std::vector<at::Tensor> param_tensors, rg_buffers, plain_buffers;
  bool detach = false;
  // No global registration hooks (Note [Two ways to build a replica]).
  bool fast = true;
  // All dictionary operations, none compiled: no device check needed without hooks or callbacks.
  bool plain_only = true;
  // plain_only, and no class with __slots__: the replicas may be kept (Note [Kept replicas]).
  bool keepable = true;
};

// The module.compile() call in a module's instance __dict__, or an empty object.
py::object compiled_call(const ModuleEntry& e);

inline bool dict_ops(const Source& s, const ModuleEntry& e) {
  return e.plain && (s.fast || e.type->optimized);
}

// The walk: the modules and their tensors, checked to be on devices[0].
void prepare(Source& s, py::handle network, const std::vector<c10::Device>& devices_in,
             bool detach);

// The broadcast of every tensor (differentiable unless detached) into s.tensors.
void transfer(Source& s, std::optional<int64_t> grad_bucket_bytes);

// New replicas, one list per device; `dicts[j][i]` gets those built with dictionary operations.
std::vector<py::list> build(const Source& s, std::vector<std::vector<ReplicaDicts>>& dicts);

// The dictionaries of a plain replica as _replicate_for_data_parallel leaves them, in `d`.
void fill_plain_dicts(const ModuleEntry& e, const ReplicaDicts& d);

// Children, parameters and buffers of plain replica copies[j][i], with dictionary operations.
void wire_plain(const ModuleEntry& e, size_t j, const std::vector<py::list>& copies,
                const std::vector<std::vector<ReplicaDicts>>& dicts, size_t i, const Network& net,
                const TensorCopies& tensors, bool may_hold_originals);

// Gives replica copies[j][i] (instance __dict__ `replica_dict`) its own hook containers, reusing
// those in the list `kept` when given, and rebinds the values bound to the network's modules to
// the replicas of device j (Note [Replicas own their instance state], replicate_own_state.cpp).
void own_instance_state(const ModuleEntry& e, size_t j, const std::vector<py::list>& copies,
                        const Network& net, py::handle replica_dict, py::handle kept);

// Binds torchdp._C.ReplicaCache (replicate_cache.cpp).
void init_replica_cache(py::module_& m);

} // namespace torchdp::python::replication
