// torchdp_testing, an extension module of the Python tests only (not shipped): the C++
// DataParallel over a real process group (gloo, NCCL), which only Python can set up here (torch's
// wheels ship no gloo headers for the C++ tests). make test builds it next to this file.

#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <torchdp/data_parallel.h>

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

} // namespace

// Holds no state of its own: safe without the GIL, as torchdp._C (csrc/python/py_dict.h).
PYBIND11_MODULE(torchdp_testing, t, pybind11::mod_gil_not_used()) {
  pybind11::module_::import("torch");
  t.attr("has_process_group") = static_cast<bool>(TORCHDP_WITH_C10D);
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
