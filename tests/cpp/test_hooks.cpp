#include "test_common.h"

using namespace torchdp_test;

namespace {

struct Call {
  std::string path;
  const torch::nn::Module* replica;
  const torch::nn::Module* original;
  torch::Device device;
  int64_t index;
  const torchdp::ReplicaContext* ctx;
};

} // namespace

TEST_CASE("type hooks run per replica after all replicas exist, master copy first",
          "[cpu][hooks]") {
  MaskedNet net;
  std::vector<Call> calls;
  size_t replicas_seen_at_first_call = 0;
  const auto devices = std::vector<torch::Device>{torch::kCPU, torch::kMeta, torch::kCPU};
  auto handle = torchdp::register_post_replicate_hook<MaskedLinear>(
      [&](MaskedLinearImpl& replica, const MaskedLinearImpl& original, torch::Device device,
          int64_t index, torchdp::ReplicaContext& ctx) {
        if (calls.empty()) {
          // Every replica already holds its tensors on its device when the first hook runs.
          replicas_seen_at_first_call = ctx.devices().size();
        }
        calls.push_back(Call{ctx.path(), &replica, &original, device, index, &ctx});
        replica.refresh_cache();
      });
  auto replicas = torchdp::replicate(net, devices);
  handle.remove();

  REQUIRE(calls.size() == 3);
  CHECK(replicas_seen_at_first_call == 3);
  for (size_t j = 0; j < calls.size(); ++j) {
    CHECK(calls[j].index == static_cast<int64_t>(j));
    CHECK(calls[j].device == devices[j]);
    CHECK(calls[j].original == net->masked.get());
    CHECK(calls[j].replica == replicas[j]->masked.get());
    CHECK(calls[j].ctx == calls[0].ctx);
    CHECK(replicas[j]->masked->cache_.device() == devices[j]);
  }
  CHECK(calls[0].path == "masked");
}

TEST_CASE("hooks share one context per module position and match subclasses", "[cpu][hooks]") {
  MaskedNet net;
  std::map<const torchdp::ReplicaContext*, std::vector<int64_t>> by_context;
  std::map<std::string, int> by_path;
  auto handle = torchdp::register_post_replicate_hook<torch::nn::Module>(
      [&](torch::nn::Module&, const torch::nn::Module&, torch::Device, int64_t index,
          torchdp::ReplicaContext& ctx) {
        by_context[&ctx].push_back(index);
        by_path[ctx.path()]++;
        if (index == 0) {
          ctx.values["master"] = std::string("set by replica 0");
        } else {
          CHECK(std::any_cast<std::string>(ctx.values.at("master")) == "set by replica 0");
        }
      });
  torchdp::replicate(net, cpu_devices(2));
  handle.remove();
  // root, fc1, masked: three positions, each seen by replicas 0 and 1 in that order.
  CHECK(by_context.size() == 3);
  for (const auto& entry : by_context) {
    CHECK(entry.second == std::vector<int64_t>{0, 1});
  }
  CHECK(by_path[""] == 2);
  CHECK(by_path["fc1"] == 2);
  CHECK(by_path["masked"] == 2);
}

TEST_CASE("instance hooks apply to that instance only", "[cpu][hooks]") {
  MaskedNet net;
  MaskedNet other;
  int calls = 0;
  auto handle = torchdp::register_post_replicate_hook(
      net->masked, [&](MaskedLinearImpl& replica, const MaskedLinearImpl& original, torch::Device,
                       int64_t, torchdp::ReplicaContext&) {
        CHECK(&original == net->masked.get());
        replica.refresh_cache();
        ++calls;
      });
  torchdp::replicate(other, cpu_devices(2));
  CHECK(calls == 0);
  torchdp::replicate(net, cpu_devices(2));
  CHECK(calls == 2);
  handle.remove();
}

TEST_CASE("an instance hook is unregistered once its module dies", "[cpu][hooks]") {
  REQUIRE(torchdp::detail::no_hooks_registered());
  torchdp::PostReplicateHookHandle handle;
  {
    torch::nn::Linear linear(2, 2);
    handle = torchdp::register_post_replicate_hook(
        linear, [](torch::nn::LinearImpl&, const torch::nn::LinearImpl&, torch::Device, int64_t,
                   torchdp::ReplicaContext&) {});
    CHECK(handle.active());
    CHECK_FALSE(torchdp::detail::no_hooks_registered());
  }
  CHECK_FALSE(handle.active());
  CHECK(torchdp::detail::no_hooks_registered());
}

TEST_CASE("hooks run in registration order and can be removed", "[cpu][hooks]") {
  torch::nn::Linear linear(2, 2);
  std::vector<int> order;
  auto h1 = torchdp::register_post_replicate_hook<torch::nn::Linear>(
      [&](torch::nn::LinearImpl&, const torch::nn::LinearImpl&, torch::Device, int64_t index,
          torchdp::ReplicaContext&) {
        order.push_back(10 + static_cast<int>(index));
      });
  auto h2 = torchdp::register_post_replicate_hook(
      linear.ptr(), [&](torch::nn::Module&, const torch::nn::Module&, torch::Device, int64_t index,
                        torchdp::ReplicaContext&) {
        order.push_back(20 + static_cast<int>(index));
      });
  torchdp::replicate(linear, cpu_devices(2));
  CHECK(order == std::vector<int>{10, 20, 11, 21});
  CHECK(h1.active());
  h1.remove();
  CHECK_FALSE(h1.active());
  h1.remove(); // idempotent
  order.clear();
  torchdp::replicate(linear, cpu_devices(2));
  CHECK(order == std::vector<int>{20, 21});
  h2.remove();
  order.clear();
  torchdp::replicate(linear, cpu_devices(2));
  CHECK(order.empty());
}

TEST_CASE(
    "a failing hook aborts with its module path and replica and leaves the original as it was",
    "[cpu][hooks]") {
  torch::manual_seed(7);
  MaskedNet net;
  const auto weight_before = net->masked->weight.detach().clone();
  const auto mask_before = net->masked->mask.clone();
  auto handle = torchdp::register_post_replicate_hook<MaskedLinear>(
      [](MaskedLinearImpl&, const MaskedLinearImpl&, torch::Device, int64_t index,
         torchdp::ReplicaContext&) {
        if (index == 1) {
          throw std::runtime_error("mask sync failed");
        }
      });
  torchdp::Replicator replicator(net.ptr());
  TORCHDP_CHECK_THROWS_WITH(replicator.replicate(cpu_devices(2)), "torchdp::replicate",
                            "post-replicate hook #", "module 'masked'", "MaskedLinearImpl",
                            "replica 1 on device cpu", "mask sync failed");
  handle.remove();
  CHECK(torch::equal(net->masked->weight, weight_before));
  CHECK(torch::equal(net->masked->mask, mask_before));
  CHECK(net->masked->weight.is_leaf());
  CHECK_FALSE(net->masked->weight.grad().defined());
  // The half-hooked skeletons are dropped: the next call builds new ones and succeeds.
  auto replicas = replicator.replicate(cpu_devices(2));
  CHECK(replicator.skeleton_builds() == 2);
  CHECK(replicas.size() == 2);
}

TEST_CASE("a failing hook's exception keeps its class", "[cpu][hooks]") {
  torch::nn::Linear linear(2, 2);
  const int kind = GENERATE(0, 1);
  auto handle = torchdp::register_post_replicate_hook(
      linear, [kind](torch::nn::LinearImpl&, const torch::nn::LinearImpl&, torch::Device,
                     int64_t index, torchdp::ReplicaContext&) {
        if (index == 1 && kind == 0) {
          TORCH_CHECK_VALUE(false, "no state for this device");
        }
        if (index == 1) {
          throw 7; // not a std::exception
        }
      });
  if (kind == 0) {
    CHECK_THROWS_AS(torchdp::replicate(linear, cpu_devices(2)), c10::ValueError);
    TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(linear, cpu_devices(2)), "post-replicate hook #",
                              "replica 1", "no state for this device");
  } else {
    TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(linear, cpu_devices(2)), "post-replicate hook #",
                              "replica 1", "not a std::exception");
  }
  handle.remove();
}

TEST_CASE("the device check names a tensor a hook left on the wrong device", "[cpu][hooks]") {
  MaskedNet net;
  auto handle = torchdp::register_post_replicate_hook<MaskedLinear>(
      [](MaskedLinearImpl& replica, const MaskedLinearImpl&, torch::Device, int64_t index,
         torchdp::ReplicaContext&) {
        if (index == 1) {
          // Registers a buffer on the CPU, although replica 1 lives on meta.
          replica.register_buffer("scratch", torch::ones({4, 8}, torch::kBool));
        }
      });
  TORCHDP_CHECK_THROWS_WITH(torchdp::replicate(net, {torch::kCPU, torch::kMeta}),
                            "torchdp::replicate", "replica 1 must live on meta",
                            "buffer 'masked.scratch'", "is on cpu", "register_post_replicate_hook");
  handle.remove();
}

TEST_CASE("an empty hook is rejected", "[cpu][hooks]") {
  TORCHDP_CHECK_THROWS_WITH(
      torchdp::register_post_replicate_hook(std::make_shared<torch::nn::LinearImpl>(1, 1),
                                            torchdp::PostReplicateHook{}),
      "register_post_replicate_hook", "empty");
}
