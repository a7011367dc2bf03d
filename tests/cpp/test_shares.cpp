// Uneven shares of the batch (Note [Uneven shares]): share_rows, DataParallelOptions::shares,
// data_parallel's shares and parallel_loss over uneven outputs, against one device.
#include "test_common.h"

using namespace torchdp_test;

namespace {

torchdp::DataParallelOptions sharing(size_t n, std::vector<double> shares) {
  return torchdp::DataParallelOptions().device_ids(cpu_devices(n)).shares(std::move(shares));
}

} // namespace

TEST_CASE("share_rows divides the batch by largest remainders", "[cpu][shares]") {
  using V = std::vector<int64_t>;
  CHECK(torchdp::share_rows({1, 2, 2, 2}, 14, 4) == V{2, 4, 4, 4});
  CHECK(torchdp::share_rows({1, 2, 2, 2}, 16, 4) == V{2, 5, 5, 4});
  CHECK(torchdp::share_rows({1, 2, 2, 2}, 3, 4) == V{0, 1, 1, 1});
  CHECK(torchdp::share_rows({1, 3}, 4, 2) == V{1, 3});
  CHECK(torchdp::share_rows({0, 1, 1}, 7, 3) == V{0, 4, 3});
  CHECK(torchdp::share_rows({2, 1}, 0, 2) == V{0, 0});
}

TEST_CASE("share_rows refuses shares that do not fit", "[cpu][shares]") {
  TORCHDP_CHECK_THROWS_WITH(torchdp::share_rows({1, 2}, 6, 3), "torchdp::share_rows",
                            "shares [1, 2] has 2 entries but there are 3 devices",
                            "give one share per device");
  CHECK_THROWS_AS(torchdp::share_rows({1, 2}, 6, 3), c10::ValueError);
  TORCHDP_CHECK_THROWS_WITH(torchdp::share_rows({1, -2}, 6, 2), "has -2 for device 1",
                            "finite number >= 0");
  TORCHDP_CHECK_THROWS_WITH(torchdp::share_rows({0, 0}, 6, 2), "are all zero",
                            "give at least one device a positive share");
  TORCHDP_CHECK_THROWS_WITH(torchdp::share_rows({1, 1}, -1, 2), "the batch has -1 rows");
}

TEST_CASE("DataParallel with shares gives the module's output and gradients",
          "[cpu][shares][data_parallel]") {
  torch::manual_seed(3);
  const auto shares = GENERATE(std::vector<double>{1, 2, 2}, std::vector<double>{0, 3, 4},
                               std::vector<double>{2, 5, 0}, std::vector<double>{1, 0, 1});
  torch::nn::Linear linear(5, 3);
  torch::nn::Linear reference(5, 3);
  copy_state(*reference, *linear);
  torchdp::DataParallel dp(linear, sharing(3, shares));
  const auto x = torch::randn({7, 5});
  const auto counts = torchdp::share_rows(shares, 7, 3);
  auto outputs = dp->forward_replicas(x);
  size_t running = 0;
  for (const auto c : counts) {
    running += c > 0 ? 1 : 0;
  }
  REQUIRE(outputs.size() == running);
  size_t k = 0;
  for (const auto c : counts) {
    if (c > 0) {
      CHECK(outputs[k++].size(0) == c);
    }
  }
  auto out = dp->forward(x);
  auto expected = reference->forward(x);
  CHECK(torch::allclose(out, expected, 1e-5, 1e-6));
  out.pow(2).mean().backward();
  expected.pow(2).mean().backward();
  CHECK(torch::allclose(linear->weight.grad(), reference->weight.grad(), 1e-5, 1e-6));
  CHECK(torch::allclose(linear->bias.grad(), reference->bias.grad(), 1e-5, 1e-6));
}

TEST_CASE("parallel_loss over uneven shares is the row-weighted mean", "[cpu][shares]") {
  torch::manual_seed(4);
  torch::nn::Linear linear(6, 4);
  torch::nn::Linear reference(6, 4);
  copy_state(*reference, *linear);
  torchdp::DataParallel dp(linear, sharing(3, {1, 3, 3}));
  const auto x = torch::randn({7, 6});
  const auto y = torch::randint(0, 4, {7});
  auto outputs = dp->forward_replicas(x);
  REQUIRE(outputs.size() == 3);
  CHECK(outputs[0].size(0) == 1);
  namespace F = torch::nn::functional;
  auto loss = torchdp::parallel_loss(outputs, y, [](const at::Tensor& out, const at::Tensor& t) {
    return F::cross_entropy(out, t);
  });
  auto expected = F::cross_entropy(reference->forward(x), y);
  CHECK(torch::allclose(loss, expected, 1e-5, 1e-6));
  loss.backward();
  expected.backward();
  CHECK(torch::allclose(linear->weight.grad(), reference->weight.grad(), 1e-5, 1e-6));
}

TEST_CASE("data_parallel with shares, and shares errors", "[cpu][shares][data_parallel]") {
  torch::manual_seed(5);
  torch::nn::Linear linear(5, 3);
  torch::nn::Linear reference(5, 3);
  copy_state(*reference, *linear);
  const auto x = torch::randn({9, 5});
  auto out = torchdp::data_parallel(linear, x, cpu_devices(3), std::nullopt, 0,
                                    std::vector<double>{0, 1, 2});
  CHECK(torch::allclose(out, reference->forward(x), 1e-5, 1e-6));
  TORCHDP_CHECK_THROWS_WITH(
      torchdp::data_parallel(linear, x, cpu_devices(3), std::nullopt, 0, std::vector<double>{1}),
      "torchdp::data_parallel", "shares [1] has 1 entries but there are 3 devices");
  TORCHDP_CHECK_THROWS_WITH(torchdp::DataParallel(linear, sharing(2, {1, 1, 1})),
                            "torchdp::DataParallel", "has 3 entries but there are 2 devices");
  // A tensor of another size is refused; the module's parameters are untouched.
  struct TwoImpl : torch::nn::Module {
    TwoImpl() : fc(register_module("fc", torch::nn::Linear(3, 3))) {}
    torch::Tensor forward(const torch::Tensor& a, const torch::Tensor& b) {
      return fc(a) + b.sum();
    }
    torch::nn::Linear fc;
  };
  auto two = std::make_shared<TwoImpl>();
  const auto weight = two->fc->weight.clone();
  torchdp::DataParallel dp(two, sharing(2, {1, 2}));
  TORCHDP_CHECK_THROWS_WITH(dp->forward(torch::randn({6, 3}), torch::randn({5, 3})),
                            "torchdp::DataParallel: with shares [1, 2]",
                            "forward argument 0 has 6 rows but forward argument 1 has 5");
  CHECK(torch::equal(two->fc->weight, weight));
  CHECK(!two->fc->weight.grad().defined());
}

namespace {

// A detection-like module (Note [Lists of samples]): one output per image, of the image's size,
// and a scale per image from a batch tensor beside the list.
struct PerImageImpl : torch::nn::Cloneable<PerImageImpl> {
  PerImageImpl() {
    reset();
  }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(3, 2, 3));
  }
  std::vector<at::Tensor> forward(std::vector<at::Tensor> images, at::Tensor scale) {
    std::vector<at::Tensor> out;
    for (const auto i : c10::irange(images.size())) {
      out.push_back(conv(images[i].unsqueeze(0))[0] * scale[static_cast<int64_t>(i)]);
    }
    return out;
  }
  torch::nn::Conv2d conv{nullptr};
};
TORCH_MODULE(PerImage);

std::vector<at::Tensor> images_of(size_t n) {
  std::vector<at::Tensor> images;
  for (const auto i : c10::irange(n)) {
    images.push_back(torch::randn({3, 6 + static_cast<int64_t>(i), 9 - static_cast<int64_t>(i)}));
  }
  return images;
}

} // namespace

TEST_CASE("scatter_samples gives each device whole samples, gather_samples joins them",
          "[cpu][samples]") {
  const auto images = images_of(5);
  auto parts = torchdp::scatter_samples(images, cpu_devices(2));
  REQUIRE(parts.size() == 2);
  CHECK(parts[0].size() == 3);
  CHECK(parts[1].size() == 2);
  CHECK(parts[1][0].sizes() == images[3].sizes());
  auto shared = torchdp::scatter_samples(images, cpu_devices(3), std::vector<double>{0, 1, 4});
  CHECK(shared[0].empty());
  CHECK(shared[1].size() == 1);
  CHECK(shared[2].size() == 4);
  const auto joined = torchdp::gather_samples(parts, c10::Device(c10::kCPU));
  REQUIRE(joined.size() == 5);
  for (const auto i : c10::irange(5)) {
    CHECK(joined[i].equal(images[i]));
  }
}

TEST_CASE("DataParallel with samples splits vector arguments by item", "[cpu][samples]") {
  torch::manual_seed(4);
  PerImage net;
  PerImage reference;
  copy_state(*reference, *net);
  const auto devices = GENERATE(size_t{2}, size_t{4});
  torchdp::DataParallel dp(
      net, torchdp::DataParallelOptions().device_ids(cpu_devices(devices)).samples(true));
  const auto images = images_of(3);
  const auto scale = torch::tensor({1.0, 2.0, 3.0});
  auto out = dp->forward<std::vector<at::Tensor>>(images, scale);
  auto ref = reference->forward(images, scale);
  REQUIRE(out.size() == ref.size());
  at::Tensor loss = torch::zeros({});
  at::Tensor ref_loss = torch::zeros({});
  for (const auto i : c10::irange(ref.size())) {
    CHECK(torch::allclose(out[i], ref[i], 1e-5, 1e-6));
    loss = loss + out[i].square().sum();
    ref_loss = ref_loss + ref[i].square().sum();
  }
  loss.backward();
  ref_loss.backward();
  CHECK(torch::allclose(net->conv->weight.grad(), reference->conv->weight.grad(), 1e-4, 1e-5));

  TORCHDP_CHECK_THROWS_WITH(dp->forward<std::vector<at::Tensor>>(images, torch::ones({2})),
                            "forward argument 1", "needs one row per sample along dim 0");
}

TEST_CASE("DataParallel refuses a vector that cannot be one batch without samples",
          "[cpu][samples]") {
  PerImage net;
  torchdp::DataParallel dp(net, torchdp::DataParallelOptions().device_ids(cpu_devices(4)));
  TORCHDP_CHECK_THROWS_WITH(dp->forward<std::vector<at::Tensor>>(images_of(3), torch::ones({3})),
                            "forward argument 0 holds tensors of different shapes with only 3 rows",
                            "DataParallelOptions().samples(true)");
  std::vector<at::Tensor> rows{torch::randn({4, 3, 5, 5}), torch::randn({2, 3, 5, 5})};
  TORCHDP_CHECK_THROWS_WITH(dp->forward<std::vector<at::Tensor>>(rows, torch::ones({4})),
                            "holds tensors of different sizes [4, 2] along dim 0");
}
