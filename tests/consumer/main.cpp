// Proves the installed package works: find_package(TorchDP), include, link, run.
#include <torch/nn/modules/linear.h>
#include <torchdp/torchdp.h>

#include <iostream>

int main() {
  torch::nn::Linear linear(4, 2);
  const std::vector<torch::Device> devices{torch::kCPU, torch::kCPU};
  const auto x = torch::randn({6, 4});
  auto out = torchdp::data_parallel(linear, x, devices);
  if (!torch::allclose(out, linear->forward(x), 1e-5, 1e-6)) {
    std::cerr << "torchdp consumer: data_parallel output differs from the module's\n";
    return 1;
  }
  // The module form, per-replica outputs and the per-replica loss (library symbols, not templates).
  torchdp::DataParallel dp(linear,
                           torchdp::DataParallelOptions().device_ids(devices).bucket_cap_mb(1.0));
  auto outputs = dp->forward_replicas(x);
  auto loss = torchdp::parallel_loss(outputs, torch::zeros({6, 2}),
                                     [](const at::Tensor& o, const at::Tensor& t) {
                                       return (o - t).pow(2).mean();
                                     });
  if (outputs.size() != 2 || !torch::allclose(loss, linear->forward(x).pow(2).mean(), 1e-5, 1e-6)) {
    std::cerr << "torchdp consumer: forward_replicas/parallel_loss differ from the module's loss\n";
    return 1;
  }
  std::cout << "torchdp consumer OK (torchdp " << TORCHDP_VERSION << ", CUDA " << TORCHDP_WITH_CUDA
            << ", NCCL " << TORCHDP_WITH_NCCL << ")\n";
  return 0;
}
