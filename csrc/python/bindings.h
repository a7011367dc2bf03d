#pragma once

// Shared declarations of the torchdp._C extension (csrc/python). Every binding translation unit
// includes this header first, so that all of them see the same pybind11 type casters: torch's
// (torch.Tensor <-> at::Tensor, torch.device <-> c10::Device, ...) from
// <torch/csrc/utils/pybind.h>, which also brings <pybind11/pybind11.h> and <pybind11/stl.h>
// (std::vector, std::optional, ...). The pybind11 headers are the ones inside torch's include
// folder (see the Python section of the top-level CMakeLists.txt), so the module's pybind11 ABI is
// torch's.

#include <torch/csrc/Exceptions.h> // HANDLE_TH_ERRORS
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <utility>

#if defined(__GLIBCXX__)
#include <cxxabi.h> // abi::__forced_unwind
// A forced unwind has no exception object: UBSan would report its catch clause as a null
// reference binding.
#define TORCHDP_CATCHES_FORCED_UNWIND __attribute__((no_sanitize("null")))
#else
#define TORCHDP_CATCHES_FORCED_UNWIND
#endif

namespace torchdp::python {

/// True once the interpreter has begun to finalize.
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Note [Taking the GIL at interpreter exit]
// Before 3.14, CPython ends a thread that asks for the GIL once the interpreter finalizes: it
// calls pthread_exit, whose unwinding runs every C++ destructor above, and these destroy Python
// objects without the GIL (a crash while the main thread collects garbage), or std::terminate the
// process when the request came from a destructor (noexcept). torchdp takes the GIL only through
// the helpers below, which park such a thread for good instead, as CPython 3.14 does: it holds no
// lock then, and the process is exiting. The other threads are never affected.

/// Blocks the calling thread until the process ends.
[[noreturn]] void park_until_exit();

/// PyEval_RestoreThread, parking the thread (never unwinding it) at interpreter exit.
void restore_thread(PyThreadState* state);

/// Holds the GIL for its scope, on any thread (PyGILState_Ensure), parking the thread at
/// interpreter exit.
class GilAcquire {
 public:
  GilAcquire();
  ~GilAcquire() {
    PyGILState_Release(state_);
  }
  GilAcquire(const GilAcquire&) = delete;
  GilAcquire& operator=(const GilAcquire&) = delete;

 private:
  PyGILState_STATE state_;
};

/// Releases the GIL for its scope. Taking it back never unwinds the thread (restore_thread), so
/// it is safe from the destructor too.
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease() {
    if (state_ != nullptr) {
      restore_thread(state_);
    }
  }
  void reacquire() {
    PyThreadState* state = state_;
    state_ = nullptr;
    restore_thread(state);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

template <typename F, typename R, typename... Args>
auto without_gil_impl(F f, R (F::*)(Args...) const) {
  return [f = std::move(f)](Args... args) -> R {
    HANDLE_TH_ERRORS
    GilRelease no_gil;
    return f(std::forward<Args>(args)...);
    END_HANDLE_TH_ERRORS_PYBIND
  };
}

/// Wraps a lambda for pybind11: torch's error and warning translation (HANDLE_TH_ERRORS), with
/// the GIL released while it runs (GilRelease).
template <typename F>
auto without_gil(F f) {
  return without_gil_impl(std::move(f), &F::operator());
}

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
