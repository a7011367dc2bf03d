// The reduction seam (csrc/torchdp/reduction.h, Note [Reduction seam]): the loss reduction names
// and the gradient reductions (sum, average, a hook) on CPU device lists. The process-group
// average is tested with the process group's engine in test_process_group.cpp.
#include "test_common.h"

#include <torchdp/reduction.h>

#include <string>
#include <vector>

using torchdp_test::cpu_devices;

namespace {

const torch::Device kCpu(torch::kCPU);

// The gradient that `reduction` gives `w`, broadcast to `n` replicas where replica j's loss is
// (j + 1) * sum(replica): the sum gives (1 + ... + n) * ones, the average that over n.
std::vector<at::Tensor> broadcast_grads(size_t n, const torchdp::GradReduction& reduction,
                                        size_t bucket_bytes) {
  std::vector<at::Tensor> params{torch::zeros({3}, torch::requires_grad()),
                                 torch::zeros({2, 2}, torch::requires_grad())};
  torchdp::autograd::GradBucketSizeGuard buckets(bucket_bytes);
  torchdp::GradReductionGuard guard(reduction);
  const auto copies = torchdp::autograd::broadcast_coalesced(params, cpu_devices(n));
  at::Tensor loss = torch::zeros({});
  for (const auto j : c10::irange(n)) {
    for (const auto& t : copies[j]) {
      loss = loss + static_cast<double>(j + 1) * t.sum();
    }
  }
  loss.backward();
  return {params[0].grad(), params[1].grad()};
}

} // namespace

TEST_CASE("loss reduction names: one map both ways, and the error for a bad name",
          "[cpu][reduction]") {
  std::vector<std::string> names;
  for (const auto reduction : torchdp::kLossReductions) {
    const std::string name = torchdp::loss_reduction_name(reduction);
    names.push_back(name);
    CHECK(torchdp::loss_reduction_from_name(name, "api") == reduction);
  }
  const std::vector<std::string> expected{"mean", "batchmean", "sum", "none"};
  CHECK(names == expected);
  CHECK_THROWS_AS(torchdp::loss_reduction_from_name("avg", "torchdp::parallel_loss"),
                  c10::ValueError);
  TORCHDP_CHECK_THROWS_WITH(
      torchdp::loss_reduction_from_name("avg", "torchdp::parallel_loss"),
      "torchdp::parallel_loss: reduction must be one of 'mean', 'batchmean', 'sum', 'none', got "
      "'avg'");
  CHECK_THROWS_AS(torchdp::loss_reduction_from_name("Mean", "api"), c10::ValueError);
}

TEST_CASE("parallel_loss with batchmean and none", "[cpu][reduction]") {
  torch::manual_seed(3);
  const auto outputs = torch::randn({7, 4}).log_softmax(1).split(3); // rows 3, 3, 1
  const auto target = torch::softmax(torch::randn({7, 4}), 1);
  namespace F = torch::nn::functional;
  const auto whole = torch::cat(outputs);
  auto batchmean = torchdp::parallel_loss(
      std::vector<at::Tensor>(outputs.begin(), outputs.end()), target,
      [](const at::Tensor& out, const at::Tensor& t) {
        return F::kl_div(out, t, F::KLDivFuncOptions().reduction(torch::kBatchMean));
      },
      torchdp::LossReduction::BatchMean);
  CHECK(torch::allclose(
      batchmean, F::kl_div(whole, target, F::KLDivFuncOptions().reduction(torch::kBatchMean)), 1e-5,
      1e-6));
  auto none = torchdp::parallel_loss(
      std::vector<at::Tensor>(outputs.begin(), outputs.end()), target,
      [](const at::Tensor& out, const at::Tensor& t) {
        return F::kl_div(out, t, F::KLDivFuncOptions().reduction(torch::kNone)).sum(1);
      },
      torchdp::LossReduction::None);
  CHECK(torch::allclose(
      none, F::kl_div(whole, target, F::KLDivFuncOptions().reduction(torch::kNone)).sum(1)));
}

TEST_CASE("gradient reductions: sum by default, average, over buckets", "[cpu][reduction]") {
  const size_t n = GENERATE(as<size_t>{}, 1, 2, 3);
  const size_t bucket_bytes = GENERATE(as<size_t>{}, 0, 1); // one bucket; one per tensor
  CAPTURE(n, bucket_bytes);
  const double total = static_cast<double>(n * (n + 1) / 2);
  CHECK(torchdp::grad_reduction().is_sum());
  for (const auto& g : broadcast_grads(n, torchdp::GradReduction(), bucket_bytes)) {
    CHECK(torch::equal(g, torch::full_like(g, total)));
  }
  for (const auto& g : broadcast_grads(n, torchdp::GradReduction::average(), bucket_bytes)) {
    CHECK(torch::allclose(g, torch::full_like(g, total / static_cast<double>(n))));
  }
  CHECK(torchdp::grad_reduction().is_sum()); // the guards are gone
}

TEST_CASE("gradient reductions in the transport: dense, sparse, and differentiable",
          "[cpu][reduction]") {
  const auto average = torchdp::GradReduction::average();
  std::vector<std::vector<at::Tensor>> per_device{
      {torch::full({2}, 1.0), torch::eye(2).to_sparse()},
      {torch::full({2}, 3.0), torch::eye(2).to_sparse() * 3}};
  auto sums = torchdp::comm::reduce_coalesced(per_device, kCpu, 1024, torchdp::GradReduction());
  CHECK(torch::equal(sums[0], torch::full({2}, 4.0)));
  CHECK(torch::equal(sums[1].to_dense(), torch::eye(2) * 4));
  auto means = torchdp::comm::reduce_coalesced(per_device, kCpu, 1024, average);
  CHECK(torch::equal(means[0], torch::full({2}, 2.0)));
  CHECK(torch::equal(means[1].to_dense(), torch::eye(2) * 2));
  CHECK(torch::equal(per_device[0][0], torch::full({2}, 1.0))); // the inputs stay as they were

  // The average's backward gives each input 1/n of the output's gradient.
  const auto a = torch::ones({3}, torch::requires_grad());
  const auto b = torch::ones({3}, torch::requires_grad());
  auto out = torchdp::autograd::reduce_coalesced({{a}, {b}}, kCpu, 1024, average);
  out[0].sum().backward();
  CHECK(torch::allclose(a.grad(), torch::full({3}, 0.5)));
  CHECK(torch::allclose(b.grad(), torch::full({3}, 0.5)));
  CHECK(torch::allclose(out[0], torch::ones({3})));
}

TEST_CASE("a gradient reduction hook reduces every bucket", "[cpu][reduction]") {
  int calls = 0;
  auto largest = torchdp::GradReduction::from_hook(
      [&calls](const std::vector<std::vector<at::Tensor>>& per_device, c10::Device destination) {
        ++calls;
        std::vector<at::Tensor> result;
        for (const auto k : c10::irange(per_device.front().size())) {
          auto best = per_device.front()[k].to(destination).clone();
          for (const auto& list : per_device) {
            best = torch::maximum(best, list[k].to(destination));
          }
          result.push_back(best);
        }
        return result;
      },
      "largest");
  CHECK(largest.name() == "largest");
  CHECK_FALSE(largest.is_builtin());
  for (const auto& g : broadcast_grads(3, largest, /*bucket_bytes=*/1)) {
    CHECK(torch::equal(g, torch::full_like(g, 3.0)));
  }
  CHECK(calls == 2); // one bucket per tensor

  auto wrong = torchdp::GradReduction::from_hook(
      [](const std::vector<std::vector<at::Tensor>>&, c10::Device) {
        return std::vector<at::Tensor>{torch::zeros({5})};
      },
      "wrong");
  TORCHDP_CHECK_THROWS_WITH(broadcast_grads(2, wrong, 0),
                            "gradient reduction 'wrong' returned 1 "
                            "tensors for a bucket of 2");
  TORCHDP_CHECK_THROWS_WITH(torchdp::GradReduction::from_hook({}, "empty"),
                            "torchdp::GradReduction::from_hook: the hook 'empty' is empty");
}

TEST_CASE("DataParallel averages its replicas' gradients under a GradReductionGuard",
          "[cpu][reduction]") {
  torch::nn::Linear linear(torch::nn::LinearOptions(4, 1).bias(false));
  torchdp::DataParallel dp(linear, torchdp::DataParallelOptions().device_ids(cpu_devices(2)));
  const auto x = torch::randn({6, 4});
  {
    torchdp::GradReductionGuard average(torchdp::GradReduction::average());
    dp->forward(x).sum().backward();
  }
  // Each replica's gradient is the sum of its rows; the average halves the whole batch's.
  CHECK(torch::allclose(linear->weight.grad(), x.sum(0, /*keepdim=*/true) / 2));
  linear->weight.mutable_grad() = at::Tensor();
  dp->forward(x).sum().backward();
  CHECK(torch::allclose(linear->weight.grad(), x.sum(0, /*keepdim=*/true)));
}
