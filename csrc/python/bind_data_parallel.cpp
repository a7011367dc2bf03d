// DataParallel's checks (data_parallel.h, detail) and the CUDA-graph engine GraphedSteps, for the
// Python wrapper.

#include "bindings.h"

#include <torchdp/autograd.h>
#include <torchdp/data_parallel.h>
#include <torchdp/graphed_replicas.h>

#include <pybind11/functional.h>

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
  m.def("check_chunks",
        without_gil([](const std::vector<std::pair<std::string, int64_t>>& sizes, size_t chunks,
                       size_t n, int64_t dim, const std::string& api) {
          detail::check_chunks(sizes, chunks, n, dim, api.c_str());
        }),
        py::arg("sizes"), py::arg("chunks"), py::arg("n"), py::arg("dim"), py::arg("api"),
        "ValueError when the scatter's chunks, fewer than the n devices, drop rows of a longer "
        "tensor; sizes: (name, size along dim) of the tensors split.");
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

  // run() releases the GIL, as torch.autograd.grad does; the forward callback takes it back.
  using detail::GraphedSteps;
  py::class_<GraphedSteps>(m, "GraphedSteps",
                           "The CUDA-graph engine of cuda_graphs=True, over tensors (Note "
                           "[Graphed replicas] in csrc/torchdp/graphed_replicas.h).")
      .def(py::init(torch::wrap_pybind_function(
               [](std::vector<c10::Device> devices, size_t max_signatures, std::string api) {
                 return std::make_unique<GraphedSteps>(std::move(devices), max_signatures,
                                                       std::move(api));
               })),
           py::arg("devices"), py::arg("max_signatures"), py::arg("api"))
      .def("rebuild",
           without_gil([](GraphedSteps& self, std::vector<at::Tensor> params,
                          std::vector<at::Tensor> buffers, size_t n) {
             std::vector<std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> out;
             for (auto& s : self.rebuild(std::move(params), std::move(buffers), n)) {
               out.emplace_back(std::move(s.params), std::move(s.buffers));
             }
             return out;
           }),
           py::arg("params"), py::arg("buffers"), py::arg("n"),
           "Lays out n replicas anew: per replica, the (parameters, buffers) to install.")
      .def("bind",
           torch::wrap_pybind_function(
               [](GraphedSteps& self, size_t j, std::vector<at::Tensor> grad_leaves) {
                 self.bind(j, std::move(grad_leaves));
               }),
           py::arg("j"), py::arg("grad_leaves"),
           "Replica j's leaves for the parameters that require grad, in order.")
      .def("signature",
           torch::wrap_pybind_function([](const GraphedSteps& self, const std::string& key,
                                          const std::vector<std::vector<at::Tensor>>& inputs) {
             return self.signature(key, inputs);
           }),
           py::arg("key"), py::arg("inputs"),
           "The input signature of a forward: key, the tensors' metadata, grad mode, autocast.")
      .def("run",
           without_gil([](GraphedSteps& self, const std::string& signature,
                          const std::vector<std::vector<at::Tensor>>& inputs,
                          const GraphedSteps::Forward& forward) {
             return self.run(signature, inputs, forward);
           }),
           py::arg("signature"), py::arg("inputs"), py::arg("forward"),
           "Every replica's output tensors, or None when this forward runs eagerly; "
           "forward(j, tensors) runs replica j while a signature is captured.")
      .def_property_readonly("replicas", &GraphedSteps::replicas)
      .def_property_readonly("captures_made", &GraphedSteps::captures_made);
}

} // namespace torchdp::python
