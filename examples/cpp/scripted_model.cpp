// Trains a TorchScript model loaded with torch::jit::load with torchdp::ScriptDataParallel, and
// checks the weights against training a second copy of it on one device.
//
// The model takes a tensor and a dict of tensors and returns a tuple (logits, embedding): the
// tensors inside the dict are split along the batch like the plain tensor, and both outputs are
// gathered. A model scripted in Python works the same way:
//     torch.jit.script(model).save("model.pt")       # Python
//     auto module = torch::jit::load("model.pt");    // C++
// This example builds such a model in C++ and saves it to a temporary file first.
//
// Usage: torchdp_example_scripted_model [--steps N] [--devices cuda:0,cuda:0]
// Devices: the list given (a device may repeat), else every visible CUDA device, or two CPU
// replicas ({cpu, cpu}) without CUDA. Exit status: 0 when the weights match, 1 when they do
// not, 2 on bad arguments.

#include <torchdp/torchdp.h>

#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <torch/script.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

/// Builds the scripted model in C++ (what torch.jit.script does from Python) and saves it.
void save_model(const std::string& path) {
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::Module encoder(c10::QualifiedName("__torch__.Encoder"), cu);
  encoder.register_parameter("weight", (torch::randn({16, 8}) * 0.3).requires_grad_(), false);
  encoder.register_parameter("bias", torch::zeros({16}).requires_grad_(), false);
  encoder.define(R"JIT(
def forward(self, x):
    return torch.relu(torch.matmul(x, self.weight.t()) + self.bias)
)JIT");
  torch::jit::Module model(c10::QualifiedName("__torch__.Model"), cu);
  model.register_module("encoder", encoder);
  model.register_parameter("head", (torch::randn({3, 16}) * 0.3).requires_grad_(), false);
  model.define(R"JIT(
def forward(self, x, features: Dict[str, Tensor]):
    h = self.encoder.forward(x) * features["gate"]
    return torch.matmul(h, self.head.t()), h
)JIT");
  model.save(path);
}

std::vector<at::Tensor> parameters_of(const torch::jit::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p);
  }
  return out;
}

at::Tensor loss_of(const c10::IValue& out, const at::Tensor& labels) {
  const auto& e = out.toTupleRef().elements();
  return torch::nn::functional::cross_entropy(e[0].toTensor(), labels) +
         0.01 * e[1].toTensor().pow(2).mean();
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
      std::cerr << "usage: torchdp_example_scripted_model [--steps N] [--devices cuda:0,cuda:0]\n";
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
  const auto path = (std::filesystem::temp_directory_path() /
                     ("torchdp_scripted_model_" + std::to_string(::getpid()) + ".pt"))
                        .string();
  save_model(path);
  // Two loads: one trained data-parallel, one on one device for the check.
  auto module = torch::jit::load(path, device);
  auto single = torch::jit::load(path, device);
  std::filesystem::remove(path);

  torchdp::ScriptDataParallel dp(module, torchdp::DataParallelOptions().device_ids(devices));
  torch::optim::SGD opt_dp(dp.parameters(), 0.05);
  torch::optim::SGD opt_single(parameters_of(single), 0.05);

  const auto options = torch::TensorOptions().device(device);
  for (int step = 0; step < steps; ++step) {
    const auto x = torch::randn({32, 8}, options);
    c10::Dict<std::string, at::Tensor> features;
    features.insert("gate", torch::rand({32, 16}, options));
    const auto labels = torch::randint(3, {32}, options.dtype(torch::kLong));

    opt_dp.zero_grad();
    auto loss = loss_of(dp.forward({x, features}), labels); // split over the devices
    loss.backward(); // the replicas' gradients are summed into module's parameters
    opt_dp.step();

    opt_single.zero_grad();
    auto reference = loss_of(single.forward({x, features}), labels);
    reference.backward();
    opt_single.step();
    std::cout << "step " << step << " loss " << loss.item<double>() << " (one device "
              << reference.item<double>() << ")\n";
  }
  std::map<std::string, at::Tensor> trained;
  for (const auto& p : module.named_parameters()) {
    trained.emplace(p.name, p.value);
  }
  for (const auto& p : single.named_parameters()) {
    if (!torch::allclose(trained.at(p.name), p.value, 1e-4, 1e-5)) {
      std::cerr << "scripted_model: parameter " << p.name << " differs from one-device training\n";
      return 1;
    }
  }
  std::cout << "scripted_model: " << devices.size() << " replicas trained as one device\n";
  return 0;
}
