// torchdp._C.ProcessGroupSync (Note [Reducing across processes]) for torchdp/_process_group.py.
// A ProcessGroup arrives through torch's own pybind11 registration of c10d::ProcessGroup, shared
// because this module uses torch's pybind11 headers and ABI. Collectives run without the GIL.

#include "bindings.h"

#include <torchdp/autograd.h>
#include <torchdp/config.h>
#include <torchdp/process_group.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace torchdp::python {

void init_process_group(py::module_& m) {
#if TORCHDP_WITH_C10D
  using torchdp::detail::ProcessGroupSync;
  py::class_<ProcessGroupSync, std::shared_ptr<ProcessGroupSync>>(
      m, "ProcessGroupSync",
      R"doc(Keeps one wrapper's parameters and buffers in step with the other processes of a group
and averages their gradients after each watched backward pass (the C++ engine of
DataParallel(process_group=...)).)doc")
      .def(py::init(without_gil(
               [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::string& api) {
                 return std::make_shared<ProcessGroupSync>(group, api);
               })),
           py::arg("group"), py::arg("api"))
      .def("agreed",
           without_gil([](const ProcessGroupSync& self, const std::vector<at::Tensor>& params) {
             return self.agreed(params);
           }),
           py::arg("params"),
           "Whether ``params`` are the parameters last agreed on (same tensors, requires_grad, "
           "dtypes and devices); True in a group of one.")
      .def("agree",
           without_gil([](ProcessGroupSync& self, const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& buffers, const std::vector<bool>& sparse) {
             self.agree(params, buffers, sparse);
           }),
           py::arg("params"), py::arg("buffers"), py::arg("sparse"),
           "Checks that every process holds the same parameters and buffers and takes group rank "
           "0's values; ``sparse[i]``: ``params[i]`` gets sparse gradients.")
      .def("broadcast",
           without_gil([](ProcessGroupSync& self, const std::vector<at::Tensor>& tensors) {
             self.broadcast(tensors);
           }),
           py::arg("tensors"), "Copies group rank 0's values of ``tensors`` into this process's.")
      .def("watch",
           without_gil([](ProcessGroupSync& self, const std::vector<at::Tensor>& outputs,
                          std::optional<size_t> bucket_bytes) {
             self.watch(outputs, bucket_bytes.value_or(autograd::kDefaultGradBucketSize));
           }),
           py::arg("outputs"), py::arg("bucket_bytes"),
           "Hooks ``outputs`` so that a backward pass through them averages the gradients, in "
           "buckets of ``bucket_bytes`` (None: 25 MiB; 0: one per device and dtype).")
      .def_property_readonly("remembered_passes", &ProcessGroupSync::remembered_passes)
      .def_property("max_passes", &ProcessGroupSync::max_passes,
                    without_gil([](ProcessGroupSync& self, size_t n) {
                      self.set_max_passes(n);
                    }))
      .def_property_readonly("reductions", &ProcessGroupSync::reductions);
#endif
}

} // namespace torchdp::python
