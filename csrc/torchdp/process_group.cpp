#include <torchdp/process_group.h>

#if TORCHDP_WITH_C10D
#include <torchdp/reduction.h>
#include <torchdp/replicate.h>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/embedding.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_set>
#include <utility>

// Note [Reducing across processes]
// With a process group, the processes average their replicas' reduced gradients, as DDP does
// (GradReduction::average, Note [Reduction seam] in reduction.cpp). At the first forward after the
// parameters changed they check that their modules match and take rank 0's values. The first
// hooked output a pass reaches queues a callback that queues the reduction, so it runs once per
// pass, after the gradient buckets' callbacks. All processes hold the same buckets: a missing
// gradient joins as zeros, and a flag per parameter leaves None where no process has one, as DDP
// does. Gradients are written only once every all-reduce succeeded;
// averaging equal gradients changes nothing, so accumulation over passes stays right.

namespace torchdp::detail {

namespace {

using torch::autograd::Edge;

// A stable 63-bit FNV-1a hash of the text (the same in every process).
int64_t text_hash(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (const unsigned char c : text) {
    h = (h ^ c) * 1099511628211ULL;
  }
  return static_cast<int64_t>(h >> 1);
}

c10::Device collective_device(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.device().type() != c10::kCPU && t.device().type() != c10::kMeta) {
      return t.device();
    }
  }
  return c10::Device(c10::kCPU);
}

// Runs `work`, naming the API in its error.
template <typename F>
void collective(const std::string& api, F&& work) {
  try {
    work();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, api, " (process_group): ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, api, " (process_group): ", e.what());
  }
}

void queue(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

} // namespace

struct ProcessGroupSync::Layout {
  size_t size = 0;
  std::vector<at::Tensor> params;
  std::vector<Edge> accumulators; // kept, so that they stay the parameters' nodes
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> sparse; // sparse embeddings' weights, reduced as sparse tensors
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::string api;

  // Whether this backward pass writes a parameter's gradient (autograd::grad only captures them).
  bool accumulates_in_current_pass() const {
    const auto* info = torch::autograd::get_current_graph_task_exec_info();
    if (info == nullptr || info->empty()) { // a plain backward: every node of the graph runs
      const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
      if (nodes == nullptr) {
        return true;
      }
      for (const auto& edge : accumulators) {
        if (nodes->count(edge.function.get()) > 0) {
          return true;
        }
      }
      return false;
    }
    for (const auto& edge : accumulators) {
      auto it = info->find(edge.function.get());
      if (it != info->end() && it->second.needed_) {
        return true;
      }
    }
    return false;
  }

  void reduce() {
    at::NoGradGuard no_grad;
    // The process-group average (Note [Reduction seam]): each process's share, then the sum.
    const auto average = GradReduction::average();
    const auto world = static_cast<size_t>(group->getSize());
    std::vector<c10::intrusive_ptr<c10d::Work>> works; // waited for once all are queued
    struct Pending {
      at::Tensor flat; // the gradients, then one "has a gradient here" flag per member
      int64_t numel = 0;
      std::vector<size_t> members;
      std::vector<at::Tensor> grads;
      bool missing = false; // a member has no gradient in this process
    };
    std::vector<Pending> pending;
    std::vector<std::pair<size_t, at::Tensor>> writes;
    for (const auto& bucket : buckets) {
      Pending entry;
      entry.members = bucket;
      std::vector<at::Tensor> pieces;
      const auto& first = params[bucket.front()];
      auto flags = at::ones({static_cast<int64_t>(bucket.size())}, first.options());
      for (const auto i : c10::irange(bucket.size())) {
        const auto& p = params[bucket[i]];
        auto g = p.grad();
        if (!g.defined()) {
          g = at::zeros_like(p);
          flags[static_cast<int64_t>(i)].zero_();
          entry.missing = true;
        } else if (g.layout() != c10::kStrided) { // a sparse gradient outside an embedding
          g = g.to_dense();
        }
        pieces.push_back(g.reshape(-1));
        entry.numel += g.numel();
        entry.grads.push_back(std::move(g));
      }
      // The flags' sums say whether any process has a gradient (no second collective).
      pieces.push_back(flags);
      entry.flat = at::cat(pieces);
      average.scale_(entry.flat.narrow(0, 0, entry.numel), world);
      std::vector<at::Tensor> one{entry.flat};
      collective(api, [&] {
        works.push_back(group->allreduce(one));
      });
      pending.push_back(std::move(entry));
    }
    at::Tensor sparse_used;
    bool sparse_missing = false;
    if (!sparse.empty()) {
      std::vector<double> flags;
      for (const auto k : sparse) {
        const bool has = params[k].grad().defined();
        flags.push_back(has ? 1.0 : 0.0);
        sparse_missing = sparse_missing || !has;
      }
      sparse_used = at::tensor(flags, at::TensorOptions().dtype(at::kFloat))
                        .to(params[sparse.front()].device());
      std::vector<at::Tensor> one{sparse_used};
      collective(api, [&] {
        works.push_back(group->allreduce(one));
      });
    }
    std::vector<std::pair<size_t, at::Tensor>> sparse_writes;
    for (const auto k : sparse) {
      const auto& p = params[k];
      auto g = p.grad();
      if (!g.defined()) {
        auto sizes = p.sizes().vec();
        sizes[0] = 0;
        g = at::sparse_coo_tensor(at::empty({1, 0}, p.options().dtype(at::kLong)),
                                  at::empty(sizes, p.options()), p.sizes());
      } else if (g.layout() == c10::kStrided) {
        g = g.to_sparse(1);
      }
      std::vector<at::Tensor> one{average.scaled(g.coalesce(), world)};
      collective(api, [&] {
        group->allreduce(one)->wait();
      });
      sparse_writes.emplace_back(k, one[0]);
    }
    for (auto& work : works) {
      collective(api, [&] {
        work->wait();
      });
    }
    // All reduced. Only a process lacking a gradient reads the flags, as that waits for the device.
    for (auto& p : pending) {
      const auto used = p.missing
                            ? p.flat.narrow(0, p.numel, static_cast<int64_t>(p.members.size()))
                                  .to(at::kDouble)
                                  .cpu()
                            : at::Tensor();
      int64_t offset = 0;
      for (const auto i : c10::irange(p.members.size())) {
        const auto k = p.members[i];
        const auto& g = p.grads[i];
        auto average = p.flat.narrow(0, offset, g.numel()).view(g.sizes());
        offset += g.numel();
        auto current = params[k].grad();
        if (current.defined() && current.layout() == c10::kStrided) {
          current.copy_(average);
        } else if (current.defined() || used.data_ptr<double>()[i] != 0) {
          writes.emplace_back(k, average.clone());
        }
      }
    }
    const auto used = sparse_missing ? sparse_used.to(at::kDouble).cpu() : at::Tensor();
    for (const auto i : c10::irange(sparse_writes.size())) {
      auto& [k, g] = sparse_writes[i];
      if (params[k].grad().defined() || used.data_ptr<double>()[i] != 0) {
        writes.emplace_back(k, std::move(g));
      }
    }
    for (auto& [k, g] : writes) {
      params[k].mutable_grad() = g;
    }
  }
};

// What the hooks of all forwards of one ProcessGroupSync share: one reduction per pass.
struct ProcessGroupSync::Passes {
  std::mutex mutex;
  // Graph task ids whose hooks ran, oldest first. A pass ends by removing its id; one that never
  // does (a failed pass: the engine runs no callback) is dropped once kMaxPasses newer ones came.
  std::set<int> queued;
  std::deque<int> order;
  size_t limit = kMaxPasses;
  std::mutex reduce_mutex;
  std::atomic<int64_t> reductions{0};

  void forget(int task) {
    std::lock_guard<std::mutex> lock(mutex);
    if (queued.erase(task) > 0) {
      order.erase(std::find(order.begin(), order.end(), task));
    }
  }

  static void reached(const std::shared_ptr<Passes>& self,
                      const std::shared_ptr<ProcessGroupSync::Layout>& layout) {
    const int task = torch::autograd::get_current_graph_task_id();
    {
      // Hooks run on several autograd threads at once, and a pass may span several forwards.
      std::lock_guard<std::mutex> lock(self->mutex);
      if (!self->queued.insert(task).second) {
        return;
      }
      self->order.push_back(task);
      while (self->order.size() > self->limit) {
        self->queued.erase(self->order.front());
        self->order.pop_front();
      }
    }
    if (!layout->accumulates_in_current_pass()) {
      queue([self, task] {
        self->forget(task);
      });
      return;
    }
    queue([self, layout, task] {
      self->forget(task);
      queue([self, layout] {
        std::lock_guard<std::mutex> lock(self->reduce_mutex);
        layout->reduce();
        ++self->reductions;
      });
    });
  }
};

ProcessGroupSync::ProcessGroupSync(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string api)
    : group_(std::move(group)), api_(std::move(api)), passes_(std::make_shared<Passes>()) {
  TORCH_CHECK(group_, api_, ": process_group is empty");
}

size_t ProcessGroupSync::remembered_passes() const {
  std::lock_guard<std::mutex> lock(passes_->mutex);
  return passes_->queued.size();
}

size_t ProcessGroupSync::max_passes() const {
  std::lock_guard<std::mutex> lock(passes_->mutex);
  return passes_->limit;
}

void ProcessGroupSync::set_max_passes(size_t n) {
  TORCH_CHECK_VALUE(n > 0, api_, ": max_passes must be positive, got ", n);
  std::lock_guard<std::mutex> lock(passes_->mutex);
  passes_->limit = n;
}

int64_t ProcessGroupSync::reductions() const {
  return passes_->reductions.load();
}

bool ProcessGroupSync::agreed(const std::vector<at::Tensor>& params) const {
  if (group_->getSize() == 1) {
    return true;
  }
  if (!state_synced_ || synced_params_.size() != params.size()) {
    return false;
  }
  for (const auto i : c10::irange(params.size())) {
    const auto& p = params[i];
    if (!synced_params_[i].is_same(p) ||
        synced_kinds_[i] != std::make_tuple(p.requires_grad(), p.scalar_type(), p.device())) {
      return false;
    }
  }
  return true;
}

void ProcessGroupSync::agree(const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& buffers,
                             const std::vector<bool>& sparse) {
  if (group_->getSize() == 1) {
    return;
  }
  TORCH_CHECK(sparse.empty() || sparse.size() == params.size(), api_, ": ", sparse.size(),
              " sparse flags for ", params.size(), " parameters");
  TORCH_CHECK(distinct(params).size() == params.size(), api_,
              ": the parameters hold a tensor twice; pass each parameter once");
  at::NoGradGuard no_grad;
  const auto unique_buffers = distinct(buffers);
  // Even with nothing to compare: the other processes wait for this one's check.
  check_same_module(params, unique_buffers);
  auto all = params;
  all.insert(all.end(), unique_buffers.begin(), unique_buffers.end());
  broadcast(all);
  synced_params_ = params;
  synced_sparse_ = sparse.empty() ? std::vector<bool>(params.size(), false) : sparse;
  synced_kinds_.clear();
  for (const auto& p : params) {
    synced_kinds_.emplace_back(p.requires_grad(), p.scalar_type(), p.device());
  }
  state_synced_ = true;
  layout_.reset(); // made again at the next watch(), from these parameters
}

void ProcessGroupSync::before_forward(const torch::nn::Module& module, bool buffers) {
  const auto params = distinct(module.parameters());
  if (!agreed(params)) {
    std::unordered_set<const c10::TensorImpl*> sparse_weights;
    for (const auto& m : module.modules()) {
      if (const auto* e = m->as<torch::nn::Embedding>(); e != nullptr && e->options.sparse()) {
        sparse_weights.insert(e->weight.unsafeGetTensorImpl());
      } else if (const auto* b = m->as<torch::nn::EmbeddingBag>();
                 b != nullptr && b->options.sparse()) {
        sparse_weights.insert(b->weight.unsafeGetTensorImpl());
      }
    }
    std::vector<bool> sparse;
    sparse.reserve(params.size());
    for (const auto& p : params) {
      sparse.push_back(sparse_weights.count(p.unsafeGetTensorImpl()) > 0);
    }
    agree(params, module.buffers(), sparse);
  } else if (buffers) {
    broadcast(distinct(module.buffers()));
  }
}

void ProcessGroupSync::check_same_module(const std::vector<at::Tensor>& params,
                                         const std::vector<at::Tensor>& buffers) {
  std::ostringstream shapes;
  int64_t param_numel = 0;
  int64_t buffer_numel = 0;
  for (const auto& p : params) {
    shapes << p.sizes() << ':' << p.scalar_type() << ':' << p.requires_grad() << ';';
    param_numel += p.numel();
  }
  shapes << '|';
  for (const auto& b : buffers) {
    shapes << b.sizes() << ':' << b.scalar_type() << ':' << b.requires_grad() << ';';
    buffer_numel += b.numel();
  }
  std::vector<int64_t> mine{static_cast<int64_t>(params.size()), param_numel,
                            static_cast<int64_t>(buffers.size()), buffer_numel,
                            text_hash(shapes.str())};
  auto all = params;
  all.insert(all.end(), buffers.begin(), buffers.end());
  auto device = collective_device(all);
  // An empty module on an NCCL group (which reduces no CPU tensors): the current GPU.
  if (all.empty() && group_->getBackendName() == "nccl" && at::hasCUDA()) {
    device = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice();
  }
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  std::vector<at::Tensor> input{at::tensor(mine, at::TensorOptions().dtype(at::kLong)).to(device)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < group_->getSize(); ++r) {
    output[0].push_back(at::empty({static_cast<int64_t>(mine.size())}, options));
  }
  collective(api_, [&] {
    group_->allgather(output, input)->wait();
  });
  std::vector<std::vector<int64_t>> rows;
  for (const auto& t : output[0]) {
    auto cpu = t.cpu();
    rows.emplace_back(cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel());
  }
  auto text = [&](const std::vector<int64_t>& r) {
    const bool same_counts = std::equal(r.begin(), r.begin() + 4, rows[0].begin());
    return c10::str(r[0], " parameters (", r[1], " elements) and ", r[2], " buffers (", r[3],
                    " elements)", same_counts ? ", other shapes, dtypes or requires_grad" : "");
  };
  for (const auto rank : c10::irange(rows.size())) {
    TORCH_CHECK(rows[rank] == rows[0], api_,
                ": the processes of process_group wrap different modules: group rank ", rank,
                " has ", text(rows[rank]), ", group rank 0 has ", text(rows[0]),
                "; every process must wrap the same model (and change it alike)");
  }
}

void ProcessGroupSync::broadcast(const std::vector<at::Tensor>& tensors) {
  if (group_->getSize() == 1) {
    return;
  }
  at::NoGradGuard no_grad;
  std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, c10::ScalarType>, std::vector<at::Tensor>>
      kinds;
  for (const auto& t : tensors) {
    if (t.numel() > 0 && t.layout() == c10::kStrided && t.device().type() != c10::kMeta) {
      kinds[{t.device().type(), t.device().index(), t.scalar_type()}].push_back(t.detach());
    }
  }
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  options.rootTensor = 0;
  for (auto& [kind, members] : kinds) {
    std::vector<at::Tensor> pieces;
    for (const auto& t : members) {
      pieces.push_back(t.reshape(-1));
    }
    std::vector<at::Tensor> one{at::cat(pieces)};
    collective(api_, [&] {
      group_->broadcast(one, options)->wait();
    });
    int64_t offset = 0;
    for (auto& t : members) {
      t.copy_(one[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

std::shared_ptr<ProcessGroupSync::Layout> ProcessGroupSync::layout_of(size_t bucket_bytes) {
  // The parameters agree() last took (no second walk of the module).
  if (layout_ && layout_->size == bucket_bytes) {
    return layout_;
  }
  auto layout = std::make_shared<Layout>();
  layout->size = bucket_bytes;
  layout->group = group_;
  layout->api = api_;
  std::vector<bool> sparse;
  for (const auto i : c10::irange(synced_params_.size())) {
    if (std::get<0>(synced_kinds_[i])) { // requires_grad
      layout->params.push_back(synced_params_[i]);
      layout->accumulators.push_back(torch::autograd::impl::gradient_edge(synced_params_[i]));
      sparse.push_back(synced_sparse_[i]);
    }
  }
  // Reverse registration order, one open bucket per device and dtype, at most bucket_bytes each.
  std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, c10::ScalarType>,
           std::pair<size_t, size_t>> // bucket index, bytes
      open;
  for (size_t k = layout->params.size(); k-- > 0;) {
    const auto& p = layout->params[k];
    if (sparse[k]) {
      layout->sparse.push_back(k);
      continue;
    }
    const std::tuple<c10::DeviceType, c10::DeviceIndex, c10::ScalarType> kind{
        p.device().type(), p.device().index(), p.scalar_type()};
    const size_t nbytes = static_cast<size_t>(p.numel()) * p.element_size();
    auto it = open.find(kind);
    if (it == open.end() || (bucket_bytes > 0 && it->second.second + nbytes > bucket_bytes)) {
      layout->buckets.emplace_back();
      it = open.insert_or_assign(kind, std::make_pair(layout->buckets.size() - 1, size_t{0})).first;
    }
    layout->buckets[it->second.first].push_back(k);
    it->second.second += nbytes;
  }
  layout_ = layout;
  return layout;
}

void ProcessGroupSync::watch(const std::vector<at::Tensor>& outputs, size_t bucket_bytes) {
  if (group_->getSize() == 1) {
    return;
  }
  std::vector<at::Tensor> hooked;
  for (const auto& t : outputs) {
    // Leaf outputs are not hooked: a hook on a leaf outlives the step, one more per forward.
    if (t.defined() && t.requires_grad() && !t.is_leaf()) {
      hooked.push_back(t);
    }
  }
  if (hooked.empty()) {
    return;
  }
  auto layout = layout_of(bucket_bytes);
  if (layout->params.empty()) {
    return;
  }
  auto passes = passes_;
  for (auto& t : hooked) {
    t.register_hook([passes, layout](const at::Tensor&) {
      Passes::reached(passes, layout);
    });
  }
}

} // namespace torchdp::detail

#endif // TORCHDP_WITH_C10D
