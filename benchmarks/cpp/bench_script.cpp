// The scripted model of the C++ benchmark (bench_script.h).
#include "bench_script.h"

#include <torchdp/script_module.h>

#include <torch/optim/sgd.h>

#include <cmath>
#include <memory>
#include <utility>

namespace torchdp_bench {

torch::jit::Module script_mlp(const std::vector<at::Tensor>& parameters) {
  TORCH_CHECK(!parameters.empty() && parameters.size() % 2 == 0,
              "script_mlp: expected weights and biases, got ", parameters.size(), " tensors");
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::Module model(c10::QualifiedName("__torch__.bench.ScriptMlp"), cu);
  c10::ClassTypePtr linear_type;
  std::string source = "def forward(self, x):\n";
  for (size_t i = 0; i < parameters.size() / 2; ++i) {
    auto linear = linear_type
                      ? torch::jit::Module(cu, linear_type)
                      : torch::jit::Module(c10::QualifiedName("__torch__.bench.Linear"), cu);
    linear.register_parameter("weight", parameters[2 * i].detach().clone().requires_grad_(), false);
    linear.register_parameter("bias", parameters[2 * i + 1].detach().clone().requires_grad_(),
                              false);
    if (!linear_type) { // the methods belong to the class: defined once for every layer
      linear.define(R"JIT(
def forward(self, x):
    return torch.linear(x, self.weight, self.bias)
)JIT");
      linear_type = linear.type();
    }
    const auto name = "l" + std::to_string(i);
    model.register_module(name, linear);
    source += "    x = torch.relu(self." + name + ".forward(x))\n";
  }
  source += "    return x\n";
  model.define(source);
  return model;
}

std::function<at::Tensor()> script_train_step(torch::jit::Module module, const at::Tensor& input,
                                              const std::vector<c10::Device>& devices,
                                              const std::string& mode) {
  TORCH_CHECK(mode == "single" || mode == "torchdp" || mode == "torchdp_new_replicas",
              "script_train_step: unknown mode ", mode);
  module.to(devices.front());
  module.train();
  struct State {
    torch::jit::Module module;
    std::unique_ptr<torchdp::ScriptDataParallel> dp;
    std::unique_ptr<torch::optim::SGD> opt;
    at::Tensor x;
    bool rebuild = false;
  };
  auto state = std::make_shared<State>();
  state->module = module;
  state->x = input.to(devices.front());
  std::vector<at::Tensor> params;
  for (const auto& p : module.parameters()) {
    params.push_back(p);
  }
  state->opt = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-3));
  if (mode != "single") {
    state->dp = std::make_unique<torchdp::ScriptDataParallel>(
        module, torchdp::DataParallelOptions().device_ids(devices));
    state->rebuild = mode == "torchdp_new_replicas";
  }
  return [state]() {
    state->opt->zero_grad();
    at::Tensor out;
    if (state->dp) {
      if (state->rebuild) {
        state->dp->replicator().invalidate();
      }
      out = state->dp->forward({state->x}).toTensor();
    } else {
      out = state->module.forward({state->x}).toTensor();
    }
    auto loss = out.pow(2).mean();
    loss.backward();
    state->opt->step();
    return loss;
  };
}

double script_grad_norm(const torch::jit::Module& module) {
  double sq = 0;
  for (const auto& p : module.parameters()) {
    if (p.grad().defined()) {
      sq += p.grad().detach().to(at::kDouble).pow(2).sum().item<double>();
    }
  }
  return std::sqrt(sq);
}

std::function<void()> script_replicate(torch::jit::Module module,
                                       const std::vector<c10::Device>& devices, bool cached) {
  module.to(devices.front());
  module.train();
  auto replicator = std::make_shared<torchdp::ScriptReplicator>(module);
  return [replicator, devices, cached]() {
    if (!cached) {
      replicator->invalidate();
    }
    auto replicas = replicator->replicate(devices);
  };
}

} // namespace torchdp_bench
