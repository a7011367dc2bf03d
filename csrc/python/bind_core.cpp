// The core section of torchdp._C (see python/torchdp/_C.pyi); the algorithms live in csrc/torchdp.
// Every binding runs inside HANDLE_TH_ERRORS (c10 errors become the matching Python exceptions,
// TORCH_WARN a UserWarning) and, unless noted, releases the GIL while C++ works.

#include "bindings.h"

#include <torchdp/autograd.h>
#include <torchdp/comm.h>
#include <torchdp/devices.h>
#include <torchdp/parallel_apply.h>
#include <torchdp/shares.h>

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace torchdp::python {

// A gather's pad value: a Python bool, int, float or complex, or None. torch's pybind11 caster of
// c10::Scalar only converts to Python, so this one converts from it.
struct PadValue {
  std::optional<at::Scalar> value;
};

} // namespace torchdp::python

namespace pybind11::detail {

template <>
struct type_caster<torchdp::python::PadValue> {
  PYBIND11_TYPE_CASTER(torchdp::python::PadValue, const_name("complex | None"));

  bool load(handle src, bool /*convert*/) {
    PyObject* o = src.ptr();
    if (src.is_none()) {
      value.value = std::nullopt;
    } else if (PyBool_Check(o)) {
      value.value = at::Scalar(o == Py_True);
    } else if (PyLong_Check(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      value.value = at::Scalar(static_cast<int64_t>(v));
    } else if (PyFloat_Check(o)) {
      value.value = at::Scalar(PyFloat_AsDouble(o));
    } else if (PyComplex_Check(o)) {
      value.value =
          at::Scalar(c10::complex<double>(PyComplex_RealAsDouble(o), PyComplex_ImagAsDouble(o)));
    } else {
      return false;
    }
    return true;
  }
};

} // namespace pybind11::detail

namespace torchdp::python {
namespace {

size_t checked_buffer_size(int64_t buffer_size, const char* api) {
  TORCH_CHECK_VALUE(buffer_size > 0, api, ": buffer_size must be a positive number of bytes, got ",
                    buffer_size);
  return static_cast<size_t>(buffer_size);
}

// Note [Python callables on parallel_run workers]
// The caller waits without the GIL; each task takes it to call its function. Python objects (the
// result and error slots) are created and destroyed only with the GIL held. A Python exception is
// kept as (type, value, traceback), never thrown as C++, so parallel_run does not wrap it: the
// lowest-index one is re-raised as is (callers wrap their fns for "Caught X in replica i").
struct PythonError {
  py::object type;
  py::object value;
  py::object trace;

  // Raises it again when set (with the GIL held).
  void raise_if_set() {
    if (type) {
      PyErr_Restore(type.release().ptr(), value.release().ptr(), trace.release().ptr());
      throw py::error_already_set();
    }
  }
};

// Note [Serial replicas]
// Threads running Python forwards hand the GIL back and forth at every ATen call. serial=True runs
// the functions in order on the calling thread, each with its device current; same results and
// error rule, except that a non-Exception (KeyboardInterrupt, SystemExit) is raised at once.
// No C++ frame between Python and the catch (Note [Taking the GIL at interpreter exit]).
TORCHDP_CATCHES_FORCED_UNWIND py::object call_no_args(const py::function& fn) {
  PyObject* result = nullptr;
#if defined(__GLIBCXX__)
  try {
    result = PyObject_CallNoArgs(fn.ptr());
  } catch (abi::__forced_unwind&) {
    park_until_exit();
  }
#else
  result = PyObject_CallNoArgs(fn.ptr());
#endif
  if (result == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(result);
}

py::list run_serially(const std::vector<py::function>& fns,
                      const std::vector<c10::Device>& devices) {
  const size_t n = fns.size();
  std::vector<py::object> results(n);
  std::vector<PythonError> errors(n);
  for (const auto i : c10::irange(n)) {
    c10::OptionalDeviceGuard guard;
    if (devices[i].type() != c10::kCPU && devices[i].type() != c10::kMeta) {
      guard.reset_device(devices[i]);
    }
    try {
      results[i] = call_no_args(fns[i]);
    } catch (py::error_already_set& e) {
      if (PyErr_GivenExceptionMatches(e.type().ptr(), PyExc_Exception) == 0) {
        throw; // KeyboardInterrupt, SystemExit: the remaining functions do not run
      }
      errors[i] = PythonError{e.type(), e.value(), e.trace()};
    }
  }
  for (auto& error : errors) {
    error.raise_if_set();
  }
  py::list out;
  for (auto& result : results) {
    out.append(std::move(result));
  }
  return out;
}

// Note [Ctrl-C while replicas run]
// A caller waiting without the GIL gets no signals, so the wait polls the signal handlers
// (Note [Interruptible waits]). When one raises, or function 0 raised a non-Exception,
// parallel_apply raises it at once, as torch.nn.parallel does; running replicas finish alone.
// Tasks may thus outlive the call: their shared state is destroyed with the GIL (make_python_run).
struct PythonRun {
  explicit PythonRun(const std::vector<py::function>& fns)
      : fns(fns), results(fns.size()), python_errors(fns.size()), cpp_failed(fns.size(), 0) {}
  std::vector<py::function> fns;
  std::vector<py::object> results;
  std::vector<PythonError> python_errors;
  // Set by tasks that failed with a C++ exception (which parallel_run rethrows, wrapped).
  std::vector<char> cpp_failed;
};

int delete_python_run(void* run) {
  delete static_cast<PythonRun*>(run);
  return 0;
}

// Destroyed with the GIL held; a task that outlived its call hands it over as a pending call.
std::shared_ptr<PythonRun> make_python_run(const std::vector<py::function>& fns) {
  return std::shared_ptr<PythonRun>(new PythonRun(fns), [](PythonRun* run) {
    if (interpreter_finalizing()) {
      return; // an abandoned task ending at exit: leave its Python objects alone
    }
    if (PyGILState_Check()) {
      delete run;
    } else if (Py_AddPendingCall(&delete_python_run, run) != 0) {
      // Queue full or interpreter gone: leak rather than touch Python objects without the GIL.
    }
  });
}

TORCHDP_CATCHES_FORCED_UNWIND py::list parallel_apply(const std::vector<py::function>& fns,
                                                      const std::vector<c10::Device>& devices_in,
                                                      bool serial) {
  constexpr const char* api = "torchdp.parallel_apply";
  HANDLE_TH_ERRORS
  TORCH_CHECK_VALUE(fns.size() == devices_in.size(), api, ": got ", fns.size(), " functions but ",
                    devices_in.size(), " devices; pass one device per function");
  const size_t n = fns.size();
  py::list out;
  if (n == 0) {
    return out;
  }
  if (serial) {
    return run_serially(fns, normalize_devices(devices_in, api));
  }
  std::vector<c10::Device> devices;
  auto state = make_python_run(fns);
  // Raised by a signal handler while the caller waited (Note [Ctrl-C while replicas run]).
  PythonError interrupt;
  {
    GilRelease no_gil; // Note [Python callables on parallel_run workers]
    devices = normalize_devices(devices_in, api);
    const auto task = [state](size_t i) {
      GilAcquire gil; // Note [Taking the GIL at interpreter exit]
      try {
        state->results[i] = call_no_args(state->fns[i]);
      } catch (py::error_already_set& e) {
        state->python_errors[i] = PythonError{e.type(), e.value(), e.trace()};
      } catch (...) {
        state->cpp_failed[i] = 1;
        throw;
      }
    };
    const auto interrupted = [&interrupt, &state] {
      GilAcquire gil;
      // The signal may have reached the caller while it ran function 0 instead.
      const auto& first = state->python_errors[0].type;
      if (first && PyErr_GivenExceptionMatches(first.ptr(), PyExc_Exception) == 0) {
        return true;
      }
      if (PyErr_CheckSignals() == 0) {
        return false;
      }
      py::error_already_set e;
      interrupt = PythonError{e.type(), e.value(), e.trace()};
      return true;
    };
    try {
      parallel_run(n, devices, task, interrupted);
#if defined(__GLIBCXX__)
    } catch (abi::__forced_unwind&) {
      park_until_exit(); // Note [Taking the GIL at interpreter exit]
#endif
    } catch (const Interrupted&) {
      // Handled below, with the GIL.
    } catch (...) {
      // A C++ failure: it wins only when no lower-index task raised a Python exception.
      size_t first_cpp = n;
      for (size_t i = 0; i < n; ++i) {
        if (state->cpp_failed[i]) {
          first_cpp = i;
          break;
        }
      }
      bool python_first = false;
      for (size_t i = 0; i < first_cpp; ++i) {
        // No refcounting: only the truth of the handle is read.
        python_first = python_first || static_cast<bool>(state->python_errors[i].type);
      }
      if (!python_first) {
        throw;
      }
    }
    no_gil.reacquire();
  }
  interrupt.raise_if_set();
  for (size_t i = 0; i < n; ++i) {
    state->python_errors[i].raise_if_set();
  }
  for (auto& result : state->results) {
    out.append(std::move(result));
  }
  return out;
  END_HANDLE_TH_ERRORS_PYBIND
}

} // namespace

void init_core(py::module_& m) {
  m.def("has_cuda", without_gil([]() {
          return torchdp::has_cuda();
        }),
        "True when torchdp was compiled with its CUDA fast paths and CUDA devices are visible.");

  m.def("has_nccl", without_gil([]() {
          return torchdp::has_nccl();
        }),
        "True when torchdp was compiled with its NCCL transport.");

  m.def("cuda_device_count", without_gil([]() {
          return torchdp::cuda_device_count();
        }),
        "The number of visible CUDA devices (0 on CPU-only builds or machines).");

  m.def("check_forward_context", torch::wrap_pybind_function([](const std::string& api) {
          torchdp::detail::check_forward_context(api.c_str());
        }),
        py::arg("api"),
        R"doc(Raises RuntimeError naming ``api`` where a data-parallel forward cannot run: under
torch.jit.trace and inside torch.func transforms.)doc");

  m.def("check_output_device",
        torch::wrap_pybind_function([](const std::vector<c10::Device>& devices, c10::Device output,
                                       const std::string& api) {
          torchdp::check_output_device(devices, output, api.c_str());
        }),
        py::arg("devices"), py::arg("output"), py::arg("api"),
        R"doc(Raises ValueError for an output device the gradients cannot come back from (meta
when a device of the list holds data).)doc");

  m.def("normalize_devices",
        without_gil([](const std::vector<c10::Device>& devices, const std::string& api) {
          return torchdp::normalize_devices(devices, api.c_str());
        }),
        py::arg("devices"), py::arg("api"),
        "Normalised devices (``cpu:0`` -> ``cpu``, ``cuda`` -> the current CUDA device); "
        "RuntimeError naming ``api`` for an unusable one.");

  m.def("broadcast_coalesced",
        without_gil([](const std::vector<at::Tensor>& tensors,
                       const std::vector<c10::Device>& devices, int64_t buffer_size,
                       bool differentiable) {
          if (differentiable) {
            return torchdp::autograd::broadcast_coalesced(
                tensors, devices,
                checked_buffer_size(buffer_size, "torchdp::autograd::broadcast_coalesced"));
          }
          return torchdp::comm::broadcast_coalesced(
              tensors, devices,
              checked_buffer_size(buffer_size, "torchdp::comm::broadcast_coalesced"));
        }),
        py::arg("tensors"), py::arg("devices"),
        py::arg("buffer_size") = static_cast<int64_t>(torchdp::comm::kDefaultBufferSize),
        py::arg("differentiable") = false,
        "Copies ``tensors`` (on ``devices[0]``) to every device, in flat buckets of "
        "``buffer_size`` bytes; one list per device.");

  m.def("reduce_add_coalesced",
        without_gil([](const std::vector<std::vector<at::Tensor>>& per_device,
                       c10::Device destination, int64_t buffer_size, bool differentiable) {
          if (differentiable) {
            return torchdp::autograd::reduce_add_coalesced(
                per_device, destination,
                checked_buffer_size(buffer_size, "torchdp::autograd::reduce_add_coalesced"));
          }
          return torchdp::comm::reduce_add_coalesced(
              per_device, destination,
              checked_buffer_size(buffer_size, "torchdp::comm::reduce_add_coalesced"));
        }),
        py::arg("per_device"), py::arg("destination"),
        py::arg("buffer_size") = static_cast<int64_t>(torchdp::comm::kDefaultBufferSize),
        py::arg("differentiable") = false,
        "Sums ``per_device[j][k]`` over ``j`` into one tensor per ``k`` on ``destination``.");

  m.def("scatter",
        without_gil([](const at::Tensor& tensor, const std::vector<c10::Device>& devices,
                       const std::optional<std::vector<int64_t>>& chunk_sizes, int64_t dim,
                       bool differentiable) {
          if (differentiable) {
            return torchdp::autograd::scatter(tensor, devices, chunk_sizes, dim);
          }
          return torchdp::comm::scatter(tensor, devices, chunk_sizes, dim);
        }),
        py::arg("tensor"), py::arg("devices"), py::arg("chunk_sizes") = py::none(),
        py::arg("dim") = 0, py::arg("differentiable") = true,
        "Splits ``tensor`` along ``dim``, chunk ``i`` on ``devices[i]`` (``tensor.chunk``: maybe "
        "fewer chunks).");

  m.def("gather",
        without_gil([](const std::vector<at::Tensor>& tensors, c10::Device destination, int64_t dim,
                       bool differentiable, const PadValue& pad) {
          if (differentiable) {
            return torchdp::autograd::gather(tensors, destination, dim, pad.value);
          }
          return torchdp::comm::gather(tensors, destination, dim, pad.value);
        }),
        py::arg("tensors"), py::arg("destination"), py::arg("dim") = 0,
        py::arg("differentiable") = true, py::arg("pad_value") = py::none(),
        "Concatenates ``tensors`` along ``dim`` on ``destination``; with ``pad_value``, tensors "
        "that differ in other dimensions are padded at their end to the largest size.");

  m.def("scatter_leaves",
        without_gil([](const std::vector<at::Tensor>& tensors,
                       const std::vector<c10::Device>& devices, int64_t dim) {
          // One autograd::scatter per tensor; replica i gets chunk i of each, for as many
          // replicas as the tensor with the fewest chunks gives (zip's truncation).
          std::vector<std::vector<at::Tensor>> chunks;
          chunks.reserve(tensors.size());
          size_t n = devices.size();
          for (const auto& tensor : tensors) {
            chunks.push_back(torchdp::autograd::scatter(tensor, devices, std::nullopt, dim));
            n = std::min(n, chunks.back().size());
          }
          std::vector<std::vector<at::Tensor>> per_replica(n);
          for (const auto i : c10::irange(n)) {
            per_replica[i].reserve(chunks.size());
            for (auto& tensor_chunks : chunks) {
              per_replica[i].push_back(std::move(tensor_chunks[i]));
            }
          }
          return per_replica;
        }),
        py::arg("tensors"), py::arg("devices"), py::arg("dim") = 0,
        "Differentiable ``scatter`` of every tensor at once: one list of chunks per replica, "
        "as many replicas as the fewest chunks of a tensor.");

  m.def("share_rows",
        without_gil([](const std::vector<double>& shares, int64_t rows, size_t devices,
                       const std::string& api) {
          return torchdp::share_rows(shares, rows, devices, api.c_str());
        }),
        py::arg("shares"), py::arg("rows"), py::arg("devices"), py::arg("api"),
        "The rows of a batch of ``rows`` rows each of ``devices`` devices gets (Note [Uneven "
        "shares]); ValueError naming ``api`` for shares that do not fit.");

  m.def("scatter_shares",
        without_gil([](const std::vector<at::Tensor>& tensors,
                       const std::vector<c10::Device>& devices, const std::vector<double>& shares,
                       int64_t dim, const std::string& api) {
          auto split = torchdp::detail::scatter_shares(
              tensors, devices, shares, dim, api.c_str(), [](size_t k) {
                return c10::str("tensor ", k, " of the input");
              });
          return std::make_pair(std::move(split.index), std::move(split.parts));
        }),
        py::arg("tensors"), py::arg("devices"), py::arg("shares"), py::arg("dim"), py::arg("api"),
        "``scatter_leaves`` by the rows ``shares`` give each device: ``(index, per_replica)``, "
        "replica i on ``devices[index[i]]``; devices without rows get none.");

  m.def("scatter_items",
        without_gil([](const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& item_of,
                       int64_t items, const std::vector<c10::Device>& devices,
                       const std::optional<std::vector<double>>& shares, int64_t dim,
                       const std::string& api, const std::vector<std::string>& names) {
          auto split = torchdp::detail::scatter_items(
              tensors, item_of, items, devices, shares, dim, api.c_str(), [&names](size_t k) {
                return k < names.size() ? names[k] : c10::str("tensor ", k, " of the input");
              });
          return std::make_tuple(std::move(split.index), std::move(split.begin),
                                 std::move(split.count), std::move(split.parts));
        }),
        py::arg("tensors"), py::arg("item_of"), py::arg("items"), py::arg("devices"),
        py::arg("shares"), py::arg("dim"), py::arg("api"), py::arg("names"),
        "Split by item (Note [Lists of samples]): ``(index, begin, count, per_replica)``, "
        "replica i on ``devices[index[i]]`` with items ``begin[i]:begin[i] + count[i]``; its "
        "list holds None for the other replicas' items.");

  m.def(
      "check_batch_lists",
      [](const std::vector<std::pair<std::string, std::vector<std::vector<int64_t>>>>& lists,
         size_t devices, int64_t dim, const std::string& api, const std::string& option) {
        std::vector<torchdp::detail::BatchList> described;
        for (const auto& [name, shapes] : lists) {
          described.push_back({name, shapes});
        }
        torchdp::detail::check_batch_lists(described, devices, dim, api.c_str(), option.c_str());
      },
      py::arg("lists"), py::arg("devices"), py::arg("dim"), py::arg("api"), py::arg("option"),
      "ValueError for a list of tensors, given as ``(name, shapes)``, that cannot be one "
      "batch (Note [Lists of samples]).");

  m.def(
      "gather_samples",
      without_gil([](const std::vector<std::vector<at::Tensor>>& outputs, c10::Device destination) {
        return torchdp::gather_samples(outputs, destination);
      }),
      py::arg("outputs"), py::arg("destination"),
      "The replicas' per-sample tensors in one list on ``destination``, in order.");

  m.def("gather_leaves",
        without_gil([](const std::vector<std::vector<at::Tensor>>& groups, c10::Device destination,
                       int64_t dim, const PadValue& pad) {
          std::vector<at::Tensor> out;
          out.reserve(groups.size());
          for (const auto& group : groups) {
            out.push_back(torchdp::autograd::gather(group, destination, dim, pad.value));
          }
          return out;
        }),
        py::arg("groups"), py::arg("destination"), py::arg("dim") = 0,
        py::arg("pad_value") = py::none(),
        "Differentiable ``gather`` of each group of tensors (one from each replica) at once, "
        "padded as ``gather`` with ``pad_value``.");

  m.def("parallel_apply", &parallel_apply, py::arg("fns"), py::arg("devices"),
        py::arg("serial") = false,
        "``[fns[0](), fns[1](), ...]``, ``fns[i]`` on worker ``i`` with ``devices[i]`` current; "
        "re-raises the lowest-index exception as is.");
}

} // namespace torchdp::python
