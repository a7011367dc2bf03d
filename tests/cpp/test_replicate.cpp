#include "test_common.h"

#include <torchdp/enclosing_forward.h>

#include <thread>

using namespace torchdp_test;

namespace {
struct BaseLinearImpl : torch::nn::Cloneable<BaseLinearImpl> {
  BaseLinearImpl() {
    reset();
  }
  void reset() override {
    lin = register_module("lin", torch::nn::Linear(2, 2));
  }
  virtual torch::Tensor forward(const torch::Tensor& x) {
    return lin->forward(x);
  }
  torch::nn::Linear lin{nullptr};
};
// Inherits BaseLinearImpl's clone(), which builds a BaseLinearImpl.
struct DerivedLinearImpl : BaseLinearImpl {
  torch::Tensor forward(const torch::Tensor& x) override {
    return lin->forward(x) + 100;
  }
};
} // namespace

namespace {

bool same_storage(const torch::Tensor& a, const torch::Tensor& b) {
  return a.data_ptr() == b.data_ptr();
}

} // namespace

TEST_CASE("replicate puts every parameter and buffer on its device", "[cpu][replicate]") {
  torch::manual_seed(0);
  ConvBnNet net;
  const auto devices = GENERATE(std::vector<torch::Device>{torch::kCPU, torch::kCPU},
                                std::vector<torch::Device>{torch::kCPU, torch::kCPU, torch::kCPU},
                                std::vector<torch::Device>{torch::kCPU, torch::kMeta});
  auto replicas = torchdp::replicate(net, devices);
  REQUIRE(replicas.size() == devices.size());
  const auto original = net->named_parameters();
  const auto original_buffers = net->named_buffers();
  for (size_t j = 0; j < replicas.size(); ++j) {
    const auto params = replicas[j]->named_parameters();
    const auto buffers = replicas[j]->named_buffers();
    REQUIRE(params.size() == original.size());
    REQUIRE(buffers.size() == original_buffers.size());
    for (const auto& p : params) {
      INFO("replica " << j << " parameter " << p.key());
      CHECK(p.value().device() == devices[j]);
      CHECK(p.value().sizes() == original[p.key()].sizes());
      if (j == 0) {
        CHECK(same_storage(p.value(), original[p.key()]));
      } else if (!devices[j].is_meta()) {
        CHECK_FALSE(same_storage(p.value(), original[p.key()]));
        CHECK(torch::equal(p.value(), original[p.key()]));
      }
    }
    for (const auto& b : buffers) {
      INFO("replica " << j << " buffer " << b.key());
      CHECK(b.value().device() == devices[j]);
      if (j == 0) {
        CHECK(same_storage(b.value(), original_buffers[b.key()]));
      }
    }
  }
}

TEST_CASE("replica parameters are non-leaf copies whose gradients sum into the original",
          "[cpu][replicate]") {
  torch::manual_seed(1);
  torch::nn::Linear linear(4, 3);
  const auto devices = cpu_devices(3);
  auto replicas = torchdp::replicate(linear, devices);
  std::vector<torch::Tensor> inputs;
  torch::Tensor loss = torch::zeros({});
  for (size_t j = 0; j < replicas.size(); ++j) {
    CHECK_FALSE(replicas[j]->weight.is_leaf());
    CHECK(replicas[j]->weight.requires_grad());
    REQUIRE(replicas[j]->weight.grad_fn() != nullptr);
    CHECK(replicas[j]->weight.grad_fn()->name() == "torchdp::BroadcastBackward");
    inputs.push_back(torch::randn({2, 4}));
    loss = loss + replicas[j]->forward(inputs.back()).pow(2).sum() * static_cast<double>(j + 1);
  }
  loss.backward();

  torch::nn::Linear reference(4, 3);
  {
    torch::NoGradGuard no_grad;
    reference->weight.copy_(linear->weight);
    reference->bias.copy_(linear->bias);
  }
  torch::Tensor ref_loss = torch::zeros({});
  for (size_t j = 0; j < inputs.size(); ++j) {
    ref_loss = ref_loss + reference->forward(inputs[j]).pow(2).sum() * static_cast<double>(j + 1);
  }
  ref_loss.backward();
  CHECK(torch::allclose(linear->weight.grad(), reference->weight.grad(), 1e-5, 1e-6));
  CHECK(torch::allclose(linear->bias.grad(), reference->bias.grad(), 1e-5, 1e-6));
  CHECK(torch::allclose(loss, ref_loss, 1e-5, 1e-6));
}

TEST_CASE("detach mode and no_grad give replicas without history", "[cpu][replicate]") {
  torch::nn::Linear linear(3, 3);
  SECTION("detach=true") {
    auto replicas = torchdp::replicate(linear, cpu_devices(2), /*detach=*/true);
    for (auto& r : replicas) {
      CHECK_FALSE(r->weight.requires_grad());
      CHECK(r->weight.grad_fn() == nullptr);
    }
  }
  SECTION("under NoGradGuard") {
    torch::NoGradGuard no_grad;
    auto replicas = torchdp::replicate(linear, cpu_devices(2));
    for (auto& r : replicas) {
      CHECK_FALSE(r->weight.requires_grad());
    }
  }
  SECTION("frozen parameters stay frozen") {
    linear->bias.set_requires_grad(false);
    auto replicas = torchdp::replicate(linear, cpu_devices(2));
    CHECK(replicas[1]->weight.requires_grad());
    CHECK_FALSE(replicas[1]->bias.requires_grad());
  }
}

TEST_CASE("replica skeletons are built once and refreshed on later calls", "[cpu][replicate]") {
  auto linear = std::make_shared<torch::nn::LinearImpl>(4, 4);
  torchdp::Replicator replicator(linear);
  auto first = replicator.replicate(cpu_devices(2));
  {
    torch::NoGradGuard no_grad;
    linear->weight.mul_(2.0);
  }
  auto second = replicator.replicate(cpu_devices(2));
  CHECK(replicator.skeleton_builds() == 1);
  CHECK(replicator.module().get() == linear.get());
  CHECK(first[1].get() == second[1].get());
  auto replica = std::dynamic_pointer_cast<torch::nn::LinearImpl>(second[1]);
  CHECK(torch::equal(replica->weight, linear->weight));
  CHECK_FALSE(same_storage(replica->weight, linear->weight));

  SECTION("a training flag change rebuilds") {
    linear->eval();
    auto third = replicator.replicate(cpu_devices(2));
    CHECK(replicator.skeleton_builds() == 2);
    CHECK_FALSE(third[1]->is_training());
    CHECK_FALSE(third[0]->is_training());
  }
  SECTION("another device list builds its own skeletons") {
    replicator.replicate(cpu_devices(3));
    CHECK(replicator.skeleton_builds() == 2);
    replicator.replicate(cpu_devices(2));
    CHECK(replicator.skeleton_builds() == 2);
  }
  SECTION("invalidate() rebuilds") {
    replicator.invalidate();
    replicator.replicate(cpu_devices(2));
    CHECK(replicator.skeleton_builds() == 2);
  }
}

TEST_CASE("a structure change rebuilds the skeletons", "[cpu][replicate]") {
  torch::nn::Sequential seq(torch::nn::Linear(3, 3), torch::nn::ReLU());
  torchdp::Replicator replicator(seq.ptr());
  replicator.replicate(cpu_devices(2));
  seq->push_back(torch::nn::Linear(3, 2));
  auto replicas = replicator.replicate(cpu_devices(2));
  CHECK(replicator.skeleton_builds() == 2);
  auto replica = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(replicas[1]);
  REQUIRE(replica->size() == 3);
  CHECK(replica->forward(torch::ones({1, 3})).size(1) == 2);
}

TEST_CASE("skeletons are not re-initialised: replicas always equal the original",
          "[cpu][replicate]") {
  torch::manual_seed(3);
  torch::nn::Sequential mlp(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  const auto x = torch::randn({5, 8});
  for (int step = 0; step < 3; ++step) {
    auto replicas = torchdp::replicate(mlp, cpu_devices(2));
    CHECK(torch::allclose(replicas[1]->forward(x), mlp->forward(x)));
    torch::NoGradGuard no_grad;
    for (auto& p : mlp->parameters()) {
      p.add_(0.1);
    }
  }
}

TEST_CASE("BatchNorm running stats updated on replica 0 persist in the original",
          "[cpu][replicate]") {
  torch::manual_seed(4);
  ConvBnNet net;
  ConvBnNet reference;
  copy_state(*reference, *net);
  const auto x0 = torch::randn({3, 3, 5, 5});
  const auto x1 = torch::randn({3, 3, 5, 5}) * 5 + 2;
  auto replicas = torchdp::replicate(net, cpu_devices(2));
  replicas[0]->forward(x0);
  replicas[1]->forward(x1);
  reference->forward(x0);
  // Replica 0's in-place updates land in the original; replica 1's are lost, as in PyTorch.
  CHECK(torch::allclose(net->bn->running_mean, reference->bn->running_mean));
  CHECK(torch::allclose(net->bn->running_var, reference->bn->running_var));
  CHECK(net->bn->num_batches_tracked.item<int64_t>() == 1);
  CHECK_FALSE(torch::allclose(replicas[1]->bn->running_mean, net->bn->running_mean));
}

TEST_CASE("shared submodules and tied parameters stay shared inside each replica",
          "[cpu][replicate]") {
  torch::manual_seed(5);
  SharedNet net;
  auto replicas = torchdp::replicate(net, cpu_devices(2));
  const auto x = torch::randn({4, 5});
  for (auto& r : replicas) {
    CHECK(r->a.get() == r->b.get());
    CHECK(r->a->weight.unsafeGetTensorImpl() == r->b->weight.unsafeGetTensorImpl());
  }
  auto out = replicas[1]->forward(x);
  CHECK(torch::allclose(out, net->forward(x)));
  out.sum().backward();

  SharedNet reference;
  copy_state(*reference, *net);
  reference->forward(x).sum().backward();
  CHECK(torch::allclose(net->a->weight.grad(), reference->a->weight.grad(), 1e-5, 1e-6));
  CHECK(torch::allclose(net->scale.grad(), reference->scale.grad(), 1e-5, 1e-6));
}

TEST_CASE("replicate never writes the original's tensors", "[cpu][replicate]") {
  torch::manual_seed(6);
  MaskedNet net;
  std::vector<torch::Tensor> before;
  std::vector<void*> pointers;
  for (const auto& t : net->parameters()) {
    before.push_back(t.detach().clone());
    pointers.push_back(t.data_ptr());
  }
  auto replicas = torchdp::replicate(net, cpu_devices(3));
  for (auto& r : replicas) {
    r->forward(torch::randn({2, 6})).sum().backward();
  }
  const auto after = net->parameters();
  for (size_t i = 0; i < after.size(); ++i) {
    CHECK(torch::equal(after[i], before[i]));
    CHECK(after[i].data_ptr() == pointers[i]);
    CHECK(after[i].is_leaf());
  }
}

TEST_CASE("a module away from devices[0] is copied to every device", "[cpu][replicate]") {
  torch::nn::Linear linear(3, 2);
  auto replicas = torchdp::replicate(linear, {torch::kMeta, torch::kMeta});
  for (auto& r : replicas) {
    CHECK(r->weight.device().is_meta());
    CHECK(r->weight.grad_fn() != nullptr);
  }
  CHECK(linear->weight.device().is_cpu());
}

TEST_CASE("replicate rejects what it cannot replicate, with clear errors", "[cpu][replicate]") {
  SECTION("a module that is not Cloneable") {
    Plain plain;
    TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(plain, cpu_devices(2)), "torchdp::replicate",
                              "Cloneable", "PlainImpl");
  }
  SECTION("tensors on several devices") {
    torch::nn::Sequential seq(torch::nn::Linear(2, 2), torch::nn::Linear(2, 2));
    torchdp::detail::move_module(*seq[1], torch::kMeta);
    TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(seq, cpu_devices(2)), "torchdp::replicate",
                              "'0.weight' is on cpu", "'1.weight' is on meta");
  }
  SECTION("a class derived from a Cloneable module, which inherits its base's clone()") {
    auto derived = std::make_shared<DerivedLinearImpl>();
    TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(derived, cpu_devices(2)), "torchdp::replicate",
                              "DerivedLinearImpl", "BaseLinearImpl", "torch::nn::Cloneable<");
    torch::nn::Sequential seq(torch::nn::Linear(2, 2));
    seq->push_back(derived);
    TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(seq, cpu_devices(2)), "module '1'",
                              "DerivedLinearImpl");
  }
  SECTION("an empty device list") {
    torch::nn::Linear linear(2, 2);
    TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(linear, {}), "torchdp::replicate",
                              "at least one device");
  }
  SECTION("an unknown device") {
    if (torchdp::cuda_device_count() == 0) {
      torch::nn::Linear linear(2, 2);
      TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(linear, {torch::kCPU, torch::Device("cuda:3")}),
                                "torchdp::replicate", "cuda:3", "no CUDA device is visible");
    }
  }
}

TEST_CASE("a device may be listed more than once", "[cpu][replicate]") {
  torch::nn::Linear linear(2, 2);
  auto replicas = torchdp::replicate(linear, {torch::kCPU, torch::kCPU, torch::kCPU, torch::kCPU});
  REQUIRE(replicas.size() == 4);
  CHECK(replicas[2].get() != replicas[3].get());
  CHECK(replicas[2]->weight.data_ptr() != replicas[3]->weight.data_ptr());
}

TEST_CASE("a Replicator does not keep its module alive", "[cpu][replicate]") {
  auto linear = std::make_shared<torch::nn::LinearImpl>(2, 2);
  torchdp::Replicator replicator(linear);
  replicator.replicate(cpu_devices(2));
  std::weak_ptr<torch::nn::LinearImpl> weak = linear;
  linear.reset();
  CHECK(weak.expired());
  CHECK(replicator.module() == nullptr);
  TORCHDP_CHECK_THROWS_WITH(replicator.replicate(cpu_devices(2)), "torchdp::replicate",
                            "destroyed");
}

TEST_CASE("clear_replica_cache releases what the cache keeps of a destroyed module",
          "[cpu][replicate]") {
  // The functional API caches skeletons per module; they keep the module's parameters alive
  // through their autograd edges until the next call, or until clear_replica_cache().
  torch::nn::Linear lin(3, 4);
  const c10::weak_intrusive_ptr<c10::TensorImpl> weight(lin->weight.getIntrusivePtr());
  {
    auto replicas = torchdp::replicate(lin, cpu_devices(2));
    replicas[1]->forward(torch::randn({2, 3})).sum().backward();
  }
  lin = torch::nn::Linear(nullptr); // the module is gone
  CHECK_FALSE(weight.expired());    // the cached skeletons still hold it
  torchdp::clear_replica_cache();
  CHECK(weight.expired());
  // The functional API works on after a clear.
  torch::nn::Linear other(3, 4);
  CHECK(torchdp::replicate(other, cpu_devices(2)).size() == 2);
}

TEST_CASE("building replicas leaves the random number stream alone", "[cpu][replicate]") {
  // Skeletons are made with clone(), whose reset() initialises parameters from the default
  // generator; the caller's next random numbers must not depend on whether one was built.
  torch::nn::Linear lin(3, 4);
  torch::manual_seed(7);
  const auto expected = torch::rand({5});
  torch::manual_seed(7);
  auto replicas = torchdp::replicate(lin, cpu_devices(3)); // builds three skeletons
  CHECK(torch::equal(torch::rand({5}), expected));
  lin->eval(); // a training-flag change rebuilds them
  torch::manual_seed(7);
  replicas = torchdp::replicate(lin, cpu_devices(3));
  CHECK(torch::equal(torch::rand({5}), expected));
}

TEST_CASE("a skeleton's own tensors are freed as soon as it is built", "[cpu][replicate]") {
  // clone() copies every tensor of the module; those copies are replaced at the first rebind, so
  // each is freed right after its skeleton is built (n skeletons never hold n copies at once).
  torch::nn::Linear lin(64, 64);
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> cloned;
  torchdp::Replicator replicator(lin.ptr(),
                                 [&lin, &cloned]() -> std::shared_ptr<torch::nn::Module> {
                                   // Each earlier skeleton's copies are gone by the time the next
                                   // one is cloned.
                                   for (const auto& storage : cloned) {
                                     CHECK(storage.expired());
                                   }
                                   auto copy = lin->clone();
                                   for (const auto& p : copy->parameters()) {
                                     cloned.emplace_back(p.storage().getWeakStorageImpl());
                                   }
                                   return copy;
                                 });
  auto replicas = replicator.replicate(cpu_devices(3));
  CHECK(cloned.size() == 6);
  for (const auto& storage : cloned) {
    CHECK(storage.expired());
  }
  // The replicas themselves hold the broadcast copies.
  CHECK(torch::equal(replicas[2]->parameters()[0], lin->weight));
}

TEST_CASE("a snapshot inside an enclosing forward's tasks is nesting, not another forward",
          "[cpu][replicate]") {
  // Note [Nested forwards]: a forward's replicas run under its EnclosingForwardGuard, which
  // parallel_run carries into its tasks.
  auto a = torch::zeros({3});
  torchdp::BufferSnapshot outer;
  outer.take({a});
  a.add_(1); // the enclosing forward's own update
  size_t inner_restored = 99;
  {
    const torchdp::detail::EnclosingForwardGuard enclosing(outer.take_id());
    torchdp::parallel_run(2, {torch::kCPU, torch::kCPU}, [&](size_t i) {
      if (i == 1) {
        torchdp::BufferSnapshot inner;
        inner.take({a});
        a.add_(10);
        inner_restored = inner.restore(); // the nested forward fails: its update undone
        inner.release();
      }
    });
  }
  CHECK(inner_restored == 1);
  CHECK(torch::equal(a, torch::ones({3})));
  CHECK(outer.restore() == 1); // and the enclosing one's too
  CHECK(torch::equal(a, torch::zeros({3})));
  outer.release();

  // A forward in a thread of its own is another forward: neither rolls back over the other.
  outer.take({a});
  size_t other_restored = 99;
  std::thread([&] {
    torchdp::BufferSnapshot other;
    other.take({a});
    a.add_(1);
    other_restored = other.restore();
    other.release();
  }).join();
  CHECK(other_restored == 0);
  CHECK(outer.restore() == 0);
  CHECK(torch::equal(a, torch::ones({3})));
  outer.release();
}
