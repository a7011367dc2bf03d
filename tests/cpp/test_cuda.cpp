// The same machinery on CUDA devices, plus parity with LibTorch's data_parallel and the NCCL
// transport. CPU builds compile this file but register none of its cases (see CMakeLists.txt).
#include "test_common.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#if TORCHDP_WITH_CUDA
#include <torch/nn/parallel/data_parallel.h>
#endif

using namespace torchdp_test;

namespace {

torchdp::PostReplicateHookHandle masked_hook() {
  return torchdp::register_post_replicate_hook<MaskedLinear>(
      [](MaskedLinearImpl& replica, const MaskedLinearImpl&, torch::Device, int64_t,
         torchdp::ReplicaContext&) {
        replica.refresh_cache();
      });
}

/// A Cloneable MLP (Sequential cannot be held by DataParallel: its forward is a template).
struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(10, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::relu(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

} // namespace

TEST_CASE("CUDA: replicas live on their GPUs and replica 0 shares storage", "[multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  torch::manual_seed(20);
  ConvBnNet net;
  net->to(devices[0]);
  auto replicas = torchdp::replicate(net, devices);
  const auto original = net->named_parameters();
  for (size_t j = 0; j < 2; ++j) {
    for (const auto& p : replicas[j]->named_parameters()) {
      CHECK(p.value().device() == devices[j]);
      CHECK((p.value().data_ptr() == original[p.key()].data_ptr()) == (j == 0));
      CHECK(torch::equal(p.value().cpu(), original[p.key()].cpu()));
    }
    for (const auto& b : replicas[j]->named_buffers()) {
      CHECK(b.value().device() == devices[j]);
    }
  }
}

TEST_CASE("CUDA: DataParallel equals the single-GPU module, BatchNorm included", "[multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  torch::manual_seed(21);
  ConvBnNet single;
  ConvBnNet model;
  copy_state(*model, *single);
  single->to(devices[0]);
  model->to(devices[0]);
  torchdp::DataParallel dp(model, torchdp::DataParallelOptions().device_ids(devices));
  const auto x = torch::randn({8, 3, 5, 5}).to(devices[0]);
  // Training mode: replica 0 normalises the first half-batch and its running statistics land in
  // the original, as with torch.nn.DataParallel.
  auto out = dp->forward(x);
  CHECK(out.device() == devices[0]);
  single->forward(x.narrow(0, 0, 4));
  CHECK(torch::allclose(model->bn->running_mean, single->bn->running_mean, 1e-5, 1e-6));
  CHECK(torch::allclose(model->bn->running_var, single->bn->running_var, 1e-5, 1e-6));
  CHECK(model->bn->num_batches_tracked.item<int64_t>() == 1);
  // Evaluation mode: outputs and gradients equal the single-GPU module's.
  single->eval();
  dp->eval();
  auto a = single->forward(x);
  auto b = dp->forward(x);
  CHECK(torch::allclose(a, b, 1e-4, 1e-5));
  a.pow(2).sum().backward();
  b.pow(2).sum().backward();
  const auto pa = single->named_parameters();
  for (const auto& p : model->named_parameters()) {
    INFO("parameter " << p.key());
    CHECK(torch::allclose(p.value().grad(), pa[p.key()].grad(), 1e-4, 1e-5));
  }
}

TEST_CASE("CUDA: numerical equivalence with serial training over 3 SGD steps", "[multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  torch::manual_seed(22);
  Mlp serial;
  Mlp model;
  copy_state(*model, *serial);
  serial->to(devices[0]);
  model->to(devices[0]);
  torchdp::DataParallel dp(model, torchdp::DataParallelOptions().device_ids(devices));
  torch::optim::SGD opt_serial(serial->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_dp(dp->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({16, 10}).to(devices[0]);
    opt_serial.zero_grad();
    opt_dp.zero_grad();
    serial->forward(x).pow(2).sum().backward();
    dp->forward(x).pow(2).sum().backward();
    opt_serial.step();
    opt_dp.step();
    const auto a = serial->parameters();
    const auto b = model->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(torch::allclose(a[i], b[i], 1e-4, 1e-5));
    }
  }
}

TEST_CASE("CUDA: the masked layer fails on GPU 1 without a hook and matches with one",
          "[multi-cuda][hooks]") {
  TORCHDP_NEED_CUDA(devices, 2);
  torch::manual_seed(23);
  MaskedNet net;
  MaskedNet reference;
  copy_state(*reference, *net);
  net->to(devices[0]);
  net->masked->refresh_cache();
  reference->to(devices[0]);
  reference->masked->refresh_cache();
  torchdp::DataParallel dp(net, torchdp::DataParallelOptions().device_ids(devices));
  const auto x = torch::randn({6, 6}).to(devices[0]);
  TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "in replica 1 on device cuda:1");
  auto handle = masked_hook();
  auto out = dp->forward(x);
  auto replicas = torchdp::replicate(net, devices);
  handle.remove();
  auto expected = reference->forward(x);
  CHECK(torch::allclose(out, expected, 1e-5, 1e-6));
  out.sum().backward();
  expected.sum().backward();
  CHECK(torch::allclose(net->masked->weight.grad(), reference->masked->weight.grad(), 1e-5, 1e-6));
}

TEST_CASE("CUDA: outputs go where output_device says", "[multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  torch::nn::Linear linear(3, 3);
  linear->to(devices[0]);
  const auto x = torch::randn({4, 3}).to(devices[0]);
  CHECK(torchdp::data_parallel(linear, x, devices, devices[1]).device() == devices[1]);
  CHECK(torchdp::data_parallel(linear, x, devices, torch::Device(torch::kCPU)).device().is_cpu());
  CHECK(torchdp::data_parallel(linear, x, std::vector<torch::Device>{devices[1]}, devices[0])
            .device() == devices[0]);
  // Every visible device is used by default: one output row per device with a batch of count rows.
  const auto count = torchdp::cuda_device_count();
  torch::nn::Linear one(3, 1);
  one->to(devices[0]);
  auto out = torchdp::data_parallel(one, torch::randn({count, 3}).to(devices[0]));
  CHECK(out.numel() == count);
}

#if TORCHDP_WITH_CUDA
TEST_CASE("CUDA: results equal LibTorch's torch::nn::parallel::data_parallel", "[multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  torch::manual_seed(24);
  torch::nn::Sequential a(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 2));
  torch::nn::Sequential b(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 2));
  copy_state(*b, *a);
  a->to(devices[0]);
  b->to(devices[0]);
  const auto x = torch::randn({12, 8}).to(devices[0]);
  auto ours = torchdp::data_parallel(a, x, devices);
  auto theirs = torch::nn::parallel::data_parallel(b, x, devices);
  CHECK(torch::allclose(ours, theirs, 1e-5, 1e-6));
  ours.sum().backward();
  theirs.sum().backward();
  const auto pa = a->parameters();
  const auto pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    CHECK(torch::allclose(pa[i].grad(), pb[i].grad(), 1e-5, 1e-6));
  }
}
#endif

TEST_CASE("CUDA: differentiable scatter and gather", "[multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  auto x = torch::randn({6, 3}, torch::requires_grad());
  auto chunks = torchdp::autograd::scatter(x, devices);
  REQUIRE(chunks.size() == 2);
  CHECK(chunks[0].device() == devices[0]);
  CHECK(chunks[1].device() == devices[1]);
  auto y = torchdp::autograd::gather({chunks[0] * 2, chunks[1] * 3}, devices[0]);
  y.sum().backward();
  auto expected = torch::cat({torch::full({3, 3}, 2.0), torch::full({3, 3}, 3.0)});
  CHECK(torch::equal(x.grad(), expected));
  CHECK(torch::equal(y.cpu(), torch::cat({x.narrow(0, 0, 3) * 2, x.narrow(0, 3, 3) * 3}).detach()));
}

TEST_CASE("CUDA: workers run on their replica's device", "[multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  std::vector<c10::DeviceIndex> seen(2, -1);
  torchdp::parallel_run(2, devices, [&](size_t i) {
    seen[i] = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index();
  });
  CHECK(seen == std::vector<c10::DeviceIndex>{0, 1});
}

TEST_CASE("CUDA: a CPU model wrapped for GPUs fails at the first forward, or is placed", "[cuda]") {
  TORCHDP_NEED_CUDA(devices, 1);
  torch::nn::Linear linear(3, 3);
  torchdp::DataParallel dp(linear, torchdp::DataParallelOptions().device_ids(devices));
  TORCHDP_CHECK_THROWS_WITH(dp->forward(torch::randn({2, 3}).to(devices[0])),
                            "module must have its parameters and buffers on device cuda:0",
                            "parameter 'weight'", "place_module(true)");
  torchdp::DataParallel placed(
      linear, torchdp::DataParallelOptions().device_ids(devices).place_module(true));
  CHECK(placed->forward(torch::randn({2, 3})).device() == devices[0]);
  CHECK(linear->weight.device() == devices[0]);
}

TEST_CASE("NCCL: coalesced broadcast and reduce give exact results", "[nccl][multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  if (!torchdp::has_nccl()) {
    if (cuda_required()) {
      FAIL("TORCHDP_REQUIRE_CUDA=1 but torchdp was built without NCCL");
    }
    TORCHDP_SKIP("built without NCCL");
  }
  std::vector<torch::Tensor> tensors{
      torch::randn({1000, 3}).to(devices[0]), torch::arange(17).to(devices[0]),
      torch::randn({5}, torch::kHalf).to(devices[0]),
      torch::ones({2, 2}, torch::kBool).to(devices[0]), torch::randn({0}).to(devices[0]),
      // Lazy conjugate and negative views: NCCL sends bytes, which are not their values.
      torch::randn({4}, torch::kComplexFloat).to(devices[0]).conj(),
      torch::randn({6}).to(devices[0])._neg_view()};
  auto copies = torchdp::comm::broadcast_coalesced(tensors, devices, /*buffer_size=*/4096);
  for (size_t k = 0; k < tensors.size(); ++k) {
    INFO("tensor " << k);
    CHECK(copies[0][k].is_same(tensors[k]));
    CHECK(copies[1][k].device() == devices[1]);
    CHECK(torch::equal(copies[1][k].cpu(), tensors[k].cpu()));
  }
  std::vector<std::vector<torch::Tensor>> per_device{
      {torch::ones({300, 7}).to(devices[0]), torch::full({3}, 2, torch::kLong).to(devices[0])},
      {torch::full({300, 7}, 2.0).to(devices[1]),
       torch::full({3}, 5, torch::kLong).to(devices[1])}};
  for (const auto& destination : devices) {
    auto sums = torchdp::comm::reduce_add_coalesced(per_device, destination);
    CHECK(sums[0].device() == destination);
    CHECK(torch::equal(sums[0].cpu(), torch::full({300, 7}, 3.0)));
    CHECK(torch::equal(sums[1].cpu(), torch::full({3}, 7, torch::kLong)));
  }
}

namespace {

// Copies of one module on devices[0], wrapped eagerly and with cuda_graphs.
template <typename Holder>
struct GraphedPair {
  explicit GraphedPair(const std::vector<torch::Device>& devices) {
    copy_state(*graphed_model, *eager_model);
    eager_model->to(devices[0]);
    graphed_model->to(devices[0]);
    eager = torchdp::DataParallel(eager_model, torchdp::DataParallelOptions().device_ids(devices));
    graphed = torchdp::DataParallel(
        graphed_model, torchdp::DataParallelOptions().device_ids(devices).cuda_graphs(true));
  }
  Holder eager_model;
  Holder graphed_model;
  torchdp::DataParallel eager{nullptr};
  torchdp::DataParallel graphed{nullptr};
};

// Steps of a graphed DataParallel and an eager one on copies of the same module: outputs,
// gradients, parameters and buffers must agree after every SGD step.
template <typename Holder>
void check_graphed_steps(const std::vector<torch::Device>& devices, at::IntArrayRef shape) {
  GraphedPair<Holder> pair(devices);
  auto& [eager_model, graphed_model, eager, graphed] = pair;
  torch::optim::SGD opt_eager(eager->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_graphed(graphed->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 4; ++step) {
    INFO("step " << step);
    const auto x = torch::randn(shape).to(devices[0]);
    opt_eager.zero_grad();
    opt_graphed.zero_grad();
    auto a = eager->forward(x);
    auto b = graphed->forward(x);
    CHECK(torch::allclose(a, b, 1e-4, 1e-5));
    a.pow(2).mean().backward();
    b.pow(2).mean().backward();
    const auto pa = eager_model->named_parameters();
    for (const auto& p : graphed_model->named_parameters()) {
      INFO("gradient of " << p.key());
      REQUIRE(p.value().grad().defined());
      CHECK(torch::allclose(p.value().grad(), pa[p.key()].grad(), 1e-4, 1e-5));
    }
    opt_eager.step();
    opt_graphed.step();
    const auto ba = eager_model->named_buffers();
    for (const auto& b : graphed_model->named_buffers()) {
      INFO("buffer " << b.key());
      CHECK(torch::allclose(b.value().to(torch::kDouble), ba[b.key()].to(torch::kDouble), 1e-4,
                            1e-5));
    }
  }
  CHECK(graphed->graph_captures() == 1);
}

} // namespace

TEST_CASE("CUDA graphs: two replicas on one GPU train like the eager DataParallel", "[cuda]") {
  TORCHDP_NEED_CUDA(gpus, 1);
  const std::vector<torch::Device> devices{gpus[0], gpus[0]};
  torch::manual_seed(30);
  SECTION("MLP") {
    check_graphed_steps<Mlp>(devices, {16, 10});
  }
  SECTION("conv net with BatchNorm") {
    check_graphed_steps<ConvBnNet>(devices, {8, 3, 5, 5});
  }
  SECTION("one device") {
    check_graphed_steps<Mlp>({gpus[0]}, {16, 10});
  }
  SECTION("a shared submodule and a parameter at two positions") {
    check_graphed_steps<SharedNet>(devices, {6, 5});
  }
}

namespace {

// A forward that synchronises with the CPU, which a CUDA graph cannot capture.
struct SyncingImpl : torch::nn::Cloneable<SyncingImpl> {
  SyncingImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc(x);
    return y * (y.abs().max().item<float>() > 0 ? 1.0 : 0.0);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Syncing);

} // namespace

TEST_CASE("CUDA graphs: a failed capture leaves the random number generator working", "[cuda]") {
  TORCHDP_NEED_CUDA(gpus, 1);
  const std::vector<torch::Device> devices{gpus[0], gpus[0]};
  torch::manual_seed(34);
  Syncing model;
  model->to(devices[0]);
  torchdp::DataParallel dp(model,
                           torchdp::DataParallelOptions().device_ids(devices).cuda_graphs(true));
  const auto x = torch::randn({8, 4}).to(devices[0]);
  const auto& gen = at::globalContext().defaultGenerator(devices[0]);
  const auto before = gen.get_state();
  TORCHDP_CHECK_THROWS_WITH(dp->forward(x), "capturing the replicas' forward and backward");
  // Where it was, and usable (a generator left in capture mode raises at the next random op).
  CHECK(torch::equal(gen.get_state(), before));
  CHECK(torch::randn({3}, torch::TensorOptions().device(devices[0])).numel() == 3);
  // The module still trains eagerly.
  torchdp::DataParallel eager(model, torchdp::DataParallelOptions().device_ids(devices));
  eager->forward(x).sum().backward();
  CHECK(model->fc->weight.grad().defined());
}

TEST_CASE("CUDA graphs: two GPUs train like the eager DataParallel", "[multi-cuda]") {
  TORCHDP_NEED_CUDA(devices, 2);
  torch::manual_seed(31);
  check_graphed_steps<Mlp>(devices, {16, 10});
  check_graphed_steps<ConvBnNet>(devices, {8, 3, 5, 5});
  check_graphed_steps<SharedNet>(devices, {6, 5});
}

TEST_CASE("CUDA graphs: pending and replayed backward passes", "[cuda]") {
  TORCHDP_NEED_CUDA(gpus, 1);
  const std::vector<torch::Device> devices{gpus[0], gpus[0]};
  torch::manual_seed(32);
  GraphedPair<Mlp> pair(devices);
  auto& [eager_model, graphed_model, eager, graphed] = pair;
  const auto x1 = torch::randn({8, 10}).to(devices[0]);
  const auto x2 = torch::randn({8, 10}).to(devices[0]);
  // A second forward while the first one's backward is pending runs eagerly: same gradients.
  (graphed->forward(x1).sum() + graphed->forward(x2).pow(2).sum()).backward();
  (eager->forward(x1).sum() + eager->forward(x2).pow(2).sum()).backward();
  const auto pa = eager_model->parameters();
  const auto pb = graphed_model->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    CHECK(torch::allclose(pb[i].grad(), pa[i].grad(), 1e-4, 1e-5));
  }
  // A backward through a forward whose graphs were replayed since raises.
  auto first = graphed->forward(x1).sum();
  first.backward({}, /*retain_graph=*/true);
  graphed->forward(x1).sum().backward();
  TORCHDP_CHECK_THROWS_WITH(first.backward(), "replayed by a later forward");
  // Without a replay in between, a second backward is refused too.
  auto again = graphed->forward(x1).sum();
  again.backward({}, /*retain_graph=*/true);
  TORCHDP_CHECK_THROWS_WITH(again.backward(), "second backward pass through the same graphed");
  // Inference mode runs eagerly (and captures nothing); training goes on afterwards.
  const auto captures = graphed->graph_captures();
  {
    c10::InferenceMode inference;
    CHECK(torch::allclose(graphed->forward(x2), eager->forward(x2), 1e-4, 1e-5));
  }
  CHECK(graphed->graph_captures() == captures);
  graphed->forward(x2).sum().backward();
}

TEST_CASE("CUDA graphs: a first forward in inference mode, then training", "[cuda]") {
  TORCHDP_NEED_CUDA(gpus, 1);
  const std::vector<torch::Device> devices{gpus[0], gpus[0]};
  torch::manual_seed(33);
  GraphedPair<Mlp> pair(devices);
  auto& [eager_model, graphed_model, eager, graphed] = pair;
  const auto x = torch::randn({8, 10}).to(devices[0]);
  {
    // Nothing is built from inference tensors, which training could not refresh in place.
    c10::InferenceMode inference;
    CHECK(torch::allclose(graphed->forward(x), eager->forward(x), 1e-4, 1e-5));
  }
  CHECK(graphed->graph_captures() == 0);
  graphed->forward(x).sum().backward();
  eager->forward(x).sum().backward();
  CHECK(graphed->graph_captures() == 1);
  const auto pa = eager_model->parameters();
  const auto pb = graphed_model->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    CHECK(torch::allclose(pb[i].grad(), pa[i].grad(), 1e-4, 1e-5));
  }
}
