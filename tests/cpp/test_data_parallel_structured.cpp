// torchdp::DataParallel over modules with several outputs and non-tensor arguments.
#include "test_common.h"

using namespace torchdp_test;

namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;

/// Two outputs: logits and an auxiliary head.
struct TwoHeadsImpl : torch::nn::Cloneable<TwoHeadsImpl> {
  TwoHeadsImpl() {
    reset();
  }
  void reset() override {
    body = register_module("body", torch::nn::Linear(5, 8));
    head = register_module("head", torch::nn::Linear(8, 3));
    aux = register_module("aux", torch::nn::Linear(8, 1));
  }
  Pair forward(const at::Tensor& x) {
    auto h = torch::relu(body(x));
    return {head(h), aux(h)};
  }
  torch::nn::Linear body{nullptr}, head{nullptr}, aux{nullptr};
};
TORCH_MODULE(TwoHeads);

/// Mixed arguments: a tensor, a vector and a tuple of tensors (split), a number, a string and an
/// options struct (copied to every replica); returns a vector of tensors.
struct Scaling {
  double offset = 0;
};

struct MixedImpl : torch::nn::Cloneable<MixedImpl> {
  MixedImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(4, 4));
  }
  std::vector<at::Tensor> forward(const at::Tensor& x, const std::vector<at::Tensor>& extra,
                                  const Pair& pair, double scale, const std::string& mode,
                                  Scaling scaling) {
    auto y = fc(x) * scale + scaling.offset;
    for (const auto& e : extra) {
      y = y + e;
    }
    y = mode == "mul" ? y * std::get<0>(pair) : y + std::get<0>(pair);
    return {y, std::get<1>(pair) * 2};
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Mixed);

/// A dict output and an optional argument.
struct DictOutImpl : torch::nn::Cloneable<DictOutImpl> {
  DictOutImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(3, 2));
  }
  c10::Dict<std::string, at::Tensor> forward(const at::Tensor& x,
                                             const std::optional<at::Tensor>& mask) {
    c10::Dict<std::string, at::Tensor> out;
    auto y = fc(x);
    out.insert("y", mask ? y * *mask : y);
    out.insert("norm", y.norm(2, {1}, true));
    return out;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(DictOut);

torchdp::DataParallelOptions on(std::vector<torch::Device> devices) {
  return torchdp::DataParallelOptions().device_ids(std::move(devices));
}

void check_two_heads(const std::vector<torch::Device>& devices, c10::Device device) {
  torch::manual_seed(11);
  TwoHeads serial;
  TwoHeads wrapped;
  copy_state(*wrapped, *serial);
  serial->to(device);
  wrapped->to(device);
  torchdp::DataParallel dp(wrapped, on(devices));
  torch::optim::SGD opt_serial(serial->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_dp(dp->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({6, 5}, torch::TensorOptions().device(device));
    opt_serial.zero_grad();
    opt_dp.zero_grad();
    auto [logits_s, aux_s] = serial->forward(x);
    auto [logits, aux] = dp->forward<Pair>(x);
    CHECK(logits.sizes() == logits_s.sizes());
    CHECK(torch::allclose(logits, logits_s, 1e-5, 1e-6));
    CHECK(torch::allclose(aux, aux_s, 1e-5, 1e-6));
    (logits_s.pow(2).mean() + aux_s.mean()).backward();
    (logits.pow(2).mean() + aux.mean()).backward();
    opt_serial.step();
    opt_dp.step();
    const auto a = serial->parameters();
    const auto b = wrapped->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("step " << step << " parameter " << i);
      CHECK(torch::allclose(a[i], b[i], 1e-5, 1e-6));
    }
  }
  CHECK(dp->replicator().skeleton_builds() == 1);
}

} // namespace

TEST_CASE("DataParallel over a module returning a tuple trains as the module",
          "[cpu][data_parallel][structure]") {
  const auto devices = GENERATE(cpu_devices(2), cpu_devices(3));
  check_two_heads(devices, torch::kCPU);
}

TEST_CASE("DataParallel splits tensors inside arguments and copies the others",
          "[cpu][data_parallel][structure]") {
  torch::manual_seed(12);
  Mixed module;
  const auto x = torch::randn({6, 4}, torch::requires_grad());
  const std::vector<at::Tensor> extra{torch::randn({6, 4}), torch::randn({6, 4})};
  const Pair pair{torch::randn({6, 4}), torch::randn({6, 1})};
  const auto expected = module->forward(x, extra, pair, 0.5, "mul", Scaling{1.5});
  for (size_t n : {1, 2, 3}) {
    INFO(n << " devices");
    torchdp::DataParallel dp(module, on(cpu_devices(n)));
    const auto out =
        dp->forward<std::vector<at::Tensor>>(x, extra, pair, 0.5, std::string("mul"), Scaling{1.5});
    REQUIRE(out.size() == 2);
    CHECK(torch::allclose(out[0], expected[0], 1e-5, 1e-6));
    CHECK(torch::allclose(out[1], expected[1], 1e-5, 1e-6));
    x.mutable_grad() = at::Tensor();
    out[0].sum().backward();
    auto reference_grad = torch::autograd::grad({expected[0].sum()}, {x}, {}, true)[0];
    CHECK(torch::allclose(x.grad(), reference_grad, 1e-5, 1e-6));
    const auto parts = dp->forward_replicas<std::vector<at::Tensor>>(
        x, extra, pair, 0.5, std::string("mul"), Scaling{1.5});
    CHECK(parts.size() == n);
  }
}

TEST_CASE("DataParallel gathers dicts and takes optional tensors",
          "[cpu][data_parallel][structure]") {
  torch::manual_seed(13);
  DictOut module;
  torchdp::DataParallel dp(module, on(cpu_devices(2)));
  const auto x = torch::randn({5, 3});
  const auto mask = torch::rand({5, 2});
  using Out = c10::Dict<std::string, at::Tensor>;
  const auto with_mask = dp->forward<Out>(x, std::optional<at::Tensor>(mask));
  CHECK(torch::allclose(with_mask.at("y"), module->forward(x, mask).at("y"), 1e-5, 1e-6));
  const auto without = dp->forward<Out>(x, std::optional<at::Tensor>());
  CHECK(
      torch::allclose(without.at("norm"), module->forward(x, std::nullopt).at("norm"), 1e-5, 1e-6));
}

TEST_CASE("DataParallel's structured forward checks the types before running",
          "[cpu][data_parallel][structure]") {
  TwoHeads two;
  torchdp::DataParallel dp(two, on(cpu_devices(2)));
  const auto x = torch::randn({4, 5});
  TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "torchdp::DataParallel",
                            "the module's forward returns std::tuple<at::Tensor, at::Tensor>",
                            "call forward<std::tuple<at::Tensor, at::Tensor>>(...)");
  Mixed mixed;
  torchdp::DataParallel dp_mixed(mixed, on(cpu_devices(2)));
  const std::vector<at::Tensor> extra{torch::randn({4, 4})};
  const Pair pair{torch::randn({4, 4}), torch::randn({4, 1})};
  try {
    dp_mixed->forward<std::vector<at::Tensor>>(torch::randn({4, 4}), extra, pair, 1,
                                               std::string("add"), Scaling{});
    FAIL("no exception");
  } catch (const c10::TypeError& e) {
    const std::string message = e.what_without_backtrace();
    INFO(message);
    CHECK(message.find("forward argument 3 is a int but the module's forward takes a double") !=
          std::string::npos);
  }
  TORCHDP_CHECK_THROWS_WITH(
      dp_mixed->forward<std::vector<at::Tensor>>(torch::randn({4, 4}), extra,
                                                 Pair{torch::randn({1, 4}), torch::randn({1, 1})},
                                                 1.0, std::string("add"), Scaling{}),
      "forward argument 0 has 4", "forward argument 2[0] has 1");
}

TEST_CASE("DataParallel's structured forward on one device and passing through",
          "[cpu][data_parallel][structure]") {
  torch::manual_seed(14);
  TwoHeads module;
  const auto x = torch::randn({3, 5});
  const auto expected = module->forward(x);
  torchdp::DataParallel one(module, on(cpu_devices(1)));
  CHECK(torch::allclose(std::get<0>(one->forward<Pair>(x)), std::get<0>(expected)));
  if (!torchdp::has_cuda()) {
    torchdp::DataParallel through(module); // no GPU and no device list: calls the module
    CHECK(through->device_ids().empty());
    CHECK(torch::allclose(std::get<1>(through->forward<Pair>(x)), std::get<1>(expected)));
  }
}

TEST_CASE("DataParallel over a tuple-returning module on one GPU listed twice",
          "[cuda][data_parallel][structure]") {
  TORCHDP_NEED_CUDA(gpus, 1);
  check_two_heads({gpus[0], gpus[0]}, gpus[0]);
}
