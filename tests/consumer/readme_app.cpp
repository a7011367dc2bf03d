#include <torchdp/torchdp.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  torch::nn::Sequential net(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
  // Two replicas on the CPU; on GPUs: {torch::Device("cuda:0"), torch::Device("cuda:1")}
  std::vector<torch::Device> devices{torch::kCPU, torch::kCPU};
  torchdp::DataParallel dp(net, torchdp::DataParallelOptions().device_ids(devices));
  torch::optim::SGD opt(dp->parameters(), 0.1);
  auto x = torch::randn({32, 16}), y = torch::randn({32, 1});
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(dp->forward(x), y); // one replica per device
    loss.backward(); // the gradients are summed into net's parameters
    opt.step();
    std::cout << "step " << step << " loss " << loss.item<float>() << "\n";
  }
}
