#include "test_common.h"

#include <set>

using namespace torchdp_test;

namespace {

/// Conv2d + Linear, as LibTorch's DataParallelNumericalEquivalence test uses.
struct ConvLinearImpl : torch::nn::Cloneable<ConvLinearImpl> {
  ConvLinearImpl() {
    reset();
  }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 2, 3)));
    fc = register_module("fc", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(conv(x));
    return fc(h.reshape({h.size(0), -1}));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvLinear);

/// Two tensor arguments.
struct TwoInputsImpl : torch::nn::Cloneable<TwoInputsImpl> {
  TwoInputsImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(3, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    return fc(x) * y;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TwoInputs);

torchdp::DataParallelOptions on(std::vector<torch::Device> devices) {
  return torchdp::DataParallelOptions().device_ids(std::move(devices));
}

} // namespace

TEST_CASE("data_parallel gives the module's output and gradients", "[cpu][data_parallel]") {
  torch::manual_seed(9);
  const auto devices = GENERATE(cpu_devices(2), cpu_devices(3), cpu_devices(4));
  torch::nn::Linear linear(5, 3);
  torch::nn::Linear reference(5, 3);
  copy_state(*reference, *linear);
  const auto x = torch::randn({10, 5});
  auto out = torchdp::data_parallel(linear, x, devices);
  auto expected = reference->forward(x);
  CHECK(torch::allclose(out, expected, 1e-5, 1e-6));
  out.pow(2).sum().backward();
  expected.pow(2).sum().backward();
  CHECK(torch::allclose(linear->weight.grad(), reference->weight.grad(), 1e-5, 1e-6));
  CHECK(torch::allclose(linear->bias.grad(), reference->bias.grad(), 1e-5, 1e-6));
}

TEST_CASE("data_parallel places the output on the requested device", "[cpu][data_parallel]") {
  torch::nn::Linear linear(3, 3);
  SECTION("several devices") {
    auto out = torchdp::data_parallel(linear, torch::randn({4, 3}), cpu_devices(2),
                                      torch::Device(torch::kMeta));
    CHECK(out.device().is_meta());
    CHECK(out.sizes() == torch::IntArrayRef{4, 3});
  }
  SECTION("a single device") {
    auto out = torchdp::data_parallel(linear, torch::randn({4, 3}), cpu_devices(1),
                                      torch::Device(torch::kMeta));
    CHECK(out.device().is_meta());
  }
  SECTION("along another dimension") {
    auto x = torch::randn({3, 6});
    auto out = torchdp::data_parallel(torch::nn::Identity(), x, cpu_devices(3), std::nullopt, 1);
    CHECK(torch::equal(out, x));
  }
}

TEST_CASE("DataParallel training equals serial training over 3 SGD steps", "[cpu][data_parallel]") {
  const auto devices = GENERATE(cpu_devices(2), cpu_devices(3));
  torch::manual_seed(10);
  ConvLinear serial;
  ConvLinear wrapped_model;
  copy_state(*wrapped_model, *serial);
  torchdp::DataParallel dp(wrapped_model, on(devices));
  torch::optim::SGD opt_serial(serial->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_dp(dp->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({6, 2, 4, 4});
    const auto y = torch::randn({6, 2});
    opt_serial.zero_grad();
    opt_dp.zero_grad();
    auto loss_serial = torch::mse_loss(serial->forward(x), y);
    auto loss_dp = torch::mse_loss(dp->forward(x), y);
    CHECK(torch::allclose(loss_serial, loss_dp, 1e-5, 1e-6));
    loss_serial.backward();
    loss_dp.backward();
    opt_serial.step();
    opt_dp.step();
    const auto a = serial->parameters();
    const auto b = wrapped_model->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("step " << step << " parameter " << i);
      CHECK(torch::allclose(a[i], b[i], 1e-5, 1e-6));
    }
  }
  CHECK(dp->replicator().skeleton_builds() == 1);
}

TEST_CASE("DataParallel is a module around its child", "[cpu][data_parallel]") {
  torch::nn::Linear linear(2, 2);
  torchdp::DataParallel dp(linear, on(cpu_devices(2)));
  const auto names = dp->named_parameters().keys();
  CHECK(names == std::vector<std::string>{"module.weight", "module.bias"});
  CHECK(dp->device_ids() == cpu_devices(2));
  CHECK(*dp->output_device() == torch::Device(torch::kCPU));
  CHECK(dp->module().get() == linear.get());
  std::ostringstream os;
  dp->pretty_print(os);
  CHECK(os.str() == "torchdp::DataParallel(device_ids=[cpu, cpu], output_device=cpu, dim=0)");
  dp->eval();
  CHECK_FALSE(linear->is_training());
}

TEST_CASE("DataParallel forwards several tensor arguments", "[cpu][data_parallel]") {
  torch::manual_seed(11);
  TwoInputs module;
  torchdp::DataParallel dp(module, on(cpu_devices(3)));
  const auto x = torch::randn({7, 3});
  const auto y = torch::randn({7, 3});
  CHECK(torch::allclose(dp->forward(x, y), module->forward(x, y), 1e-5, 1e-6));
}

TEST_CASE("a batch smaller than the device count uses fewer replicas", "[cpu][data_parallel]") {
  torch::nn::Linear linear(3, 2);
  torchdp::DataParallel dp(linear, on(cpu_devices(4)));
  const auto x = torch::randn({2, 3});
  auto out = dp->forward(x);
  CHECK(out.sizes() == torch::IntArrayRef{2, 2});
  // One row per replica: another matrix-product path than the whole batch's, whose last bits may
  // differ (the GPU machine's CPU gave such a difference at allclose's default tolerance).
  const auto whole = linear->forward(x);
  INFO("max abs difference " << (out - whole).abs().max().item<float>());
  CHECK(torch::allclose(out, whole, 1e-5, 1e-6));
  // A batch of 5 on 4 devices gives chunks [2, 2, 1]: three replicas.
  CHECK(dp->forward(torch::randn({5, 3})).size(0) == 5);
}

TEST_CASE("a tensor shorter than the others is refused, not cut", "[cpu][data_parallel]") {
  TwoInputs module;
  torchdp::DataParallel dp(module, on(cpu_devices(2)));
  const auto x = torch::randn({8, 3});
  // Scatter splits the short tensor into 1 chunk: the long one's second half would be dropped.
  TORCHDP_CHECK_THROWS_WITH(dp->forward(x, torch::randn({1, 3})), "torchdp::DataParallel",
                            "forward argument 0 has 8 but forward argument 1 has 1",
                            "only 1 chunk(s) for 2 devices");
  CHECK_THROWS_AS(dp->forward(x, torch::randn({1, 3})), c10::ValueError);
  // A batch smaller than the devices on every tensor still runs, on fewer replicas.
  const auto a = torch::randn({1, 3});
  const auto b = torch::randn({1, 3});
  CHECK(torch::allclose(dp->forward(a, b), module->forward(a, b)));
}

TEST_CASE("a tensor of one row per device gives the replicas that run their rows",
          "[cpu][data_parallel]") {
  TwoInputs module;
  torchdp::DataParallel dp(module, on(cpu_devices(3)));
  // Note [Per-replica rows]: 4 rows split into 2 chunks on 3 devices; y holds a row per device.
  const auto x = torch::randn({4, 3});
  const auto y = torch::randn({3, 3});
  const auto want = torch::cat({module->forward(x.slice(0, 0, 2), y.slice(0, 0, 1)),
                                module->forward(x.slice(0, 2, 4), y.slice(0, 1, 2))});
  CHECK(torch::allclose(dp->forward(x, y), want, 1e-5, 1e-6));
  // Rows that are neither the batch's nor one per device are still not cut.
  TORCHDP_CHECK_THROWS_WITH(dp->forward(x, torch::randn({6, 3})), "torchdp::DataParallel",
                            "forward argument 1 has 6 but forward argument 0 has 4");
}

TEST_CASE("the masked layer needs its post-replicate hook on a second device",
          "[cpu][data_parallel][hooks]") {
  torch::manual_seed(12);
  MaskedNet net;
  const auto x = torch::randn({4, 6});
  SECTION("without a hook, replica 1 keeps the device-0 cache and fails") {
    torchdp::DataParallel dp(net, on({torch::kCPU, torch::kMeta}).output_device(torch::kMeta));
    TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "Caught c10::Error in replica 1 on device meta",
                              "device");
  }
  SECTION("with a hook, every replica's tensors are on its device") {
    std::vector<torch::Device> cache_devices;
    auto handle = torchdp::register_post_replicate_hook<MaskedLinear>(
        [&](MaskedLinearImpl& replica, const MaskedLinearImpl&, torch::Device, int64_t,
            torchdp::ReplicaContext&) {
          replica.refresh_cache();
          cache_devices.push_back(replica.cache_.device());
        });
    torchdp::DataParallel dp(net, on({torch::kCPU, torch::kMeta}).output_device(torch::kMeta));
    auto out = dp->forward(x);
    handle.remove();
    CHECK(out.device().is_meta());
    CHECK(out.sizes() == torch::IntArrayRef{4, 4});
    CHECK(cache_devices == std::vector<torch::Device>{torch::kCPU, torch::kMeta});
    // The original's cache and mask are untouched.
    CHECK(net->masked->cache_.device().is_cpu());
    CHECK(net->masked->mask.device().is_cpu());
  }
  SECTION("with a hook, outputs and gradients equal the unwrapped module's") {
    auto handle = torchdp::register_post_replicate_hook<MaskedLinear>(
        [](MaskedLinearImpl& replica, const MaskedLinearImpl&, torch::Device, int64_t,
           torchdp::ReplicaContext&) {
          replica.refresh_cache();
        });
    MaskedNet reference;
    copy_state(*reference, *net);
    reference->masked->refresh_cache();
    torchdp::DataParallel dp(net, on(cpu_devices(3)));
    auto out = dp->forward(x);
    auto expected = reference->forward(x);
    handle.remove();
    CHECK(torch::allclose(out, expected, 1e-5, 1e-6));
    out.sum().backward();
    expected.sum().backward();
    CHECK(
        torch::allclose(net->masked->weight.grad(), reference->masked->weight.grad(), 1e-5, 1e-6));
    CHECK(torch::allclose(net->fc1->weight.grad(), reference->fc1->weight.grad(), 1e-5, 1e-6));
  }
}

TEST_CASE("a module left off device_ids[0] fails at the first forward, or is placed on request",
          "[cpu][data_parallel]") {
  torch::manual_seed(13);
  MaskedNet net; // on the CPU
  const auto devices = std::vector<torch::Device>{torch::kMeta, torch::kMeta};
  SECTION("construction stays silent, the forward names the parameter and the fix") {
    torchdp::DataParallel dp(net, on(devices));
    TORCHDP_CHECK_THROWS_WITH(dp->forward(torch::randn({4, 6})), "torchdp::DataParallel",
                              "module must have its parameters and buffers on device meta "
                              "(device_ids[0]) but found one of them on device: cpu",
                              "parameter 'fc1.weight'", "place_module(true)");
    CHECK(net->fc1->weight.device().is_cpu());
  }
  SECTION("place_module refuses to move the module to meta, where no replica can be cloned") {
    torchdp::DataParallel dp(net, on(devices).place_module(true));
    TORCHDP_CHECK_THROWS_WITH(dp->forward(torch::randn({4, 6})), "torchdp::DataParallel",
                              "place_module(true) would move the module to meta", "{cpu, meta}");
    CHECK(net->fc1->weight.device().is_cpu());
  }
  // place_module's move needs a real second backend: see test_cuda.cpp ("a CPU model wrapped for
  // GPUs"); LibTorch cannot clone modules whose tensors live on meta.
}

TEST_CASE("DataParallel rejects bad arguments with clear errors", "[cpu][data_parallel]") {
  torch::nn::Linear linear(3, 3);
  SECTION("an empty device list") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::DataParallel(linear, on({})), "torchdp::DataParallel",
                              "device_ids is an empty list");
  }
  SECTION("an unknown device") {
    if (torchdp::cuda_device_count() == 0) {
      TORCHDP_CHECK_THROWS_WITH(
          torchdp::DataParallel(linear, on({torch::kCPU, torch::Device("cuda:1")})),
          "torchdp::DataParallel", "cuda:1", "no CUDA device is visible");
    } else {
      const auto bad =
          torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(torchdp::cuda_device_count()));
      TORCHDP_CHECK_THROWS_WITH(torchdp::DataParallel(linear, on({bad})), "torchdp::DataParallel",
                                "does not exist");
    }
  }
  SECTION("a device type torchdp does not run on") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::DataParallel(linear, on({torch::Device(c10::DeviceType::XPU)})),
        "torchdp::DataParallel", "not supported");
  }
  SECTION("a 0-dim input") {
    torchdp::DataParallel dp(linear, on(cpu_devices(2)));
    TORCHDP_CHECK_THROWS_WITH(dp->forward(torch::ones({})), "torchdp::DataParallel",
                              "0-dim tensor");
  }
  SECTION("a dim the input does not have") {
    torchdp::DataParallel dp(linear, on(cpu_devices(2)).dim(2));
    TORCHDP_CHECK_THROWS_WITH(dp->forward(torch::ones({4, 3})), "torchdp::DataParallel",
                              "dim 2 (DataParallelOptions::dim) is out of range", "of shape [4, 3]",
                              "[-2, 1]");
  }
  SECTION("a dim the input does not have, for data_parallel") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::data_parallel(linear, torch::ones({4, 3}), cpu_devices(2), std::nullopt, 2),
        "torchdp::data_parallel", "dim 2 is out of range", "of shape [4, 3]", "[-2, 1]");
  }
  SECTION("an empty device list for data_parallel") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::data_parallel(linear, torch::ones({2, 3}), std::vector<torch::Device>{}),
        "torchdp::data_parallel", "at least one device");
  }
  SECTION("data_parallel without devices on a machine without CUDA") {
    if (torchdp::cuda_device_count() == 0) {
      TORCHDP_CHECK_THROWS_WITH(torchdp::data_parallel(linear, torch::ones({2, 3})),
                                "torchdp::data_parallel", "no CUDA device is visible");
    }
  }
}

TEST_CASE("without devices and without CUDA, DataParallel calls the module directly",
          "[cpu][data_parallel]") {
  if (torchdp::cuda_device_count() > 0) {
    TORCHDP_SKIP("CUDA devices are visible");
  }
  torch::nn::Linear linear(3, 2);
  torchdp::DataParallel dp(linear);
  CHECK(dp->device_ids().empty());
  CHECK_FALSE(dp->output_device().has_value());
  const auto x = torch::randn({4, 3});
  CHECK(torch::equal(dp->forward(x), linear->forward(x)));
}

TEST_CASE("DataParallel rebuilds replicas when the training flag changes", "[cpu][data_parallel]") {
  torch::manual_seed(14);
  ConvBnNet net;
  torchdp::DataParallel dp(net, on(cpu_devices(2)));
  const auto x = torch::randn({4, 3, 5, 5});
  for (int i = 0; i < 3; ++i) {
    dp->forward(x);
  }
  CHECK(dp->replicator().skeleton_builds() == 1);
  dp->eval();
  torch::NoGradGuard no_grad;
  auto out = dp->forward(x);
  CHECK(dp->replicator().skeleton_builds() == 2);
  CHECK(torch::allclose(out, net->forward(x), 1e-5, 1e-6));
}

TEST_CASE("forward_replicas and parallel_loss give the whole-batch loss and gradients",
          "[cpu][data_parallel]") {
  torch::manual_seed(21);
  const size_t n = GENERATE(as<size_t>{}, 2, 3);
  const bool mean = GENERATE(true, false);
  torch::nn::Linear linear(6, 4);
  torch::nn::Linear reference(6, 4);
  copy_state(*reference, *linear);
  torchdp::DataParallel dp(linear, on(cpu_devices(n)));
  const auto x = torch::randn({7, 6}); // chunks 4, 3 or 3, 3, 1
  const auto y = torch::randint(0, 4, {7});
  auto outputs = dp->forward_replicas(x);
  REQUIRE(outputs.size() == n);
  int64_t rows = 0;
  for (const auto& o : outputs) {
    rows += o.size(0);
  }
  CHECK(rows == 7);
  namespace F = torch::nn::functional;
  const auto reduction = mean ? torchdp::LossReduction::Mean : torchdp::LossReduction::Sum;
  auto loss = torchdp::parallel_loss(
      outputs, y,
      [mean](const at::Tensor& out, const at::Tensor& t) {
        return mean ? F::cross_entropy(out, t)
                    : F::cross_entropy(out, t, F::CrossEntropyFuncOptions().reduction(torch::kSum));
      },
      reduction);
  auto expected = mean ? F::cross_entropy(reference->forward(x), y)
                       : F::cross_entropy(reference->forward(x), y,
                                          F::CrossEntropyFuncOptions().reduction(torch::kSum));
  CHECK(torch::allclose(loss, expected, 1e-5, 1e-6));
  loss.backward();
  expected.backward();
  CHECK(torch::allclose(linear->weight.grad(), reference->weight.grad(), 1e-5, 1e-6));
  CHECK(torch::allclose(linear->bias.grad(), reference->bias.grad(), 1e-5, 1e-6));
}

TEST_CASE("cuda_graphs needs CUDA devices", "[cpu][data_parallel]") {
  torch::nn::Linear linear(3, 2);
  const auto message = error_message([&] {
    torchdp::DataParallel(linear, on(cpu_devices(2)).cuda_graphs(true));
  });
  INFO("message: " << message);
  CHECK(message.find("torchdp::DataParallel: cuda_graphs") != std::string::npos);
  CHECK((message.find("CUDA fast paths") != std::string::npos ||
         message.find("CUDA devices") != std::string::npos));
}

TEST_CASE("options read at construction may not change afterwards; the others may",
          "[cpu][data_parallel]") {
  torch::nn::Linear linear(3, 2);
  const auto x = torch::randn({4, 3});
  torchdp::DataParallel dp(linear, on(cpu_devices(2)));
  const auto before = dp->forward(x);
  SECTION("device_ids") {
    dp->options.device_ids(cpu_devices(3));
    TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "torchdp::DataParallel",
                              "options.device_ids was changed after construction", "[cpu, cpu]",
                              "[cpu, cpu, cpu]", "Make a new torchdp::DataParallel");
  }
  SECTION("output_device") {
    dp->options.output_device(torch::Device(torch::kCPU));
    TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "torchdp::DataParallel",
                              "options.output_device was changed", "unset -> cpu");
  }
  SECTION("cuda_graphs") {
    dp->options.cuda_graphs(true);
    TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "torchdp::DataParallel",
                              "options.cuda_graphs was changed", "false -> true");
  }
  SECTION("dim and bucket_cap_mb are read at each forward") {
    dp->options.dim(5);
    TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "torchdp::DataParallel", "dim 5");
    dp->options.dim(1);
    const auto x3 = torch::randn({4, 5, 3});
    // Chunks along dim 1 are strided: the matrix product takes another path than on the whole
    // batch, and its last bits may differ (the GPU machine's CPU once gave such a difference).
    const auto out3 = dp->forward(x3);
    const auto ref3 = linear(x3);
    INFO("max abs difference " << (out3 - ref3).abs().max().item<float>());
    CHECK(torch::allclose(out3, ref3, 1e-5, 1e-6));
    dp->options.dim(0).bucket_cap_mb(-1.0);
    TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "bucket_cap_mb");
    dp->options.bucket_cap_mb(0.5);
    CHECK(torch::allclose(dp->forward(x), before));
  }
}

TEST_CASE("forward_replicas on one device and parallel_loss errors", "[cpu][data_parallel]") {
  torch::nn::Linear linear(3, 2);
  torchdp::DataParallel one(linear, on(cpu_devices(1)));
  const auto x = torch::randn({4, 3});
  auto single = one->forward_replicas(x);
  REQUIRE(single.size() == 1);
  CHECK(torch::allclose(single[0], linear->forward(x)));
  // One device: forward_replicas leaves the output on the replica's device, forward moves it to
  // output_device.
  torchdp::DataParallel to_meta(linear, on(cpu_devices(1)).output_device(torch::kMeta));
  auto kept = to_meta->forward_replicas(x);
  REQUIRE(kept.size() == 1);
  CHECK(kept[0].device().is_cpu());
  CHECK(to_meta->forward(x).device().is_meta());
  // A batch of 1 on 2 devices still gathers (one replica) where output_device says.
  torchdp::DataParallel two(linear, on(cpu_devices(2)).output_device(torch::Device(torch::kCPU)));
  CHECK(two->forward(torch::randn({1, 3})).size(0) == 1);

  const auto mse = [](const at::Tensor& out, const at::Tensor& t) {
    return (out - t).pow(2).mean();
  };
  constexpr const char* api = "torchdp::parallel_loss";
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_loss({}, torch::ones({2, 2}), mse), api,
                            "got no outputs", "forward_replicas");
  auto outputs = torchdp::DataParallel(linear, on(cpu_devices(2)))->forward_replicas(x);
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_loss(outputs, torch::ones({1, 2}), mse), api,
                            "splits into 1 chunks", "2 outputs");
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_loss(outputs, torch::ones({}), mse), api,
                            "0-dim tensor");
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_loss(outputs, torch::ones({4, 2}),
                                                   [](const at::Tensor& out, const at::Tensor& t) {
                                                     return out - t;
                                                   }),
                            api, "must return a 0-dim tensor", "replica 0", "[2, 2]");
}

TEST_CASE("DataParallelOptions::bucket_cap_mb sets the gradient buckets", "[cpu][data_parallel]") {
  torch::manual_seed(5);
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  struct NetImpl : torch::nn::Cloneable<NetImpl> {
    explicit NetImpl(torch::nn::Sequential s) : seq(std::move(s)) {
      register_module("seq", seq);
    }
    void reset() override {
      seq = register_module("seq",
                            std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone()));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      return seq->forward(x);
    }
    torch::nn::Sequential seq;
  };
  auto net = std::make_shared<NetImpl>(seq);
  auto reference = std::make_shared<NetImpl>(
      torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2)));
  copy_state(*reference, *net);
  // The BroadcastBackward nodes (one per gradient bucket) reachable from an output.
  const auto buckets = [](const torch::Tensor& out) {
    std::set<const torch::autograd::Node*> seen, found;
    std::vector<torch::autograd::Node*> stack{out.grad_fn().get()};
    while (!stack.empty()) {
      auto* node = stack.back();
      stack.pop_back();
      if (node == nullptr || !seen.insert(node).second) {
        continue;
      }
      if (node->name() == "torchdp::BroadcastBackward") {
        found.insert(node);
      }
      for (const auto& edge : node->next_edges()) {
        stack.push_back(edge.function.get());
      }
    }
    return found.size();
  };
  const auto x = torch::randn({6, 4});
  torchdp::DataParallel plain(net, on(cpu_devices(2)));
  CHECK(buckets(plain->forward(x)) == 1);
  torchdp::DataParallel dp(net, on(cpu_devices(2)).bucket_cap_mb(0.000001));
  auto out = dp->forward(x);
  CHECK(buckets(out) == 4); // every parameter in a bucket of its own
  out.pow(2).sum().backward();
  reference->forward(x).pow(2).sum().backward();
  for (size_t k = 0; k < net->parameters().size(); ++k) {
    CHECK(torch::allclose(net->parameters()[k].grad(), reference->parameters()[k].grad(), 1e-5,
                          1e-6));
  }
  TORCHDP_CHECK_THROWS_WITH(torchdp::DataParallel(net, on(cpu_devices(2)).bucket_cap_mb(-2.0)),
                            "torchdp::DataParallel",
                            "bucket_cap_mb must be a non-negative number of MiB");
}

TEST_CASE("DataParallel wraps a torch::nn::Sequential directly", "[cpu][data_parallel]") {
  // Sequential's forward is a template (Note [Modules with a templated forward]).
  torch::manual_seed(11);
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  torch::nn::Sequential reference(torch::nn::Linear(4, 8), torch::nn::ReLU(),
                                  torch::nn::Linear(8, 2));
  copy_state(*reference, *net);
  torchdp::DataParallel dp(net, on(cpu_devices(3)));
  const auto x = torch::randn({9, 4});
  auto out = dp->forward(x);
  CHECK(torch::allclose(out, reference->forward(x), 1e-5, 1e-6));
  CHECK(dp->forward_replicas(x).size() == 3);
  out.pow(2).sum().backward();
  reference->forward(x).pow(2).sum().backward();
  const auto params = net->parameters();
  const auto expected = reference->parameters();
  REQUIRE(params.size() == expected.size());
  for (size_t k = 0; k < params.size(); ++k) {
    CHECK(torch::allclose(params[k].grad(), expected[k].grad(), 1e-5, 1e-6));
  }
}

// BatchNorm (running statistics updated in place on replica 0, which shares the original's
// tensors), an in-place counter, and a failure on demand in the replica whose chunk starts with 99.
struct CountsAndFailsImpl : torch::nn::Cloneable<CountsAndFailsImpl> {
  CountsAndFailsImpl() {
    reset();
  }
  void reset() override {
    bn = register_module("bn", torch::nn::BatchNorm1d(3));
    calls = register_buffer("calls", torch::zeros({}, torch::kLong));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    calls.add_(1);
    auto out = bn->forward(x);
    if (x[0][0].item<float>() == 99.F) {
      throw std::runtime_error("replica failure on demand");
    }
    return out;
  }
  torch::nn::BatchNorm1d bn{nullptr};
  torch::Tensor calls;
};
TORCH_MODULE(CountsAndFails);

namespace {
std::vector<torch::Tensor> buffer_values(torch::nn::Module& module) {
  std::vector<torch::Tensor> values;
  for (const auto& b : module.buffers()) {
    values.push_back(b.clone());
  }
  return values;
}
bool same_values(torch::nn::Module& module, const std::vector<torch::Tensor>& expected) {
  const auto now = module.buffers();
  bool same = now.size() == expected.size();
  for (size_t i = 0; same && i < now.size(); ++i) {
    same = torch::equal(now[i], expected[i]);
  }
  return same;
}
} // namespace

TEST_CASE("a failed forward leaves the buffers as they were", "[cpu][data_parallel]") {
  // Note [Buffers of failed forwards]
  CountsAndFails net;
  torchdp::DataParallel dp(net, on(cpu_devices(2)));
  const bool functional = GENERATE(false, true);
  auto run = [&](const torch::Tensor& x) {
    return functional ? torchdp::data_parallel(net, x, cpu_devices(2)) : dp->forward(x);
  };
  run(torch::randn({4, 3}));
  CHECK(net->calls.item<int64_t>() == 1);
  const auto before = buffer_values(*net);
  auto failing = torch::randn({4, 3});
  failing[2][0] = 99; // replica 1's chunk
  TORCHDP_CHECK_THROWS_WITH(run(failing), "replica failure on demand");
  CHECK(same_values(*net, before));
  // Replica 1 gets one row: BatchNorm refuses it after replica 0 updated the statistics.
  TORCHDP_CHECK_THROWS_WITH(run(torch::randn({3, 3})), "Expected more than 1 value per channel");
  CHECK(same_values(*net, before));
  if (!functional) {
    // A post-replicate hook that changes replica 0's buffer in place, then fails.
    auto handle = torchdp::register_post_replicate_hook(
        net, [](CountsAndFailsImpl& replica, const CountsAndFailsImpl&, c10::Device, int64_t index,
                torchdp::ReplicaContext&) {
          replica.calls.add_(100);
          if (index == 1) {
            throw std::runtime_error("hook failure");
          }
        });
    TORCHDP_CHECK_THROWS_WITH(run(torch::randn({4, 3})), "hook failure");
    handle.remove();
    CHECK(same_values(*net, before));
  }
  run(torch::randn({4, 3}));
  CHECK(net->calls.item<int64_t>() == 2);
  CHECK(net->bn->num_batches_tracked.item<int64_t>() == 2);
}

// An in-place counter and an output that cannot be gathered from the replica whose chunk starts
// with 99 (one column instead of the input's), in the tensor and the structured forward.
struct GatherFailsImpl : torch::nn::Cloneable<GatherFailsImpl> {
  GatherFailsImpl() {
    reset();
  }
  void reset() override {
    calls = register_buffer("calls", torch::zeros({}, torch::kLong));
  }
  static torch::Tensor output(const torch::Tensor& x) {
    return x[0][0].item<float>() == 99.F ? x.narrow(1, 0, 1) * 2 : x * 2;
  }
  torch::Tensor forward(const torch::Tensor& x) {
    calls.add_(1);
    return output(x);
  }
  torch::Tensor calls;
};
TORCH_MODULE(GatherFails);

struct GatherFailsStructuredImpl : torch::nn::Cloneable<GatherFailsStructuredImpl> {
  GatherFailsStructuredImpl() {
    reset();
  }
  void reset() override {
    calls = register_buffer("calls", torch::zeros({}, torch::kLong));
  }
  std::vector<torch::Tensor> forward(const std::vector<torch::Tensor>& xs) {
    calls.add_(1);
    return {GatherFailsImpl::output(xs.front())};
  }
  torch::Tensor calls;
};
TORCH_MODULE(GatherFailsStructured);

TEST_CASE("a failed gather leaves the buffers as they were", "[cpu][data_parallel]") {
  // Note [Buffers of failed forwards], through each front end of the step engine.
  GatherFails net;
  GatherFailsStructured structured;
  torchdp::DataParallel dp(net, on(cpu_devices(2)));
  torchdp::DataParallel dp_structured(structured, on(cpu_devices(2)));
  const int front = GENERATE(0, 1, 2);
  auto run = [&](const torch::Tensor& x) {
    if (front == 0) {
      return dp->forward(x);
    }
    if (front == 1) {
      return torchdp::data_parallel(net, x, cpu_devices(2));
    }
    return dp_structured->forward<std::vector<torch::Tensor>>(std::vector<torch::Tensor>{x})
        .front();
  };
  const auto& calls = front == 2 ? structured->calls : net->calls;
  const auto x = torch::randn({4, 3});
  CHECK(torch::allclose(run(x), x * 2));
  CHECK(calls.item<int64_t>() == 1);
  auto failing = torch::randn({4, 3});
  failing[2][0] = 99; // replica 1's chunk
  CHECK_THROWS(run(failing));
  CHECK(calls.item<int64_t>() == 1);
  run(x);
  CHECK(calls.item<int64_t>() == 2);
}

TEST_CASE("the step engine writes the buffers back when a step fails", "[cpu][data_parallel]") {
  // Note [The step engine]: a failing replica, then a failing gather, then a step that succeeds.
  torchdp::detail::Step step("torchdp::test");
  auto buffer = torch::zeros({2});
  const auto names = [](size_t k) {
    return c10::str("input ", k);
  };
  const auto split =
      step.split({torch::ones({4, 2}), torch::ones({4, 1})}, cpu_devices(2), 0, names);
  REQUIRE(split.used.size() == 2);
  REQUIRE(split.parts.size() == 2);
  CHECK(split.parts[1].size() == 2);
  CHECK(split.parts[1][0].size(0) == 2);
  const auto add_one = [&](size_t i) {
    if (i == 0) {
      buffer.add_(1);
    }
  };
  TORCHDP_CHECK_THROWS_WITH(step.run(
                                split.used, {buffer}, std::nullopt, nullptr, [] {},
                                [&](size_t i) {
                                  add_one(i);
                                  if (i == 1) {
                                    throw std::runtime_error("replica failure");
                                  }
                                }),
                            "in replica 1", "replica failure");
  CHECK(torch::equal(buffer, torch::zeros({2})));
  std::shared_ptr<torchdp::BufferSnapshot> kept;
  step.run(split.used, {buffer}, std::nullopt, &kept, [] {}, add_one);
  CHECK_THROWS(torchdp::detail::Step::gather(kept, []() -> int {
    throw std::runtime_error("gather failure");
  }));
  CHECK(torch::equal(buffer, torch::zeros({2})));
  step.run(split.used, {buffer}, std::nullopt, &kept, [] {}, add_one);
  CHECK(torchdp::detail::Step::gather(kept, [] {
          return 7;
        }) == 7);
  CHECK(torch::equal(buffer, torch::ones({2})));
  TORCHDP_CHECK_THROWS_WITH(
      step.split({torch::ones({4, 2}), torch::ones({1, 2})}, cpu_devices(2), 0, names),
      "torchdp::test", "input 0 has 4", "input 1 has 1");
}

TEST_CASE("a first forward under inference mode, then training", "[cpu][data_parallel]") {
  // The kept buffer copy is made of normal tensors, which later forwards refresh in place.
  CountsAndFails net;
  torchdp::DataParallel dp(net, on(cpu_devices(2)));
  {
    const c10::InferenceMode inference;
    dp->forward(torch::randn({4, 3}));
  }
  for (int step = 0; step < 2; ++step) {
    dp->forward(torch::randn({4, 3})).sum().backward();
  }
  CHECK(net->calls.item<int64_t>() == 3);
}
