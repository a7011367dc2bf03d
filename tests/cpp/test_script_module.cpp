// ScriptDataParallel, ScriptReplicator and the functional steps over scripted modules.
#include "test_common.h"

#include <torch/script.h>

#include <map>
#include <sstream>

using namespace torchdp_test;

namespace {

/// A scripted net built in C++ (as torch::jit::load gives one): a Linear-like submodule, a
/// parameter, a buffer counting forwards, nested arguments, a keyword with a default, and a
/// tuple output holding a dict and an int.
torch::jit::Module make_net() {
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::Module fc(c10::QualifiedName("__torch__.torchdp_test.Linear"), cu);
  // Python's scripted modules carry the training flag; modules made in C++ get it explicitly.
  fc.register_attribute("training", c10::BoolType::get(), true);
  fc.register_parameter("weight", (torch::randn({4, 3}) * 0.3).requires_grad_(), false);
  fc.register_parameter("bias", (torch::randn({4}) * 0.1).requires_grad_(), false);
  fc.define(R"JIT(
def forward(self, x):
    return torch.matmul(x, self.weight.t()) + self.bias
)JIT");
  torch::jit::Module net(c10::QualifiedName("__torch__.torchdp_test.Net"), cu);
  net.register_attribute("training", c10::BoolType::get(), true);
  net.register_module("fc", fc);
  net.register_parameter("scale", (torch::rand({4}) + 0.5).requires_grad_(), false);
  net.register_buffer("calls", torch::zeros({1}));
  net.define(R"JIT(
def forward(self, x, extra: Tuple[Tensor, List[Tensor]], weights: Dict[str, Tensor], k: int,
            alpha: float = 1.0):
    self.calls.add_(1)
    h = torch.tanh(self.fc.forward(x)) * self.scale
    y = h * alpha + extra[0] + extra[1][0] * k
    return y, {"h": h, "w": weights["w"] * 2.0}, k
)JIT");
  return net;
}

/// A scripted module that raises in the replica whose first row sums below zero.
torch::jit::Module make_throwing() {
  torch::jit::Module m(c10::QualifiedName("__torch__.torchdp_test.Throwing"));
  m.register_parameter("w", torch::ones({1}).requires_grad_(), false);
  m.register_buffer("calls", torch::zeros({1}));
  m.define(R"JIT(
def forward(self, x):
    self.calls.add_(1)
    assert bool(x[0].sum() >= 0), "Badness!"
    return x * self.w
)JIT");
  return m;
}

/// `module` saved and loaded back with torch::jit::load, as an application gets it.
torch::jit::Module saved_and_loaded(const torch::jit::Module& module) {
  std::stringstream stream;
  module.save(stream);
  return torch::jit::load(stream);
}

struct Batch {
  at::Tensor x, e0, e1, w;
  std::vector<c10::IValue> inputs() const {
    c10::Dict<std::string, at::Tensor> weights;
    weights.insert("w", w);
    return {x, c10::IValue(std::make_tuple(e0, std::vector<at::Tensor>{e1})), c10::IValue(weights),
            int64_t{2}};
  }
};

Batch make_batch(int64_t rows, c10::Device device = torch::kCPU) {
  auto o = torch::TensorOptions().device(device);
  return {torch::randn({rows, 3}, o), torch::randn({rows, 4}, o), torch::randn({rows, 4}, o),
          torch::randn({rows, 2}, o)};
}

at::Tensor loss_of(const c10::IValue& out) {
  const auto& e = out.toTupleRef().elements();
  const auto dict = e[1].toGenericDict();
  return e[0].toTensor().pow(2).mean() + dict.at("h").toTensor().sum() * 0.1 +
         dict.at("w").toTensor().mean();
}

std::map<std::string, at::Tensor> by_name(const torch::jit::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out.emplace(p.name, p.value);
  }
  return out;
}

std::vector<at::Tensor> parameters_of(const torch::jit::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p);
  }
  return out;
}

torchdp::DataParallelOptions on(std::vector<torch::Device> devices) {
  return torchdp::DataParallelOptions().device_ids(std::move(devices));
}

void check_training(const std::vector<torch::Device>& devices, c10::Device device) {
  torch::manual_seed(3);
  auto serial = make_net();
  torch::manual_seed(3);
  auto wrapped = saved_and_loaded(make_net());
  serial.to(device);
  wrapped.to(device);
  torchdp::ScriptDataParallel dp(wrapped, on(devices));
  torch::optim::SGD opt_serial(parameters_of(serial), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_dp(dp.parameters(), torch::optim::SGDOptions(0.1));
  const torch::jit::Kwargs alpha{{"alpha", 0.5}};
  for (int step = 0; step < 3; ++step) {
    const auto batch = make_batch(6, device);
    opt_serial.zero_grad();
    opt_dp.zero_grad();
    auto out_serial = serial.forward(batch.inputs(), alpha);
    auto out_dp = dp.forward(batch.inputs(), alpha);
    CHECK(out_dp.toTupleRef().elements()[2].toInt() == 2);
    auto loss_serial = loss_of(out_serial);
    auto loss_dp = loss_of(out_dp);
    CHECK(torch::allclose(loss_serial, loss_dp, 1e-5, 1e-6));
    loss_serial.backward();
    loss_dp.backward();
    opt_serial.step();
    opt_dp.step();
    const auto a = by_name(serial);
    for (const auto& [name, value] : by_name(wrapped)) {
      INFO("step " << step << " parameter " << name);
      CHECK(torch::allclose(a.at(name), value, 1e-5, 1e-6));
    }
  }
  // Replica 0 shares the buffer's storage: the original counted each forward once.
  CHECK(wrapped.attr("calls").toTensor().item<double>() == 3);
  CHECK(dp.replicator().skeleton_builds() == 1);
}

} // namespace

TEST_CASE("ScriptDataParallel training equals serial training over 3 SGD steps", "[cpu][script]") {
  const auto devices = GENERATE(cpu_devices(2), cpu_devices(3));
  check_training(devices, torch::kCPU);
}

TEST_CASE("ScriptDataParallel in inference, and on one device", "[cpu][script]") {
  torch::manual_seed(4);
  auto net = make_net();
  const auto batch = make_batch(5);
  c10::IValue expected;
  {
    torch::NoGradGuard no_grad;
    expected = net.forward(batch.inputs());
  }
  for (size_t n : {1, 2, 4}) {
    INFO(n << " devices");
    torchdp::ScriptDataParallel dp(net, on(cpu_devices(n)));
    torch::NoGradGuard no_grad;
    const auto out = dp.forward(batch.inputs());
    const auto& e = out.toTupleRef().elements();
    CHECK(!e[0].toTensor().requires_grad());
    CHECK(torch::allclose(e[0].toTensor(), expected.toTupleRef().elements()[0].toTensor(), 1e-5,
                          1e-6));
    CHECK(torch::allclose(e[1].toGenericDict().at("w").toTensor(), batch.w * 2.0));
    CHECK(dp.forward_replicas(batch.inputs()).size() ==
          batch.x.chunk(static_cast<int64_t>(n)).size());
  }
}

TEST_CASE("ScriptDataParallel runs fewer replicas for a small batch", "[cpu][script]") {
  auto m = make_throwing();
  torchdp::ScriptDataParallel dp(m, on(cpu_devices(3)));
  const auto x = torch::ones({1, 2});
  CHECK(torch::equal(dp.forward({x}).toTensor(), x));
  CHECK(dp.forward_replicas({torch::ones({2, 2})}).size() == 2);
}

TEST_CASE("ScriptReplicator keeps its replicas and refreshes them", "[cpu][script]") {
  auto net = make_net();
  const auto devices = cpu_devices(2);
  torchdp::ScriptReplicator replicator(net);
  auto first = replicator.replicate(devices);
  REQUIRE(first.size() == 2);
  const auto scale = net.attr("scale").toTensor();
  // Replica 0 shares the original's storage, replica 1 has its own copy.
  CHECK(first[0].attr("scale").toTensor().data_ptr() == scale.data_ptr());
  CHECK(first[1].attr("scale").toTensor().data_ptr() != scale.data_ptr());
  CHECK(torch::equal(first[1].attr("scale").toTensor(), scale));
  CHECK(first[1].attr("scale").toTensor().grad_fn() != nullptr);
  const auto fc1 = torch::jit::Module(first[1].attr("fc").toObject());
  CHECK(fc1.attr("weight").toTensor().data_ptr() !=
        torch::jit::Module(net.attr("fc").toObject()).attr("weight").toTensor().data_ptr());

  net.eval(); // the training flag is refreshed, not rebuilt
  auto second = replicator.replicate(devices, /*detach=*/true);
  CHECK(replicator.skeleton_builds() == 1);
  CHECK(second[1]._ivalue().get() == first[1]._ivalue().get());
  CHECK(!second[1].is_training());
  CHECK(!torch::jit::Module(second[1].attr("fc").toObject()).is_training());
  CHECK(second[1].attr("scale").toTensor().grad_fn() == nullptr);

  // A new submodule object rebuilds the replicas.
  net.register_module("fc", torch::jit::Module(net.attr("fc").toObject()).deepcopy());
  replicator.replicate(devices);
  CHECK(replicator.skeleton_builds() == 2);
  replicator.invalidate();
  replicator.replicate(devices);
  CHECK(replicator.skeleton_builds() == 3);
}

TEST_CASE("Functional replicate, scatter, parallel_apply and gather over a scripted module",
          "[cpu][script]") {
  torch::manual_seed(5);
  auto net = make_net();
  torch::manual_seed(5);
  auto reference = make_net();
  const auto devices = cpu_devices(2);
  const auto batch = make_batch(6);
  const auto inputs = batch.inputs();
  auto replicas = torchdp::replicate(net, devices);
  const auto parts = torchdp::scatter(
      c10::IValue(c10::ivalue::Tuple::create(std::vector<c10::IValue>(inputs))), devices);
  REQUIRE(parts.size() == 2);
  auto outputs = torchdp::parallel_apply(replicas, parts, devices);
  const auto out = torchdp::gather(outputs, torch::kCPU);
  const auto expected = reference.forward(inputs);
  loss_of(out).backward();
  loss_of(expected).backward();
  const auto a = by_name(reference);
  for (const auto& [name, value] : by_name(net)) {
    INFO(name);
    REQUIRE(value.grad().defined());
    CHECK(torch::allclose(value.grad(), a.at(name).grad(), 1e-5, 1e-6));
  }
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_apply(replicas, std::vector<c10::IValue>{parts[0]}),
                            "torchdp::parallel_apply: got 2 modules but 1 inputs");
}

TEST_CASE("ScriptDataParallel errors name the API and the fix", "[cpu][script]") {
  auto net = make_net();
  SECTION("a module elsewhere than device_ids[0]") {
    torchdp::ScriptDataParallel dp(net, on({torch::kMeta, torch::kMeta}));
    TORCHDP_CHECK_THROWS_WITH(dp.forward(make_batch(4).inputs()), "torchdp::ScriptDataParallel",
                              "on device meta (device_ids[0])", "parameter 'fc.weight'",
                              "place_module(true)");
  }
  SECTION("cuda_graphs") {
    try {
      torchdp::ScriptDataParallel dp(net, on(cpu_devices(2)).cuda_graphs(true));
      FAIL("no exception");
    } catch (const c10::ValueError& e) {
      CHECK(std::string(e.what_without_backtrace()).find("turn it off") != std::string::npos);
    }
  }
  SECTION("tensors that split into different numbers of chunks") {
    torchdp::ScriptDataParallel dp(net, on(cpu_devices(2)));
    auto batch = make_batch(4);
    batch.e0 = torch::randn({1, 4});
    TORCHDP_CHECK_THROWS_WITH(dp.forward(batch.inputs()), "forward argument 0", "has 4",
                              "forward argument 1[0]", "has 1");
  }
  SECTION("a 0-dim tensor") {
    torchdp::ScriptDataParallel dp(make_throwing(), on(cpu_devices(2)));
    TORCHDP_CHECK_THROWS_WITH(dp.forward({torch::tensor(1.0)}),
                              "forward argument 0 is a 0-dim tensor");
  }
  SECTION("a failing replica leaves the buffers as they were") {
    auto m = make_throwing();
    torchdp::ScriptDataParallel dp(m, on(cpu_devices(2)));
    auto x = torch::ones({4, 2});
    x.narrow(0, 2, 2).fill_(-1);
    TORCHDP_CHECK_THROWS_WITH(dp.forward({x}), "in replica 1", "Badness!");
    CHECK(m.attr("calls").toTensor().item<double>() == 0);
    dp.forward({torch::ones({4, 2})});
    CHECK(m.attr("calls").toTensor().item<double>() == 1);
  }
  SECTION("a failing gather leaves the buffers as they were") {
    torch::jit::Module m(c10::QualifiedName("__torch__.torchdp_test.GatherFails"));
    m.register_parameter("w", torch::ones({1}).requires_grad_(), false);
    m.register_buffer("calls", torch::zeros({1}));
    m.define(R"JIT(
def forward(self, x):
    self.calls.add_(1)
    if bool(x[0, 0] == 99.0):
        return x[:, 0:1] * self.w
    return x * self.w
)JIT");
    torchdp::ScriptDataParallel dp(m, on(cpu_devices(2)));
    auto x = torch::ones({4, 2});
    x[2][0] = 99; // replica 1 returns one column, which cannot be joined
    CHECK_THROWS(dp.forward({x}));
    CHECK(m.attr("calls").toTensor().item<double>() == 0);
    dp.forward({torch::ones({4, 2})});
    CHECK(m.attr("calls").toTensor().item<double>() == 1);
  }
}

TEST_CASE("ScriptDataParallel trains on one GPU listed twice", "[cuda][script]") {
  TORCHDP_NEED_CUDA(gpus, 1);
  check_training({gpus[0], gpus[0]}, gpus[0]);
}

TEST_CASE("ScriptDataParallel gathers on the CPU from one GPU listed twice", "[cuda][script]") {
  TORCHDP_NEED_CUDA(gpus, 1);
  torch::manual_seed(6);
  auto net = make_net();
  net.to(gpus[0]);
  torchdp::ScriptDataParallel dp(net,
                                 on({gpus[0], gpus[0]}).output_device(torch::Device(torch::kCPU)));
  const auto batch = make_batch(6, gpus[0]);
  const auto out = dp.forward(batch.inputs());
  const auto& e = out.toTupleRef().elements();
  CHECK(e[0].toTensor().device().is_cpu());
  CHECK(e[1].toGenericDict().at("h").toTensor().device().is_cpu());
  const auto expected = net.forward(batch.inputs());
  CHECK(torch::allclose(e[0].toTensor(), expected.toTupleRef().elements()[0].toTensor().cpu(), 1e-5,
                        1e-6));
}

TEST_CASE("ScriptDataParallel with uneven shares equals the serial module",
          "[cpu][script][shares]") {
  torch::manual_seed(3);
  auto serial = make_net();
  torch::manual_seed(3);
  auto wrapped = saved_and_loaded(make_net());
  torchdp::ScriptDataParallel dp(wrapped, on(cpu_devices(3)).shares(std::vector<double>{0, 1, 3}));
  const torch::jit::Kwargs alpha{{"alpha", 0.5}};
  const auto batch = make_batch(7);
  auto loss_serial = loss_of(serial.forward(batch.inputs(), alpha));
  auto loss_dp = loss_of(dp.forward(batch.inputs(), alpha));
  CHECK(torch::allclose(loss_serial, loss_dp, 1e-5, 1e-6));
  loss_serial.backward();
  loss_dp.backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& p : serial.named_parameters()) {
    grads.emplace(p.name, p.value.grad());
  }
  for (const auto& p : wrapped.named_parameters()) {
    INFO("parameter " << p.name);
    REQUIRE(p.value.grad().defined());
    CHECK(torch::allclose(grads.at(p.name), p.value.grad(), 1e-5, 1e-6));
  }
  TORCHDP_CHECK_THROWS_WITH(
      torchdp::ScriptDataParallel(wrapped, on(cpu_devices(2)).shares(std::vector<double>{1})),
      "torchdp::ScriptDataParallel", "shares [1] has 1 entries but there are 2 devices");
}
