// torchdp_testing, an extension module of the Python tests only (not shipped): the C++
// DataParallel over a real process group (gloo, NCCL), which only Python can set up here (torch's
// wheels ship no gloo headers for the C++ tests), and the C++ structure engine over Python values,
// for the structure cases both languages are tested from (test_tree.py). make test builds it next
// to this file.

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <torchdp/data_parallel.h>
#include <torchdp/structure.h>

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/irange.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <utility>
#include <vector>

namespace {

// tests/python/test_process_group.py's _mlp.
struct TestMlpImpl : torch::nn::Cloneable<TestMlpImpl> {
  TestMlpImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc3(at::tanh(fc2(at::tanh(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
  torch::nn::Linear fc3{nullptr};
};
TORCH_MODULE(TestMlp);

// A Python value as an IValue: what the C++ engine's containers can hold, lists and dicts of
// any element type.
c10::IValue to_ivalue(const pybind11::handle& value) {
  if (THPVariable_Check(value.ptr())) {
    return THPVariable_Unpack(value.ptr());
  }
  if (value.is_none()) {
    return {};
  }
  if (pybind11::isinstance<pybind11::bool_>(value)) {
    return value.cast<bool>();
  }
  if (pybind11::isinstance<pybind11::int_>(value)) {
    return value.cast<int64_t>();
  }
  if (pybind11::isinstance<pybind11::float_>(value)) {
    return value.cast<double>();
  }
  if (pybind11::isinstance<pybind11::str>(value)) {
    return value.cast<std::string>();
  }
  if (pybind11::isinstance<pybind11::tuple>(value)) {
    std::vector<c10::IValue> items;
    for (const auto& item : value) {
      items.push_back(to_ivalue(item));
    }
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (pybind11::isinstance<pybind11::list>(value)) {
    c10::impl::GenericList items(c10::AnyType::get());
    for (const auto& item : value) {
      items.push_back(to_ivalue(item));
    }
    return items;
  }
  if (pybind11::isinstance<pybind11::dict>(value)) {
    c10::impl::GenericDict items(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, item] : value.cast<pybind11::dict>()) {
      items.insert(key.cast<std::string>(), to_ivalue(item));
    }
    return items;
  }
  throw pybind11::type_error("torchdp_testing: no IValue for a " +
                             pybind11::str(pybind11::type::handle_of(value)).cast<std::string>());
}

} // namespace

// Holds no state of its own: safe without the GIL, as torchdp._C (csrc/python/py_dict.h).
PYBIND11_MODULE(torchdp_testing, t, pybind11::mod_gil_not_used()) {
  pybind11::module_::import("torch");
  t.attr("has_process_group") = static_cast<bool>(TORCHDP_WITH_C10D);
  // Python values become IValues through to_ivalue (tuples, lists, dicts of str keys, tensors,
  // numbers, strings, None) and come back as torch.jit gives them.
  t.def("structure_scatter",
        torch::wrap_pybind_function([](const pybind11::object& value,
                                       const std::vector<c10::Device>& devices, int64_t dim) {
          auto parts = torchdp::scatter(to_ivalue(value), devices, dim);
          pybind11::list out;
          for (auto& part : parts) {
            out.append(torch::jit::toPyObject(std::move(part)));
          }
          return out;
        }),
        pybind11::arg("value"), pybind11::arg("devices"), pybind11::arg("dim") = 0,
        "torchdp::scatter of a Python value: one value per replica.");
  t.def("structure_gather",
        torch::wrap_pybind_function(
            [](const pybind11::list& outputs, c10::Device destination, int64_t dim) {
              std::vector<c10::IValue> values;
              for (const auto& output : outputs) {
                values.push_back(to_ivalue(output));
              }
              return torch::jit::toPyObject(torchdp::gather(values, destination, dim));
            }),
        pybind11::arg("outputs"), pybind11::arg("destination"), pybind11::arg("dim") = 0,
        "torchdp::gather of per-replica Python values.");
  t.def("structure_tensors", torch::wrap_pybind_function([](const pybind11::object& value) {
          return torchdp::detail::tensors_of(to_ivalue(value));
        }),
        pybind11::arg("value"), "The tensors inside a Python value, in the C++ engine's order.");
#if TORCHDP_WITH_C10D
  t.def(
      "train_mlp",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::vector<at::Tensor>& init,
         const std::vector<std::pair<at::Tensor, at::Tensor>>& batches,
         const std::vector<std::string>& devices, double lr, bool accumulate) {
        std::vector<c10::Device> device_list;
        for (const auto& d : devices) {
          device_list.emplace_back(d);
        }
        TestMlp net;
        {
          at::NoGradGuard no_grad;
          auto params = net->parameters();
          TORCH_CHECK(params.size() == init.size(), "train_mlp: ", init.size(),
                      " initial tensors for ", params.size(), " parameters");
          for (const auto i : c10::irange(params.size())) {
            params[i].copy_(init[i]);
          }
        }
        net->to(device_list.front());
        torchdp::DataParallel dp(
            net, torchdp::DataParallelOptions().device_ids(device_list).process_group(group));
        auto loss = [&](const at::Tensor& x, const at::Tensor& y) {
          return (dp->forward(x.to(device_list.front())) - y.to(device_list.front())).pow(2).mean();
        };
        for (const auto& [x, y] : batches) {
          dp->zero_grad();
          if (accumulate) {
            auto xs = x.chunk(2);
            auto ys = y.chunk(2);
            {
              auto guard = dp->no_sync();
              (loss(xs[0], ys[0]) / 2).backward();
            }
            (loss(xs[1], ys[1]) / 2).backward();
          } else {
            loss(x, y).backward();
          }
          at::NoGradGuard no_grad;
          for (auto& p : dp->parameters()) {
            p.sub_(p.grad() * lr);
          }
        }
        std::vector<at::Tensor> out;
        for (const auto& p : dp->parameters()) {
          out.push_back(p.detach().cpu());
        }
        return out;
      },
      pybind11::call_guard<pybind11::gil_scoped_release>(),
      R"doc(Trains a C++ Linear(8, 32)-Tanh-Linear(32, 32)-Tanh-Linear(32, 4) from `init` with
torchdp::DataParallel over `devices` and `group`, plain SGD at `lr`, one step per (input, target)
batch (two micro-batches under no_sync() when `accumulate`); returns the parameters.)doc");
#endif
}
