// The torchdp._C module definition and the GIL helpers of bindings.h; the bindings live in
// bind_*.cpp and replicate_*.cpp. See python/torchdp/_C.pyi for the interface.

#include "bindings.h"
#include "replication.h"

#include <torchdp/config.h>

#include <chrono>
#include <thread>

namespace torchdp::python {

// Note [Taking the GIL at interpreter exit] (bindings.h).
void park_until_exit() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

TORCHDP_CATCHES_FORCED_UNWIND void restore_thread(PyThreadState* state) {
#if defined(__GLIBCXX__)
  try {
    PyEval_RestoreThread(state);
  } catch (abi::__forced_unwind&) {
    park_until_exit();
  }
#else
  PyEval_RestoreThread(state);
#endif
}

TORCHDP_CATCHES_FORCED_UNWIND GilAcquire::GilAcquire() {
#if defined(__GLIBCXX__)
  try {
    state_ = PyGILState_Ensure();
  } catch (abi::__forced_unwind&) {
    park_until_exit();
  }
#else
  state_ = PyGILState_Ensure();
#endif
}

} // namespace torchdp::python

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif

// Note [Free-threaded Python] (py_dict.h): safe without the GIL; a no-op on GIL builds.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m, pybind11::mod_gil_not_used()) {
  // torch's Python types exist only once torch._C initialises (THPVariableClass); torchdp imports
  // torch first, this covers a direct `import torchdp._C`.
  pybind11::module_::import("torch");
  // Made here, on one thread: a first use racing in several threads would wait on C++'s static
  // initialisation guard while the first runs Python code (imports), a deadlock without the GIL.
  (void)torchdp::python::replication::refs();

  m.doc() = "torchdp._C: C++ core of torchdp (DataParallel for LibTorch), bound with pybind11.";
  m.attr("__version__") = TORCHDP_VERSION;

  torchdp::python::init_core(m);
  torchdp::python::init_replicate(m);
  torchdp::python::init_data_parallel(m);
  torchdp::python::init_process_group(m);
  torchdp::python::init_reduction(m);
}
