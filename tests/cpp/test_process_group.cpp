// DataParallelOptions::process_group (Note [Reducing across processes]): the "processes" here are
// threads of this test, each with its own DataParallel, talking through an in-process group.
#include "test_common.h"

#if TORCHDP_WITH_C10D

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

using namespace torchdp_test;

namespace {

// What the ranks of one in-process group share: a slot per rank and a barrier.
struct Hub {
  explicit Hub(int n) : size(n), slots(static_cast<size_t>(n)) {}

  // Every rank deposits a copy of `t`; once all have, `use(slots)` runs in every rank; nobody
  // deposits again before every rank has used them.
  void exchange(int rank, const at::Tensor& t,
                const std::function<void(const std::vector<at::Tensor>&)>& use) {
    slots[static_cast<size_t>(rank)] = t.clone();
    barrier();
    use(slots);
    barrier();
  }

  void barrier() {
    std::unique_lock<std::mutex> lock(mutex);
    const auto generation = generation_;
    if (++arrived == size) {
      arrived = 0;
      ++generation_;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] {
        return generation_ != generation;
      });
    }
  }

  const int size;
  std::vector<at::Tensor> slots;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  int64_t generation_ = 0;
};

// A finished collective (the group below works synchronously).
struct DoneWork : c10d::Work {
  DoneWork() {
    finish();
  }
};

class ThreadGroup : public c10d::ProcessGroup {
 public:
  ThreadGroup(std::shared_ptr<Hub> hub, int rank)
      : c10d::ProcessGroup(rank, hub->size), hub_(std::move(hub)) {}

  const std::string getBackendName() const override {
    return "threads";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions&) override {
    ++allreduces;
    for (auto& t : tensors) {
      hub_->exchange(getRank(), t, [&](const std::vector<at::Tensor>& all) {
        auto sum = at::zeros_like(t);
        for (const auto& a : all) {
          sum.add_(a.to(t.device()));
        }
        t.copy_(sum);
      });
    }
    return c10::make_intrusive<DoneWork>();
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    ++broadcasts;
    for (auto& t : tensors) {
      hub_->exchange(getRank(), t, [&](const std::vector<at::Tensor>& all) {
        t.copy_(all[static_cast<size_t>(opts.rootRank)]);
      });
    }
    return c10::make_intrusive<DoneWork>();
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    hub_->exchange(getRank(), inputs.at(0), [&](const std::vector<at::Tensor>& all) {
      for (const auto r : c10::irange(all.size())) {
        outputs.at(0).at(r).copy_(all[r]);
      }
    });
    return c10::make_intrusive<DoneWork>();
  }

  std::atomic<int> allreduces{0};
  std::atomic<int> broadcasts{0};

 private:
  std::shared_ptr<Hub> hub_;
};

constexpr int kWorld = 2;
constexpr int64_t kBatch = 16; // the global batch: each rank takes kBatch / kWorld rows
constexpr int kSteps = 3;

struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(Mlp);

Mlp mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return Mlp();
}

struct BnNetImpl : torch::nn::Cloneable<BnNetImpl> {
  BnNetImpl() {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(8, 16));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return bn(fc(x));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BnNet);

std::vector<std::pair<at::Tensor, at::Tensor>> batches() {
  torch::manual_seed(1);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (int i = 0; i < kSteps; ++i) {
    auto x = torch::randn({kBatch, 8});
    out.emplace_back(x, torch::randn({kBatch, 4}));
  }
  return out;
}

// Runs `body(rank, group)` in one thread per rank; returns the error each rank ended with ("" for
// none). Catch2's assertions are not thread-safe: the bodies only record what the test checks.
std::vector<std::string> run_ranks(
    const std::function<void(int, const c10::intrusive_ptr<ThreadGroup>&)>& body,
    std::vector<c10::intrusive_ptr<ThreadGroup>>* groups_out = nullptr) {
  auto hub = std::make_shared<Hub>(kWorld);
  std::vector<c10::intrusive_ptr<ThreadGroup>> groups;
  for (int r = 0; r < kWorld; ++r) {
    groups.push_back(c10::make_intrusive<ThreadGroup>(hub, r));
  }
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, groups[static_cast<size_t>(r)]);
      } catch (const c10::Error& e) {
        errors[static_cast<size_t>(r)] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  if (groups_out != nullptr) {
    *groups_out = groups;
  }
  return errors;
}

// `extra` takes part in the forward only when `use_extra`.
struct BranchyImpl : torch::nn::Cloneable<BranchyImpl> {
  explicit BranchyImpl(bool use_extra) : use_extra(use_extra) {
    reset();
  }
  void reset() override {
    torch::manual_seed(5);
    body = register_module("body", torch::nn::Linear(8, 4));
    extra = register_module("extra", torch::nn::Linear(8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = body(x);
    return use_extra ? y + extra(x) : y;
  }
  bool use_extra;
  torch::nn::Linear body{nullptr};
  torch::nn::Linear extra{nullptr};
};
TORCH_MODULE(Branchy);

// Returns its parameter as it is (a leaf output).
struct ReturnsWeightImpl : torch::nn::Cloneable<ReturnsWeightImpl> {
  ReturnsWeightImpl() {
    reset();
  }
  void reset() override {
    weight = register_parameter("weight", torch::ones({3}));
  }
  torch::Tensor forward(const torch::Tensor&) {
    return weight;
  }
  torch::Tensor weight;
};
TORCH_MODULE(ReturnsWeight);

// A sparse embedding that takes part in the forward only when `use`.
struct SparseEmbeddingImpl : torch::nn::Cloneable<SparseEmbeddingImpl> {
  explicit SparseEmbeddingImpl(bool use) : use(use) {
    reset();
  }
  void reset() override {
    torch::manual_seed(7);
    emb = register_module("emb",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(6, 3).sparse(true)));
    fc = register_module("fc", torch::nn::Linear(3, 3));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto h = fc->weight.sum() * torch::ones({ids.size(0), ids.size(1), 3});
    return use ? h + emb(ids) : h;
  }
  bool use;
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SparseEmbedding);

// Rank 0's model trained by one process on the whole batches.
std::vector<at::Tensor> reference_training() {
  auto model = mlp(0);
  torch::optim::SGD opt(model->parameters(), 0.1);
  for (const auto& [x, y] : batches()) {
    opt.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
  }
  std::vector<at::Tensor> out;
  for (const auto& p : model->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

} // namespace

TEST_CASE("process_group: processes train like one process on the whole batch", "[process_group]") {
  for (const bool accumulate : {false, true}) {
    for (const size_t devices : {size_t{1}, size_t{2}}) {
      CAPTURE(accumulate, devices);
      std::vector<std::vector<at::Tensor>> trained(kWorld);
      std::vector<c10::intrusive_ptr<ThreadGroup>> groups;
      const auto all = batches();
      // Made here: torch's generator is global, and the ranks' threads would race for it.
      std::vector<Mlp> models{mlp(0), mlp(1)};
      auto errors = run_ranks(
          [&](int rank, const c10::intrusive_ptr<ThreadGroup>& group) {
            // Each rank starts from its own initialisation; rank 0's is taken at the first forward.
            torchdp::DataParallel dp(models[static_cast<size_t>(rank)],
                                     torchdp::DataParallelOptions()
                                         .device_ids(cpu_devices(devices))
                                         .process_group(group)
                                         .bucket_cap_mb(0.0001));
            torch::optim::SGD opt(dp->parameters(), 0.1);
            for (const auto& [gx, gy] : all) {
              auto x = gx.chunk(kWorld)[rank];
              auto y = gy.chunk(kWorld)[rank];
              opt.zero_grad();
              if (accumulate) {
                auto xs = x.chunk(2);
                auto ys = y.chunk(2);
                {
                  auto guard = dp->no_sync();
                  (torch::mse_loss(dp->forward(xs[0]), ys[0]) / 2).backward();
                }
                (torch::mse_loss(dp->forward(xs[1]), ys[1]) / 2).backward();
              } else {
                torch::mse_loss(dp->forward(x), y).backward();
              }
              opt.step();
            }
            for (const auto& p : dp->parameters()) {
              trained[static_cast<size_t>(rank)].push_back(p.detach().clone());
            }
          },
          &groups);
      REQUIRE(errors == std::vector<std::string>(kWorld));
      const auto want = reference_training();
      for (const auto& got : trained) {
        REQUIRE(got.size() == want.size());
        for (const auto i : c10::irange(want.size())) {
          REQUIRE(torch::allclose(got[i], want[i], 1e-5, 1e-6));
        }
      }
      // Tiny buckets: several all-reduces per synchronised pass; none in no_sync passes.
      for (const auto& g : groups) {
        CHECK(g->allreduces.load() == kSteps * 4);
      }
    }
  }
}

TEST_CASE("process_group: unused parameters, autograd::grad, buffers and mismatched modules",
          "[process_group]") {
  std::vector<at::Tensor> extra_grads(kWorld);
  std::vector<at::Tensor> local_extra(kWorld);
  // Flags as ints: the ranks' threads write their own elements at once, and std::vector<bool>
  // packs neighbours into one byte (a lost write now and then).
  std::vector<int> untouched_by_grad(kWorld, 0);
  std::vector<at::Tensor> running_means(kWorld * 2);
  std::vector<std::string> mismatch(kWorld);
  std::vector<int> leaf_reductions(kWorld, -1);
  std::vector<int> grad_of_params_reductions(kWorld, -1);
  std::vector<int> grad_of_params_ok(kWorld, 0);
  std::vector<int> two_forward_reductions(kWorld, -1);
  std::vector<at::Tensor> sparse_grads(kWorld);
  std::vector<at::Tensor> sparse_local(kWorld);
  std::vector<at::Tensor> new_heads(kWorld);
  std::vector<SparseEmbedding> sparse_nets{SparseEmbedding(false), SparseEmbedding(true)};
  std::vector<SparseEmbedding> sparse_locals{SparseEmbedding(false), SparseEmbedding(true)};
  std::vector<Mlp> heads{mlp(0), mlp(0)};
  // Made here: torch's generator is global, and the ranks' threads would race for it.
  const auto inputs = torch::randn({kWorld, 6, 8});
  std::vector<Branchy> nets{Branchy(false), Branchy(true)};
  std::vector<Branchy> locals{Branchy(false), Branchy(true)};
  std::vector<Branchy> unused_one{Branchy(false), Branchy(false)};
  std::vector<Branchy> unused_two{Branchy(false), Branchy(false)};
  std::vector<SparseEmbedding> unused_sparse{SparseEmbedding(false), SparseEmbedding(false)};
  std::vector<int> unused_none(kWorld, 0);
  std::vector<int> unused_sparse_none(kWorld, 0);
  std::vector<at::Tensor> unused_zeros(kWorld);
  std::vector<at::Tensor> unused_bodies(kWorld);
  std::vector<BnNet> bns{BnNet(), BnNet(), BnNet(), BnNet()};
  for (auto& b : bns) {
    copy_state(*b, *bns[0]);
  }
  auto errors = run_ranks([&](int rank, const c10::intrusive_ptr<ThreadGroup>& group) {
    const auto r = static_cast<size_t>(rank);
    const auto x = inputs[rank];

    // `extra` takes part in rank 1's forward only: both get half of rank 1's gradient (rank 0's
    // replicas give it zeros, as an unused parameter).
    auto net = nets[r];
    auto local = locals[r];
    local->forward(x).sum().backward();
    local_extra[r] =
        local->extra->weight.grad().defined() ? local->extra->weight.grad() : at::Tensor();
    torchdp::DataParallel dp(
        net, torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
    dp->forward(x).sum().backward();
    extra_grads[r] = net->extra->weight.grad().clone();

    // `extra` used by no process: it keeps no gradient, as with DDP, where the module runs as it
    // is (one device); with two replicas they give it zeros (as nn.DataParallel does), and those
    // zeros are averaged.
    {
      torchdp::DataParallel one(
          unused_one[r],
          torchdp::DataParallelOptions().device_ids(cpu_devices(1)).process_group(group));
      one->forward(x).sum().backward();
      unused_none[r] = !unused_one[r]->extra->weight.grad().defined();
      unused_bodies[r] = unused_one[r]->body->weight.grad().clone();
      torchdp::DataParallel two(
          unused_two[r],
          torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
      two->forward(x).sum().backward();
      unused_zeros[r] = unused_two[r]->extra->weight.grad();
      torchdp::DataParallel sparse_one(
          unused_sparse[r],
          torchdp::DataParallelOptions().device_ids(cpu_devices(1)).process_group(group));
      sparse_one->forward(torch::tensor({1, 2}, torch::kLong).view({1, 2})).sum().backward();
      unused_sparse_none[r] = !unused_sparse[r]->emb->weight.grad().defined() &&
                              unused_sparse[r]->fc->weight.grad().defined();
    }

    // autograd::grad of the input: no parameter gradient appears.
    net->zero_grad(/*set_to_none=*/true);
    auto xi = x.clone().requires_grad_();
    auto gx = torch::autograd::grad({dp->forward(xi).sum()}, {xi});
    untouched_by_grad[r] =
        !net->body->weight.grad().defined() && gx[0].abs().sum().item<float>() > 0;

    // Buffers: rank 0's at each forward with grad mode on, unless broadcast_buffers(false).
    for (const bool broadcast : {true, false}) {
      auto bn = bns[r * 2 + (broadcast ? 0 : 1)];
      torchdp::DataParallel dpbn(bn, torchdp::DataParallelOptions()
                                         .device_ids(cpu_devices(2))
                                         .process_group(group)
                                         .broadcast_buffers(broadcast));
      for (const auto& [bx, by] : batches()) {
        dpbn->forward(bx.chunk(kWorld)[rank]);
      }
      dpbn->eval();
      dpbn->forward(x);
      running_means[r * 2 + (broadcast ? 0 : 1)] = bn->bn->running_mean.clone();
    }

    // A leaf output (one device: the module's own parameter comes back) gets no hook, which
    // would outlive the step: nothing is reduced.
    torchdp::DataParallel leaf(
        ReturnsWeight(),
        torchdp::DataParallelOptions().device_ids(cpu_devices(1)).process_group(group));
    const int before = group->allreduces.load();
    for (int i = 0; i < 2; ++i) {
      leaf->forward(x).sum().backward();
    }
    leaf_reductions[r] = group->allreduces.load() - before;

    // Gradients with respect to the parameters from autograd::grad: returned, nothing reduced,
    // no .grad written.
    {
      torchdp::DataParallel g(
          mlp(0), torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
      const int before_grad = group->allreduces.load();
      auto grads = torch::autograd::grad({g->forward(x).sum()}, g->parameters());
      grad_of_params_reductions[r] = group->allreduces.load() - before_grad;
      bool ok = grads.size() == 4;
      for (const auto& p : g->parameters()) {
        ok = ok && !p.grad().defined();
      }
      grad_of_params_ok[r] = ok;

      // Two forwards, one backward: one reduction (a single bucket here).
      const int before_two = group->allreduces.load();
      (g->forward(x).sum() + g->forward(x * 2).sum()).backward();
      two_forward_reductions[r] = group->allreduces.load() - before_two;
    }

    // A sparse embedding used by rank 1 only: reduced as sparse tensors in both processes.
    {
      auto net_s = sparse_nets[r];
      auto local_s = sparse_locals[r];
      auto ids = torch::tensor({1, 2, 3, 4}, torch::kLong).view({2, 2});
      local_s->forward(ids).sum().backward();
      sparse_local[r] = local_s->emb->weight.grad().defined()
                            ? local_s->emb->weight.grad().to_dense()
                            : at::Tensor();
      torchdp::DataParallel s(
          net_s, torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
      s->forward(ids).sum().backward();
      sparse_grads[r] = net_s->emb->weight.grad();
    }

    // A new head after the first forward, with each rank's own initialisation: the next
    // forward takes rank 0's.
    {
      auto net_h = heads[r];
      torchdp::DataParallel h(
          net_h, torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
      h->forward(x);
      {
        torch::NoGradGuard no_grad;
        auto head = torch::nn::Linear(16, 4);
        head->weight.fill_(static_cast<double>(rank) + 1.0);
        net_h->fc2 = net_h->replace_module("fc2", head);
      }
      h->forward(x);
      new_heads[r] = net_h->fc2->weight.detach().clone();
    }

    // Different modules: refused in every process.
    mismatch[r] = error_message([&] {
      torchdp::DataParallel bad(
          torch::nn::Linear(8, 4 + rank),
          torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
      bad->forward(x);
    });
  });
  REQUIRE(errors == std::vector<std::string>(kWorld));

  REQUIRE_FALSE(local_extra[0].defined());
  REQUIRE(local_extra[1].defined());
  for (const auto& g : extra_grads) {
    REQUIRE(torch::allclose(g, local_extra[1] / 2));
  }
  CHECK(unused_none == std::vector<int>(kWorld, 1));
  CHECK(unused_sparse_none == std::vector<int>(kWorld, 1));
  for (const auto& g : unused_zeros) {
    REQUIRE(g.defined());
    CHECK(torch::equal(g, torch::zeros_like(g)));
  }
  CHECK(torch::allclose(unused_bodies[0], unused_bodies[1]));
  CHECK(untouched_by_grad[0]);
  CHECK(untouched_by_grad[1]);
  CHECK(torch::equal(running_means[0], running_means[2]));
  CHECK_FALSE(torch::equal(running_means[1], running_means[3]));
  CHECK(leaf_reductions == std::vector<int>(kWorld, 0));
  CHECK(grad_of_params_reductions == std::vector<int>(kWorld, 0));
  CHECK(grad_of_params_ok == std::vector<int>(kWorld, 1));
  CHECK(two_forward_reductions == std::vector<int>(kWorld, 1));
  REQUIRE_FALSE(sparse_local[0].defined());
  REQUIRE(sparse_local[1].defined());
  for (const auto& g : sparse_grads) {
    REQUIRE(g.defined());
    CHECK(g.is_sparse());
    CHECK(torch::allclose(g.to_dense(), sparse_local[1] / 2));
  }
  CHECK(torch::equal(new_heads[0], new_heads[1]));
  CHECK(torch::equal(new_heads[0], torch::ones({4, 16})));
  for (const auto& m : mismatch) {
    CHECK(m.find("torchdp::DataParallel: the processes of process_group wrap different modules: "
                 "group rank 1 has 2 parameters (45 elements)") != std::string::npos);
    CHECK(m.find("group rank 0 has 2 parameters (36 elements)") != std::string::npos);
  }
}

TEST_CASE("process_group: a conversion after the first forward, an empty module, a bad bucket cap",
          "[process_group]") {
  std::vector<Mlp> nets{mlp(0), mlp(0)};
  torch::nn::Linear linear(8, 4);
  torch::nn::Identity identity;
  std::vector<BnNet> bns{BnNet(), BnNet()};
  const auto inputs = torch::randn({kWorld, 4, 8});
  std::vector<std::vector<at::Tensor>> converted(kWorld);
  std::vector<std::string> empty_mismatch(kWorld);
  std::vector<std::string> bad_cap(kWorld);
  auto errors = run_ranks([&](int rank, const c10::intrusive_ptr<ThreadGroup>& group) {
    const auto r = static_cast<size_t>(rank);
    const auto x = inputs[rank];
    // to(kDouble) keeps the parameters but gives them new AccumulateGrad nodes: the next forward
    // follows them, and the gradients are averaged.
    auto net = nets[r];
    torchdp::DataParallel dp(
        net, torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
    dp->forward(x).sum().backward();
    net->to(torch::kDouble);
    net->zero_grad(/*set_to_none=*/true);
    dp->forward(x.to(torch::kDouble)).sum().backward();
    for (const auto& p : net->parameters()) {
      converted[r].push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    }

    // A process whose module is empty meets the others' check: both raise.
    const auto options =
        torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group);
    empty_mismatch[r] = error_message([&] {
      if (rank == 0) {
        torchdp::DataParallel(linear, options)->forward(x);
      } else {
        torchdp::DataParallel(identity, options)->forward(x);
      }
    });

    // A bad bucket_cap_mb is refused before the module runs (one device: the module itself).
    torchdp::DataParallel bn(
        bns[r], torchdp::DataParallelOptions().device_ids(cpu_devices(1)).process_group(group));
    bn->options.bucket_cap_mb(-1.0);
    bad_cap[r] = error_message([&] {
      bn->forward(x);
    });
    TORCH_CHECK(bns[r]->bn->num_batches_tracked.item<int64_t>() == 0,
                "the failed forward updated the buffers");
  });
  REQUIRE(errors == std::vector<std::string>(kWorld));
  REQUIRE(converted[0].size() == 4);
  for (const auto i : c10::irange(converted[0].size())) {
    REQUIRE(converted[0][i].defined());
    REQUIRE(converted[1][i].defined());
    CHECK(converted[0][i].scalar_type() == torch::kDouble);
    CHECK(torch::allclose(converted[0][i], converted[1][i]));
  }
  for (const auto& m : empty_mismatch) {
    CHECK(m.find("wrap different modules") != std::string::npos);
    CHECK(m.find("group rank 1 has 0 parameters (0 elements) and 0 buffers") != std::string::npos);
  }
  for (const auto& m : bad_cap) {
    CHECK(m.find("bucket_cap_mb") != std::string::npos);
  }
}

// Passes its input on; its backward fails.
struct FailsInBackward : torch::autograd::Function<FailsInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 const torch::autograd::variable_list&) {
    TORCH_CHECK(false, "this backward fails on purpose");
  }
};

TEST_CASE("process_group: a pass's id is forgotten at its end; failed passes' after kMaxPasses",
          "[process_group]") {
  using torchdp::detail::ProcessGroupSync;
  std::vector<Mlp> nets{mlp(0), mlp(0)};
  const auto inputs = torch::randn({kWorld, 4, 8});
  constexpr size_t kFailed = ProcessGroupSync::kMaxPasses + 5;
  std::vector<std::vector<size_t>> remembered(kWorld);
  std::vector<size_t> failures(kWorld, 0);
  std::vector<std::vector<int>> reductions(kWorld);
  auto errors = run_ranks([&](int rank, const c10::intrusive_ptr<ThreadGroup>& group) {
    const auto r = static_cast<size_t>(rank);
    auto net = nets[r];
    const auto x = inputs[rank];
    ProcessGroupSync sync(group, "test");
    auto watched = [&](const at::Tensor& input) {
      sync.before_forward(*net, true);
      auto out = net->forward(input);
      sync.watch({out}, 0);
      return out;
    };
    watched(x).sum().backward(); // reduced
    remembered[r].push_back(sync.remembered_passes());
    auto xi = x.clone().requires_grad_();
    torch::autograd::grad({watched(xi).sum()}, {xi}); // nothing to reduce
    remembered[r].push_back(sync.remembered_passes());
    for (size_t i = 0; i < kFailed; ++i) {
      sync.before_forward(*net, false);
      auto out = FailsInBackward::apply(net->forward(x));
      sync.watch({out}, 0);
      try {
        out.sum().backward(); // out's hook runs, then the pass fails: no callback ends it
      } catch (const c10::Error&) {
        ++failures[r];
      }
    }
    remembered[r].push_back(sync.remembered_passes());
    reductions[r].push_back(group->allreduces.load());
    watched(x).sum().backward(); // reduced: its id came and went, the oldest was dropped
    remembered[r].push_back(sync.remembered_passes());
    reductions[r].push_back(group->allreduces.load());
  });
  REQUIRE(errors == std::vector<std::string>(kWorld));
  CHECK(failures == std::vector<size_t>(kWorld, kFailed));
  for (const auto& counts : remembered) {
    CHECK(counts == std::vector<size_t>{0, 0, ProcessGroupSync::kMaxPasses,
                                        ProcessGroupSync::kMaxPasses - 1});
  }
  // One all-reduce (one bucket) for the first pass, none for autograd::grad and the failed
  // passes, one for the last.
  for (const auto& counts : reductions) {
    CHECK(counts == std::vector<int>{1, 2});
  }
}

TEST_CASE("process_group: cuda_graphs is refused, a group of one changes nothing",
          "[process_group]") {
  auto hub = std::make_shared<Hub>(1);
  auto group = c10::make_intrusive<ThreadGroup>(hub, 0);
  torchdp::DataParallel dp(
      mlp(0), torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
  auto plain = mlp(0);
  const auto [x, y] = batches()[0];
  torch::mse_loss(dp->forward(x), y).backward();
  torch::mse_loss(plain->forward(x), y).backward();
  auto got = dp->parameters();
  auto want = plain->parameters();
  for (const auto i : c10::irange(want.size())) {
    REQUIRE(torch::allclose(got[i].grad(), want[i].grad(), 1e-5, 1e-6));
  }
  CHECK(group->allreduces.load() == 0);
  CHECK(dp->require_backward_grad_sync());
  {
    auto guard = dp->no_sync();
    CHECK_FALSE(dp->require_backward_grad_sync());
  }
  CHECK(dp->require_backward_grad_sync());
  dp->options.process_group(c10::intrusive_ptr<c10d::ProcessGroup>());
  dp->forward(x); // no group: the plain forward

  // The conflict of options is named before anything about the module (here its placement: the
  // module is on the CPU, device_ids name a GPU).
  TORCHDP_NEED_CUDA(devices, 1);
  torchdp::DataParallel graphed(
      mlp(0),
      torchdp::DataParallelOptions().device_ids(devices).cuda_graphs(true).process_group(group));
  TORCHDP_CHECK_THROWS_WITH(graphed->forward(x),
                            "process_group cannot be combined with cuda_graphs");
}

TEST_CASE("process_group: the process-group average over the replicas' sum or average",
          "[process_group][reduction]") {
  // Linear without bias on a summed output: a replica's weight gradient is its rows' sum.
  for (const bool replica_average : {false, true}) {
    CAPTURE(replica_average);
    torch::manual_seed(4);
    const auto x = torch::randn({kWorld, 6, 4});
    std::vector<torch::nn::Linear> models;
    for (int r = 0; r < kWorld; ++r) {
      models.emplace_back(torch::nn::LinearOptions(4, 1).bias(false));
    }
    std::vector<at::Tensor> grads(kWorld);
    auto errors = run_ranks([&](int rank, const c10::intrusive_ptr<ThreadGroup>& group) {
      const auto r = static_cast<size_t>(rank);
      torchdp::DataParallel dp(
          models[r],
          torchdp::DataParallelOptions().device_ids(cpu_devices(2)).process_group(group));
      std::optional<torchdp::GradReductionGuard> average;
      if (replica_average) {
        average.emplace(torchdp::GradReduction::average());
      }
      dp->forward(x[rank]).sum().backward();
      grads[r] = models[r]->weight.grad().clone();
    });
    REQUIRE(errors == std::vector<std::string>(kWorld));
    // The processes' mean of their replicas' sum (average: over the two replicas too).
    const auto want =
        x.sum(torch::IntArrayRef{0, 1}).unsqueeze(0) / kWorld / (replica_average ? 2 : 1);
    for (const auto& g : grads) {
      CHECK(torch::allclose(g, want, 1e-5, 1e-6));
    }
  }
}

#endif // TORCHDP_WITH_C10D
