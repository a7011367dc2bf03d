// The checks of DataParallel's options and module (csrc/torchdp/data_parallel.h, namespace
// detail), for the Python wrapper: made once in C++ for both front ends. Python keeps only what
// is Python-specific (argument types, walking a Python module for a misplaced tensor's name).

#include "bindings.h"

#include <torchdp/autograd.h>
#include <torchdp/data_parallel.h>

#include <string>
#include <vector>

namespace py = pybind11;

namespace torchdp::python {

void init_data_parallel(py::module_& m) {
  m.def("check_group_and_graphs",
        without_gil([](bool process_group, bool cuda_graphs, const std::string& api) {
          detail::check_group_and_graphs(process_group, cuda_graphs, api.c_str());
        }),
        py::arg("process_group"), py::arg("cuda_graphs"), py::arg("api"),
        "ValueError when a process group and CUDA graphs are both asked for.");
  m.def("check_cuda_graphs",
        without_gil([](const std::vector<c10::Device>& devices, const std::string& api) {
          detail::check_cuda_graphs(devices, api.c_str());
        }),
        py::arg("devices"), py::arg("api"),
        "ValueError unless every device is a CUDA device; RuntimeError when this build cannot "
        "capture CUDA graphs.");
  m.def("misplaced_module_message",
        without_gil([](const c10::Device& target, const std::string& kind, const std::string& name,
                       const c10::Device& found, const std::string& fix) {
          return detail::misplaced_module_message(target, kind, name, found, fix);
        }),
        py::arg("target"), py::arg("kind"), py::arg("name"), py::arg("found"), py::arg("fix"),
        "The error text for a module whose ``kind`` ``name`` is on ``found``, not ``target``.");
  m.def("bucket_bytes_from_mib", without_gil([](double mib, const std::string& api) {
          return autograd::bucket_bytes_from_mib(mib, api.c_str());
        }),
        py::arg("mib"), py::arg("api"),
        "Bytes of a gradient bucket of ``mib`` MiB; ValueError unless finite and >= 0.");
}

} // namespace torchdp::python
