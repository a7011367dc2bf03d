#include "test_common.h"

#include <torchdp/autograd.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

using torchdp_test::cpu_devices;

namespace {

const torch::Device kCpu(torch::kCPU);

torch::Tensor leaf(torch::IntArrayRef sizes, torch::ScalarType dtype = torch::kFloat) {
  return torch::randn(sizes, torch::TensorOptions().dtype(dtype)).requires_grad_(true);
}

std::string grad_fn_name(const torch::Tensor& t) {
  return t.grad_fn() ? t.grad_fn()->name() : "<none>";
}

} // namespace

// ---------------------------------------------------------------------------------------------
// broadcast_coalesced

TEST_CASE("autograd::broadcast_coalesced sums the gradients of every device", "[cpu][autograd]") {
  const size_t n = GENERATE(as<size_t>{}, 1, 2, 3);
  const auto buffer_size = GENERATE(as<size_t>{}, 1, torchdp::comm::kDefaultBufferSize);
  const auto x = leaf({3, 4});
  const auto y = leaf({5}, torch::kDouble);
  const auto out = torchdp::autograd::broadcast_coalesced({x, y}, cpu_devices(n), buffer_size);
  REQUIRE(out.size() == n);

  // Device j weighs x by (j + 1) and squares y.
  auto loss = torch::zeros({}, torch::kDouble);
  double weight_sum = 0;
  for (size_t j = 0; j < n; ++j) {
    REQUIRE(out[j].size() == 2);
    CHECK(torch::equal(out[j][0], x));
    CHECK(torch::equal(out[j][1], y));
    CHECK(out[j][0].requires_grad());
    CHECK(grad_fn_name(out[j][0]) == "torchdp::BroadcastBackward");
    loss = loss + out[j][0].sum().to(torch::kDouble) * static_cast<double>(j + 1) +
           out[j][1].pow(2).sum();
    weight_sum += static_cast<double>(j + 1);
  }
  loss.backward();
  REQUIRE(x.grad().defined());
  REQUIRE(y.grad().defined());
  CHECK(torch::allclose(x.grad(), torch::full({3, 4}, weight_sum)));
  CHECK(torch::allclose(y.grad(), 2 * y.detach() * static_cast<double>(n)));
}

TEST_CASE("autograd::broadcast_coalesced with gradients from some devices only",
          "[cpu][autograd]") {
  const auto x = leaf({4});
  const auto y = leaf({2});
  const auto out = torchdp::autograd::broadcast_coalesced({x, y}, cpu_devices(3));
  // Only device 2's copy of x and device 0's copy of y are used: the others count as zeros.
  ((out[2][0] * 3).sum() + (out[0][1] * torch::tensor({1.F, -1.F})).sum()).backward();
  CHECK(torch::allclose(x.grad(), torch::full({4}, 3.F)));
  CHECK(torch::allclose(y.grad(), torch::tensor({1.F, -1.F})));
}

// PyTorch's Broadcast and ReduceAddCoalesced are autograd.Functions, whose undefined incoming
// gradients are materialised as zeros: an input none of whose copies is used (a parameter unused in
// the forward under DataParallel) gets a zero gradient, not None.
TEST_CASE("autograd::broadcast_coalesced gives zero gradients to inputs whose copies are unused",
          "[cpu][autograd]") {
  const auto x = leaf({4});
  const auto y = leaf({2});
  const auto out = torchdp::autograd::broadcast_coalesced({x, y}, cpu_devices(3));
  (out[1][0] * 2).sum().backward();
  CHECK(torch::allclose(x.grad(), torch::full({4}, 2.F)));
  REQUIRE(y.grad().defined());
  CHECK(torch::equal(y.grad(), torch::zeros({2})));
}

TEST_CASE("autograd::reduce_add_coalesced gives zero gradients to inputs of unused sums",
          "[cpu][autograd]") {
  const auto a0 = leaf({3});
  const auto a1 = leaf({3});
  const auto b0 = leaf({2});
  const auto b1 = leaf({2});
  const auto out = torchdp::autograd::reduce_add_coalesced({{a0, b0}, {a1, b1}}, kCpu);
  out[0].sum().backward();
  CHECK(torch::allclose(a0.grad(), torch::ones({3})));
  CHECK(torch::allclose(a1.grad(), torch::ones({3})));
  for (const auto& b : {b0, b1}) {
    REQUIRE(b.grad().defined());
    CHECK(torch::equal(b.grad(), torch::zeros({2})));
  }
}

TEST_CASE("autograd::broadcast_coalesced of a complex tensor", "[cpu][autograd]") {
  const auto z = torch::randn({3}, torch::kComplexDouble).requires_grad_(true);
  const auto out = torchdp::autograd::broadcast_coalesced({z}, cpu_devices(2));
  auto loss = torch::zeros({}, torch::kDouble);
  for (const auto& list : out) {
    CHECK(torch::equal(list[0], z));
    loss = loss + torch::real(list[0] * list[0].conj()).sum();
  }
  loss.backward();
  // The gradient of |z|^2 is 2z in PyTorch's convention; two devices double it.
  CHECK(torch::allclose(z.grad(), 4 * z.detach()));
}

TEST_CASE("autograd::broadcast_coalesced of the same tensor twice", "[cpu][autograd]") {
  const auto x = leaf({3});
  const auto out = torchdp::autograd::broadcast_coalesced({x, x}, cpu_devices(2));
  auto loss = torch::zeros({});
  for (const auto& list : out) {
    loss = loss + list[0].sum() + 2 * list[1].sum();
  }
  loss.backward();
  CHECK(torch::allclose(x.grad(), torch::full({3}, 6.F)));
}

TEST_CASE("autograd::broadcast_coalesced outputs of inputs without grad", "[cpu][autograd]") {
  const auto x = leaf({2, 2});
  const auto z = torch::randn({3});
  const auto i = torch::arange(4, torch::kLong);
  const auto out = torchdp::autograd::broadcast_coalesced({x, z, i}, cpu_devices(3));
  for (size_t j = 0; j < out.size(); ++j) {
    INFO("device " << j);
    CHECK(out[j][0].requires_grad());
    CHECK_FALSE(out[j][1].requires_grad());
    CHECK_FALSE(out[j][2].requires_grad());
    CHECK(torch::equal(out[j][1], z));
    CHECK(torch::equal(out[j][2], i));
  }
  auto loss = torch::zeros({});
  for (const auto& list : out) {
    loss = loss + (list[0] * list[1].narrow(0, 0, 2)).sum();
  }
  loss.backward();
  CHECK(torch::allclose(x.grad(), z.narrow(0, 0, 2).expand({2, 2}) * 3));
  CHECK_FALSE(z.grad().defined());

  // Nothing requires grad: no history at all.
  const auto plain = torchdp::autograd::broadcast_coalesced({z, i}, cpu_devices(2));
  for (const auto& list : plain) {
    for (const auto& t : list) {
      CHECK_FALSE(t.requires_grad());
      CHECK_FALSE(t.grad_fn());
    }
  }
}

TEST_CASE("autograd::broadcast_coalesced under NoGradGuard records no history", "[cpu][autograd]") {
  const auto x = leaf({3});
  torch::NoGradGuard no_grad;
  const auto out = torchdp::autograd::broadcast_coalesced({x}, cpu_devices(3));
  for (const auto& list : out) {
    CHECK_FALSE(list[0].grad_fn());
    CHECK_FALSE(list[0].requires_grad());
    CHECK(torch::equal(list[0], x));
  }
}

TEST_CASE("autograd::broadcast_coalesced device 0 output shares the input's storage",
          "[cpu][autograd]") {
  const auto x = leaf({2, 3});
  const auto out = torchdp::autograd::broadcast_coalesced({x}, cpu_devices(2));
  const auto& dev0 = out[0][0];
  CHECK_FALSE(dev0.is_same(x));
  CHECK(dev0.data_ptr() == x.data_ptr());
  CHECK(dev0.is_alias_of(x));
  CHECK(dev0.grad_fn());
  CHECK(grad_fn_name(dev0) == "torchdp::BroadcastBackward");
  CHECK_FALSE(x.grad_fn());
  // The other copy has storage of its own.
  CHECK(out[1][0].data_ptr() != x.data_ptr());
  // Device 0's output shares the input's version counter.
  CHECK(dev0._version() == x._version());
  {
    torch::NoGradGuard no_grad;
    x.mul_(2);
  }
  CHECK(dev0._version() == x._version());
  CHECK(x._version() > 0);
  CHECK(torch::equal(dev0, x));
}

TEST_CASE("autograd::broadcast_coalesced double backward", "[cpu][autograd]") {
  const size_t n = GENERATE(as<size_t>{}, 1, 2, 3);
  const auto x = leaf({5}, torch::kDouble);
  const auto out = torchdp::autograd::broadcast_coalesced({x}, cpu_devices(n));
  auto loss = torch::zeros({}, torch::kDouble);
  for (const auto& list : out) {
    loss = loss + list[0].pow(3).sum();
  }
  const auto g = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true,
                                       /*create_graph=*/true)[0];
  const auto nd = static_cast<double>(n);
  CHECK(torch::allclose(g, 3 * nd * x.detach().pow(2)));
  REQUIRE(g.requires_grad());
  g.sum().backward();
  CHECK(torch::allclose(x.grad(), 6 * nd * x.detach()));
}

// ---------------------------------------------------------------------------------------------
// reduce_add_coalesced

TEST_CASE("autograd::reduce_add_coalesced gradients", "[cpu][autograd]") {
  const size_t n = GENERATE(as<size_t>{}, 1, 3);
  std::vector<torch::Tensor> a, b;
  std::vector<std::vector<torch::Tensor>> per_device;
  for (size_t j = 0; j < n; ++j) {
    a.push_back(leaf({2, 3}));
    b.push_back(torch::randn({4}, torch::kDouble)); // does not require grad
    per_device.push_back({a.back(), b.back()});
  }
  const auto out = torchdp::autograd::reduce_add_coalesced(per_device, kCpu);
  REQUIRE(out.size() == 2);
  CHECK(out[0].requires_grad());
  CHECK(grad_fn_name(out[0]) == "torchdp::ReduceAddBackward");
  CHECK_FALSE(out[1].requires_grad());
  auto sum_a = a[0].detach().clone();
  auto sum_b = b[0].clone();
  for (size_t j = 1; j < n; ++j) {
    sum_a += a[j].detach();
    sum_b += b[j];
  }
  CHECK(torch::allclose(out[0], sum_a));
  CHECK(torch::allclose(out[1], sum_b));

  const auto w = torch::randn({2, 3});
  (out[0] * w).sum().backward();
  for (size_t j = 0; j < n; ++j) {
    INFO("list " << j);
    REQUIRE(a[j].grad().defined());
    CHECK(torch::allclose(a[j].grad(), w));
  }
}

TEST_CASE("autograd::reduce_add_coalesced when only one list requires grad", "[cpu][autograd]") {
  const auto a0 = leaf({3});
  const auto a1 = torch::randn({3});
  const auto out = torchdp::autograd::reduce_add_coalesced({{a0}, {a1}}, kCpu);
  CHECK(out[0].requires_grad());
  (out[0] * torch::tensor({1.F, 2.F, 3.F})).sum().backward();
  CHECK(torch::allclose(a0.grad(), torch::tensor({1.F, 2.F, 3.F})));
  CHECK_FALSE(a1.grad().defined());
}

TEST_CASE("autograd::reduce_add_coalesced double backward", "[cpu][autograd]") {
  const auto a0 = leaf({4}, torch::kDouble);
  const auto a1 = leaf({4}, torch::kDouble);
  const auto a2 = leaf({4}, torch::kDouble);
  const auto out = torchdp::autograd::reduce_add_coalesced({{a0}, {a1}, {a2}}, kCpu);
  const auto s = (a0 + a1 + a2).detach();
  const auto loss = out[0].pow(2).sum();
  // d loss / d a0 = 2 s; its sum has gradient 2 with respect to every a_j.
  const auto g = torch::autograd::grad({loss}, {a0}, {}, true, true)[0];
  CHECK(torch::allclose(g, 2 * s));
  g.sum().backward();
  for (const auto& a : {a0, a1, a2}) {
    REQUIRE(a.grad().defined());
    CHECK(torch::allclose(a.grad(), torch::full({4}, 2.0, torch::kDouble)));
  }
}

TEST_CASE("autograd::reduce_add_coalesced under NoGradGuard records no history",
          "[cpu][autograd]") {
  const auto a0 = leaf({2});
  const auto a1 = leaf({2});
  torch::NoGradGuard no_grad;
  const auto out = torchdp::autograd::reduce_add_coalesced({{a0}, {a1}}, kCpu);
  CHECK_FALSE(out[0].grad_fn());
  CHECK_FALSE(out[0].requires_grad());
}

// ---------------------------------------------------------------------------------------------
// scatter

TEST_CASE("autograd::scatter gradient matches torch::chunk", "[cpu][autograd]") {
  struct Case {
    int64_t rows;
    size_t devices;
  };
  const auto c = GENERATE(values<Case>({{5, 4}, {8, 4}, {3, 4}, {7, 2}, {4, 1}}));
  const auto x = leaf({c.rows, 3});
  const auto chunks = torchdp::autograd::scatter(x, cpu_devices(c.devices));
  const auto x_ref = x.detach().clone().requires_grad_(true);
  const auto ref = x_ref.chunk(static_cast<int64_t>(c.devices), 0);
  INFO("rows " << c.rows << ", devices " << c.devices);
  REQUIRE(chunks.size() == ref.size());
  auto loss = torch::zeros({});
  auto loss_ref = torch::zeros({});
  for (size_t i = 0; i < chunks.size(); ++i) {
    CHECK(torch::equal(chunks[i], ref[i]));
    CHECK(grad_fn_name(chunks[i]) == "torchdp::ScatterBackward");
    const auto w = static_cast<double>(i + 1);
    loss = loss + (chunks[i].pow(2) * w).sum();
    loss_ref = loss_ref + (ref[i].pow(2) * w).sum();
  }
  loss.backward();
  loss_ref.backward();
  CHECK(torch::allclose(x.grad(), x_ref.grad()));
}

TEST_CASE("autograd::scatter with chunk_sizes and a negative dim", "[cpu][autograd]") {
  const auto x = leaf({2, 7});
  const std::vector<int64_t> sizes{3, 0, 4};
  const auto chunks = torchdp::autograd::scatter(x, cpu_devices(3), sizes, -1);
  REQUIRE(chunks.size() == 3);
  const auto x_ref = x.detach().clone().requires_grad_(true);
  const auto ref = x_ref.split_with_sizes(sizes, 1);
  auto loss = torch::zeros({});
  auto loss_ref = torch::zeros({});
  for (size_t i = 0; i < 3; ++i) {
    CHECK(torch::equal(chunks[i], ref[i]));
    loss = loss + chunks[i].exp().sum() * static_cast<double>(i + 2);
    loss_ref = loss_ref + ref[i].exp().sum() * static_cast<double>(i + 2);
  }
  loss.backward();
  loss_ref.backward();
  CHECK(torch::allclose(x.grad(), x_ref.grad()));
}

TEST_CASE("autograd::scatter unused chunks get zero gradient", "[cpu][autograd]") {
  const auto x = leaf({6, 2});
  const auto chunks = torchdp::autograd::scatter(x, cpu_devices(3));
  chunks[1].sum().backward();
  auto expected = torch::zeros({6, 2});
  expected.narrow(0, 2, 2).fill_(1);
  CHECK(torch::equal(x.grad(), expected));
}

TEST_CASE("autograd::scatter copies the chunks of an input that requires grad", "[cpu][autograd]") {
  // Note [Scatter chunks of inputs that require grad]: in-place ops on the chunks reach neither
  // the input nor the other chunks' saved tensors.
  const auto x = leaf({4, 2});
  const auto before = x.detach().clone();
  const auto chunks = torchdp::autograd::scatter(x, cpu_devices(2));
  REQUIRE(chunks.size() == 2);
  for (const auto& chunk : chunks) {
    CHECK_FALSE(chunk.is_alias_of(x));
    CHECK(chunk.requires_grad());
    CHECK(grad_fn_name(chunk) == "torchdp::ScatterBackward");
  }
  CHECK(torch::equal(torch::cat(chunks), before));
  const auto saved = chunks[1] * chunks[1]; // saves chunks[1] for backward
  const auto relu = chunks[0].mul(1).relu_().sum();
  chunks[0].sub_(1);
  CHECK(torch::equal(x.detach(), before));
  (saved.sum() + relu).backward();
  auto expected = torch::ones({4, 2});
  expected.narrow(0, 0, 2).copy_((before.narrow(0, 0, 2) > 0).to(torch::kFloat));
  expected.narrow(0, 2, 2).copy_(2 * before.narrow(0, 2, 2));
  CHECK(torch::allclose(x.grad(), expected));
}

TEST_CASE("autograd::scatter without grad records no history", "[cpu][autograd]") {
  SECTION("input does not require grad") {
    const auto x = torch::randn({4, 2});
    for (const auto& chunk : torchdp::autograd::scatter(x, cpu_devices(2))) {
      CHECK_FALSE(chunk.requires_grad());
      CHECK_FALSE(chunk.grad_fn());
    }
  }
  SECTION("NoGradGuard") {
    // As with x.chunk() under no_grad, the chunks are views without history (a view of a leaf
    // that requires grad still reports requires_grad(), as in PyTorch).
    const auto x = leaf({4, 2});
    torch::NoGradGuard no_grad;
    for (const auto& chunk : torchdp::autograd::scatter(x, cpu_devices(2))) {
      CHECK_FALSE(chunk.grad_fn());
      CHECK(chunk.is_alias_of(x));
    }
  }
}

TEST_CASE("autograd::scatter then gather round trip", "[cpu][autograd]") {
  const auto dim = GENERATE(as<int64_t>{}, 0, 1, -1);
  const auto n = GENERATE(as<size_t>{}, 1, 3, 4);
  const auto x = leaf({5, 6});
  const auto chunks = torchdp::autograd::scatter(x, cpu_devices(n), std::nullopt, dim);
  const auto y = torchdp::autograd::gather(chunks, kCpu, dim);
  CHECK(torch::equal(y, x));
  CHECK(grad_fn_name(y) == "torchdp::GatherBackward");
  y.sum().backward();
  CHECK(torch::equal(x.grad(), torch::ones({5, 6})));
}

TEST_CASE("autograd::scatter and gather double backward", "[cpu][autograd]") {
  const auto x = leaf({6, 2}, torch::kDouble);
  const auto chunks = torchdp::autograd::scatter(x, cpu_devices(3));
  std::vector<torch::Tensor> cubes;
  for (const auto& c : chunks) {
    cubes.push_back(c.pow(3));
  }
  const auto y = torchdp::autograd::gather(cubes, kCpu);
  const auto g = torch::autograd::grad({y.sum()}, {x}, {}, true, true)[0];
  CHECK(torch::allclose(g, 3 * x.detach().pow(2)));
  REQUIRE(g.requires_grad());
  g.sum().backward();
  CHECK(torch::allclose(x.grad(), 6 * x.detach()));
}

// ---------------------------------------------------------------------------------------------
// gather

TEST_CASE("autograd::gather gradient matches torch::cat", "[cpu][autograd]") {
  struct Case {
    std::vector<std::vector<int64_t>> shapes;
    int64_t dim;
  };
  const auto c = GENERATE(values<Case>({
      {{{2, 3}, {1, 3}, {4, 3}}, 0},
      {{{2, 1}, {2, 4}}, 1},
      {{{2, 1}, {2, 4}}, -1},
      {{{3, 2, 2}, {3, 1, 2}}, -2},
  }));
  std::vector<torch::Tensor> inputs, refs;
  for (const auto& shape : c.shapes) {
    inputs.push_back(leaf(shape));
    refs.push_back(inputs.back().detach().clone().requires_grad_(true));
  }
  const auto out = torchdp::autograd::gather(inputs, kCpu, c.dim);
  const auto ref = torch::cat(refs, c.dim);
  REQUIRE(out.sizes() == ref.sizes());
  CHECK(torch::equal(out, ref));
  const auto w = torch::randn(ref.sizes());
  (out * w).sum().backward();
  (ref * w).sum().backward();
  for (size_t i = 0; i < inputs.size(); ++i) {
    INFO("input " << i);
    REQUIRE(inputs[i].grad().defined());
    CHECK(torch::allclose(inputs[i].grad(), refs[i].grad()));
  }
}

TEST_CASE("autograd::gather with inputs that do not require grad", "[cpu][autograd]") {
  const auto a = leaf({2, 2});
  const auto b = torch::randn({3, 2});
  const auto out = torchdp::autograd::gather({a, b}, kCpu);
  CHECK(out.requires_grad());
  (out * 2).sum().backward();
  CHECK(torch::allclose(a.grad(), torch::full({2, 2}, 2.F)));
  CHECK_FALSE(b.grad().defined());

  const auto none = torchdp::autograd::gather({b, b}, kCpu);
  CHECK_FALSE(none.requires_grad());
  CHECK_FALSE(none.grad_fn());
  {
    torch::NoGradGuard no_grad;
    const auto guarded = torchdp::autograd::gather({a, a}, kCpu);
    CHECK_FALSE(guarded.requires_grad());
    CHECK_FALSE(guarded.grad_fn());
  }
}

TEST_CASE("autograd::gather of 0-dim tensors gives a vector", "[cpu][autograd]") {
  const auto s0 = torch::tensor(1.5F).requires_grad_(true);
  const auto s1 = torch::tensor(-2.F).requires_grad_(true);
  const auto s2 = torch::tensor(4.F).requires_grad_(true);
  const auto v = torchdp::autograd::gather({s0, s1, s2}, kCpu);
  REQUIRE(v.dim() == 1);
  REQUIRE(v.size(0) == 3);
  CHECK(torch::equal(v, torch::tensor({1.5F, -2.F, 4.F})));
  (v * torch::tensor({10.F, 20.F, 30.F})).sum().backward();
  const std::vector<torch::Tensor> scalars{s0, s1, s2};
  const std::vector<float> expected{10.F, 20.F, 30.F};
  for (size_t i = 0; i < 3; ++i) {
    INFO("scalar " << i);
    REQUIRE(scalars[i].grad().defined());
    CHECK(scalars[i].grad().dim() == 0);
    CHECK(scalars[i].grad().item<float>() == expected[i]);
  }
  // The inputs stay 0-dim.
  CHECK(s0.dim() == 0);
}

TEST_CASE("autograd::gather with a pad value: no gradient for padded positions",
          "[cpu][autograd]") {
  const auto a = leaf({2, 3}, torch::kDouble);
  const auto b = leaf({1, 5}, torch::kDouble);
  const auto c = torch::randn({1, 4}, torch::kDouble); // needs no grad
  const auto out = torchdp::autograd::gather({a, b, c}, kCpu, 0, /*pad_value=*/0);
  REQUIRE(out.sizes() == torch::IntArrayRef({4, 5}));
  CHECK(torch::equal(out.narrow(0, 0, 2).narrow(1, 0, 3), a));
  CHECK(torch::all(out.narrow(0, 0, 2).narrow(1, 3, 2) == 0).item<bool>());
  const auto w = torch::randn({4, 5}, torch::kDouble);
  const auto g = torch::autograd::grad({(out * w).sum()}, {a, b}, {}, true, true);
  CHECK(torch::equal(g[0], w.narrow(0, 0, 2).narrow(1, 0, 3)));
  CHECK(torch::equal(g[1], w.narrow(0, 2, 1)));
  SECTION("double backward") {
    const auto squares = torchdp::autograd::gather({a.pow(2), b.pow(2)}, kCpu, 0, 7);
    const auto first = torch::autograd::grad({squares.sum()}, {a, b}, {}, true, true);
    CHECK(torch::allclose(first[0], 2 * a.detach()));
    REQUIRE(first[0].requires_grad());
    (first[0].sum() + first[1].sum()).backward();
    CHECK(torch::allclose(a.grad(), torch::full({2, 3}, 2.0, torch::kDouble)));
    CHECK(torch::allclose(b.grad(), torch::full({1, 5}, 2.0, torch::kDouble)));
  }
  SECTION("the structured gather pads too") {
    const auto joined = torchdp::gather(std::vector<torch::Tensor>{a, b}, kCpu, 0, -1.0);
    REQUIRE(joined.sizes() == torch::IntArrayRef({3, 5}));
    joined.sum().backward();
    CHECK(torch::equal(a.grad(), torch::ones({2, 3}, torch::kDouble)));
  }
}

TEST_CASE("autograd::gather errors", "[cpu][autograd]") {
  const char* api = "torchdp::autograd::gather";
  SECTION("0-dim tensors along dim 1") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::autograd::gather({torch::tensor(1.F), torch::tensor(2.F)}, kCpu, 1), api, "0-dim",
        "dim=1");
  }
  SECTION("no tensors") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::autograd::gather({}, kCpu), api, "at least one tensor");
  }
  SECTION("undefined tensor") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::autograd::gather({torch::ones({1}), torch::Tensor()}, kCpu),
                              api, "undefined");
  }
  SECTION("shape mismatch reaches the comm layer") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::autograd::gather({leaf({2, 3}), leaf({2, 4})}, kCpu),
                              "torchdp::comm::gather", "input tensor at index 1",
                              "invalid shape [2, 4]");
  }
}

TEST_CASE("autograd layer errors name the API", "[cpu][autograd]") {
  TORCHDP_CHECK_THROWS_WITH(torchdp::autograd::broadcast_coalesced({leaf({2})}, {}),
                            "torchdp::autograd::broadcast_coalesced", "empty device list");
  TORCHDP_CHECK_THROWS_WITH(
      torchdp::autograd::reduce_add_coalesced({{leaf({2})}}, torch::Device("xpu")),
      "torchdp::autograd::reduce_add_coalesced", "xpu", "not supported");
  TORCHDP_CHECK_THROWS_WITH(torchdp::autograd::scatter(torch::tensor(1.F), cpu_devices(2)),
                            "torchdp::comm::scatter", "0-dim");
}

// ---------------------------------------------------------------------------------------------
// Gradient buckets (autograd/buckets.cpp, Note [Gradient buckets and reduction streams])

TEST_CASE("autograd::broadcast_coalesced reduces in buckets with the same sums",
          "[cpu][autograd]") {
  const double mib = GENERATE(0.0, 0.000001, 0.0001, 25.0);
  const torchdp::autograd::GradBucketSizeGuard guard(
      torchdp::autograd::bucket_bytes_from_mib(mib, "test"));
  std::vector<torch::Tensor> leaves;
  for (int64_t i = 0; i < 6; ++i) {
    leaves.push_back(leaf({i + 2, 3}));
  }
  leaves.push_back(leaf({4})); // unused on every device: zeros, even in a bucket of its own
  const auto out = torchdp::autograd::broadcast_coalesced(leaves, cpu_devices(3));
  auto loss = torch::zeros({});
  for (size_t j = 0; j < 3; ++j) {
    for (size_t k = 0; k + 1 < leaves.size(); ++k) {
      loss = loss + out[j][k].pow(2).sum() * static_cast<double>(j + 1);
    }
  }
  loss.backward();
  for (size_t k = 0; k + 1 < leaves.size(); ++k) {
    INFO("tensor " << k << ", bucket size " << mib << " MiB");
    CHECK(torch::allclose(leaves[k].grad(), 2 * leaves[k].detach() * 6.0));
  }
  REQUIRE(leaves.back().grad().defined());
  CHECK(torch::equal(leaves.back().grad(), torch::zeros({4})));
}

TEST_CASE("autograd::broadcast_coalesced cuts buckets from the end of the list",
          "[cpu][autograd]") {
  const torchdp::autograd::GradBucketSizeGuard guard(104); // 26 floats
  const auto a = leaf({10});
  const auto b = leaf({20});
  const auto c = leaf({5});
  const auto d = leaf({5});
  const auto out = torchdp::autograd::broadcast_coalesced({a, b, c, d}, cpu_devices(2));
  // c and d (40 bytes) share the first bucket, b and a get one each.
  CHECK(out[0][2].grad_fn() == out[0][3].grad_fn());
  CHECK(out[1][2].grad_fn() == out[0][3].grad_fn());
  CHECK(out[0][1].grad_fn() != out[0][2].grad_fn());
  CHECK(out[0][0].grad_fn() != out[0][1].grad_fn());
  CHECK(out[0][0].grad_fn()->next_edges().size() == 1);
  CHECK(out[0][2].grad_fn()->next_edges().size() == 2);
}

TEST_CASE("bucket sizes beyond memory are clamped, not overflowed", "[cpu][autograd]") {
  constexpr size_t kClamp = size_t{1} << 62;
  CHECK(torchdp::autograd::bucket_bytes_from_mib(1e300, "api") == kClamp);
  CHECK(torchdp::autograd::bucket_bytes_from_mib(1e30, "api") == kClamp);
  CHECK(torchdp::autograd::bucket_bytes_from_mib(2.5, "api") == size_t{5} << 19);
}

TEST_CASE("GradBucketSizeGuard sets the bucket size on its thread", "[cpu][autograd]") {
  CHECK(torchdp::autograd::grad_bucket_size() == torchdp::autograd::kDefaultGradBucketSize);
  {
    torchdp::autograd::GradBucketSizeGuard guard(100);
    CHECK(torchdp::autograd::grad_bucket_size() == 100);
    {
      torchdp::autograd::GradBucketSizeGuard inner(7);
      CHECK(torchdp::autograd::grad_bucket_size() == 7);
    }
    CHECK(torchdp::autograd::grad_bucket_size() == 100);
    const auto a = leaf({10});
    const auto b = leaf({20});
    const auto out = torchdp::autograd::broadcast_coalesced({a, b}, cpu_devices(2));
    CHECK(out[0][0].grad_fn() != out[0][1].grad_fn()); // 40 + 80 bytes > 100: two buckets
  }
  CHECK(torchdp::autograd::grad_bucket_size() == torchdp::autograd::kDefaultGradBucketSize);
  TORCHDP_CHECK_THROWS_WITH(torchdp::autograd::bucket_bytes_from_mib(-1, "api"), "api",
                            "bucket_cap_mb must be a non-negative number of MiB");
  CHECK(torchdp::autograd::bucket_bytes_from_mib(0.5, "api") == 512 * 1024);
}
