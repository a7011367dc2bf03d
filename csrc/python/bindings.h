#pragma once

// Included first by every binding file: torch's pybind11 type casters, and the pybind11 headers
// inside torch's include folder, so the module's pybind11 ABI is torch's.

#include <torch/csrc/Exceptions.h> // HANDLE_TH_ERRORS
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <utility>

#if defined(__GLIBCXX__)
#include <cxxabi.h> // abi::__forced_unwind
// A forced unwind has no exception object: UBSan would flag its catch as a null reference binding.
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
// Before 3.14, CPython ends a thread that asks for the GIL once the interpreter finalizes with
// pthread_exit, whose unwinding runs the C++ destructors above: they destroy Python objects without
// the GIL (a crash), or std::terminate when the request came from a noexcept destructor. torchdp
// takes the GIL only through the helpers below, which park such a thread for good instead, as
// CPython 3.14 does: it holds no lock, and the process is exiting.

/// Blocks the calling thread until the process ends.
[[noreturn]] void park_until_exit();

/// PyEval_RestoreThread, parking the thread (never unwinding it) at interpreter exit.
void restore_thread(PyThreadState* state);

/// Holds the GIL for its scope, on any thread (PyGILState_Ensure), parking it at interpreter exit.
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

/// Releases the GIL for its scope; taking it back never unwinds the thread, even in the destructor.
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

/// Wraps a lambda for pybind11 with torch's error translation (HANDLE_TH_ERRORS), GIL released.
template <typename F>
auto without_gil(F f) {
  return without_gil_impl(std::move(f), &F::operator());
}

/// The core section of torchdp._C (bind_core.cpp): runtime queries, transport, parallel_apply.
void init_core(pybind11::module_& m);

/// Python nn.Module replication (replicate_*.cpp): replicate, ReplicaCache, check_replica_devices.
void init_replicate(pybind11::module_& m);

/// DataParallel's checks of options and module (csrc/python/bind_data_parallel.cpp).
void init_data_parallel(pybind11::module_& m);

/// ProcessGroupSync (bind_process_group.cpp), when torchdp is built with c10d.
void init_process_group(pybind11::module_& m);

/// The loss reduction names (bind_reduction.cpp).
void init_reduction(pybind11::module_& m);

} // namespace torchdp::python
