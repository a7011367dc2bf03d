// torchdp._C's loss reduction names (Note [Reduction seam] in csrc/torchdp/reduction.cpp), so that
// DataParallelCriterion accepts what parallel_loss does, with the same error.

#include "bindings.h"

#include <torchdp/reduction.h>

#include <string>
#include <vector>

namespace py = pybind11;

namespace torchdp::python {

void init_reduction(py::module_& m) {
  m.def(
      "loss_reductions",
      [] {
        std::vector<std::string> names;
        for (const auto reduction : kLossReductions) {
          names.emplace_back(loss_reduction_name(reduction));
        }
        return names;
      },
      "The loss reductions' names, in order: 'mean', 'batchmean', 'sum', 'none'.");
  m.def("loss_reduction",
        torch::wrap_pybind_function([](const py::object& name, const std::string& api) {
          const auto text = py::isinstance<py::str>(name) ? name.cast<std::string>()
                                                          : std::string(py::repr(name));
          return std::string(loss_reduction_name(loss_reduction_from_name(text, api)));
        }),
        py::arg("name"), py::arg("api"),
        "``name`` when it names a loss reduction; ValueError naming ``api`` and the choices "
        "otherwise.");
}

} // namespace torchdp::python
