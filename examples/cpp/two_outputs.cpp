// Trains a model with two outputs (class logits and a regression head) and a non-tensor argument
// with torchdp::DataParallel, and checks the weights against training on one device.
//
// The module's forward returns std::tuple<at::Tensor, at::Tensor>, so the forward is called as
// dp->forward<Outputs>(...): both outputs are gathered. Its arguments are a tensor (split along
// the batch), a std::vector of tensors (each split the same way) and a double (copied to every
// replica), as torch.nn.DataParallel treats them in Python.
//
// Usage: torchdp_example_two_outputs [--steps N] [--devices cuda:0,cuda:0]
// Devices: the list given (a device may repeat), else every visible CUDA device, or two CPU
// replicas ({cpu, cpu}) without CUDA. Exit status: 0 when the weights match, 1 when they do
// not, 2 on bad arguments.

#include <torchdp/torchdp.h>

#include <torch/nn.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor>;

/// A shared body with two heads; `extra` features are added to the hidden layer, and
/// `temperature` divides the logits.
struct TwoHeadsImpl : torch::nn::Cloneable<TwoHeadsImpl> {
  TwoHeadsImpl() {
    reset();
  }
  void reset() override {
    body = register_module("body", torch::nn::Linear(8, 16));
    classes = register_module("classes", torch::nn::Linear(16, 3));
    value = register_module("value", torch::nn::Linear(16, 1));
  }
  Outputs forward(const at::Tensor& x, const std::vector<at::Tensor>& extra, double temperature) {
    auto h = body(x);
    for (const auto& e : extra) {
      h = h + e;
    }
    h = torch::relu(h);
    return {classes(h) / temperature, value(h)};
  }
  torch::nn::Linear body{nullptr}, classes{nullptr}, value{nullptr};
};
TORCH_MODULE(TwoHeads);

at::Tensor loss_of(const Outputs& out, const at::Tensor& labels, const at::Tensor& targets) {
  const auto& [logits, value] = out;
  return torch::nn::functional::cross_entropy(logits, labels) +
         torch::nn::functional::mse_loss(value, targets);
}

} // namespace

int main(int argc, char** argv) {
  int steps = 5;
  std::vector<torch::Device> devices;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (arg == "--devices" && i + 1 < argc) {
      std::stringstream list(argv[++i]);
      for (std::string d; std::getline(list, d, ',');) {
        devices.emplace_back(d);
      }
    } else {
      std::cerr << "usage: torchdp_example_two_outputs [--steps N] [--devices cuda:0,cuda:0]\n";
      return 2;
    }
  }
  const bool listed = !devices.empty();
  for (int64_t i = 0; !listed && i < torchdp::cuda_device_count(); ++i) {
    devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
  }
  if (devices.empty()) {
    devices = {torch::kCPU, torch::kCPU};
  }
  const auto device = devices.front();

  torch::manual_seed(0);
  TwoHeads single;
  TwoHeads model;
  {
    torch::NoGradGuard no_grad; // the same starting weights
    auto from = single->parameters();
    auto to = model->parameters();
    for (size_t i = 0; i < from.size(); ++i) {
      to[i].copy_(from[i]);
    }
  }
  single->to(device);
  model->to(device);
  torchdp::DataParallel dp(model, torchdp::DataParallelOptions().device_ids(devices));
  torch::optim::SGD opt_single(single->parameters(), 0.05);
  torch::optim::SGD opt_dp(dp->parameters(), 0.05);

  const auto options = torch::TensorOptions().device(device);
  for (int step = 0; step < steps; ++step) {
    const auto x = torch::randn({32, 8}, options);
    const std::vector<at::Tensor> extra{torch::randn({32, 16}, options)};
    const auto labels = torch::randint(3, {32}, options.dtype(torch::kLong));
    const auto targets = torch::randn({32, 1}, options);

    opt_dp.zero_grad();
    // Both outputs gathered on devices[0]; x and extra split over the devices, 2.0 copied.
    auto loss = loss_of(dp->forward<Outputs>(x, extra, 2.0), labels, targets);
    loss.backward();
    opt_dp.step();

    opt_single.zero_grad();
    auto reference = loss_of(single->forward(x, extra, 2.0), labels, targets);
    reference.backward();
    opt_single.step();
    std::cout << "step " << step << " loss " << loss.item<double>() << " (one device "
              << reference.item<double>() << ")\n";
  }
  const auto a = single->parameters();
  const auto b = model->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::allclose(a[i], b[i], 1e-4, 1e-5)) {
      std::cerr << "two_outputs: parameter " << i << " differs from one-device training\n";
      return 1;
    }
  }
  std::cout << "two_outputs: " << devices.size() << " replicas trained as one device\n";
  return 0;
}
