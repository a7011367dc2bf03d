#pragma once

// Shared declarations of the torchdp._C extension (csrc/python). Every binding translation unit
// includes this header first, so that all of them see the same pybind11 type casters: torch's
// (torch.Tensor <-> at::Tensor, torch.device <-> c10::Device, ...) from
// <torch/csrc/utils/pybind.h>, which also brings <pybind11/pybind11.h> and <pybind11/stl.h>
// (std::vector, std::optional, ...). The pybind11 headers are the ones inside torch's include
// folder (see the Python section of the top-level CMakeLists.txt), so the module's pybind11 ABI is
// torch's.

#include <torch/csrc/Exceptions.h> // HANDLE_TH_ERRORS, torch::wrap_pybind_function_no_gil
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

namespace torchdp::python {

/// True once the interpreter has begun to finalize.
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

/// Releases the GIL for its scope, for waits that may outlast the interpreter. At exit CPython
/// ends a daemon thread that asks for the GIL back (pthread_exit); asked from a destructor, that
/// unwinding would std::terminate the process. So normal paths take the GIL back with
/// reacquire(), and the destructor (exception paths) only while the interpreter is not
/// finalizing (then the thread is ending anyway).
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease() {
    if (state_ != nullptr && !interpreter_finalizing()) {
      PyEval_RestoreThread(state_);
    }
  }
  void reacquire() {
    PyThreadState* state = state_;
    state_ = nullptr;
    PyEval_RestoreThread(state);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

/// The core section of torchdp._C (csrc/python/bind_core.cpp): runtime queries, device
/// normalisation, the comm / autograd transport functions and parallel_apply.
void init_core(pybind11::module_& m);

/// Python nn.Module replication (csrc/python/replicate_*.cpp, replication.h): replicate,
/// ReplicaCache, check_replica_devices.
void init_replicate(pybind11::module_& m);

/// DataParallel's checks of options and module (csrc/python/bind_data_parallel.cpp).
void init_data_parallel(pybind11::module_& m);

/// Gradient averaging across processes (csrc/python/bind_process_group.cpp): ProcessGroupSync,
/// when torchdp is built with c10d.
void init_process_group(pybind11::module_& m);

/// Support for torchdp's own tests (csrc/python/bind_testing.cpp): torchdp._C._testing.
void init_testing(pybind11::module_& m);

} // namespace torchdp::python
