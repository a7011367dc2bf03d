// GraphedReplicas: the C++ front end of GraphedSteps (Note [Graphed replicas]).

#include <torchdp/graphed_replicas.h>
#include <torchdp/replicate.h>

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

namespace torchdp::detail {
namespace {

constexpr const char* kApi = "torchdp::DataParallel (cuda_graphs)";

// Binds the slots to `views[index[k]]`; tensors shared in the module stay shared (one gradient).
std::vector<at::Tensor> bind_slots(const std::vector<at::Tensor>& slots,
                                   const std::vector<size_t>& index,
                                   const std::vector<at::Tensor>& views, c10::Device device) {
  std::vector<at::Tensor> bound(views.size());
  c10::NoGradGuard no_grad;
  for (const auto k : c10::irange(slots.size())) {
    auto& target = bound[index[k]];
    if (!target.defined()) {
      target = slots[k];
      target.set_data(views[index[k]]);
    } else {
      TORCH_CHECK(target.unsafeGetTensorImpl() == slots[k].unsafeGetTensorImpl(), kApi,
                  ": a tensor that the module registers at two positions is two tensors in its "
                  "replica on ",
                  device, "; turn cuda_graphs off for this module");
    }
  }
  return bound;
}

} // namespace

GraphedReplicas::GraphedReplicas(std::shared_ptr<torch::nn::Module> module,
                                 std::vector<c10::Device> devices, size_t max_signatures)
    : module_(std::move(module)),
      devices_(devices),
      steps_(std::move(devices), max_signatures, kApi) {}

std::vector<int64_t> GraphedReplicas::current_layout() const {
  std::vector<int64_t> key;
  const auto modules = module_->modules();
  key.push_back(static_cast<int64_t>(modules.size()));
  for (const auto& m : modules) {
    key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(m.get())));
  }
  // Which tensors, where and in what shape (set_data, to() and new tensors all show).
  auto add = [&key](const at::Tensor& t) {
    key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.unsafeGetTensorImpl())));
    key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())));
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(t.dim());
    key.insert(key.end(), t.sizes().begin(), t.sizes().end());
  };
  for (const auto& p : module_->parameters()) {
    add(p);
    key.push_back(p.requires_grad() ? 1 : 0);
  }
  for (const auto& b : module_->buffers()) {
    add(b);
  }
  return key;
}

void GraphedReplicas::rebuild(size_t n) {
  std::vector<size_t> param_index, buffer_index;
  auto params = distinct(module_->parameters(), &param_index);
  const auto buffers = distinct(module_->buffers(), &buffer_index);
  const auto storage = steps_.rebuild(params, buffers, n);
  Replicator replicator(module_);
  std::vector<c10::Device> used(devices_.begin(), devices_.begin() + static_cast<int64_t>(n));
  {
    c10::NoGradGuard no_grad;
    replicas_ = replicator.replicate(used, /*detach=*/true);
  }
  for (const auto j : c10::irange(n)) {
    auto slots = replicas_[j]->parameters();
    auto buffer_slots = replicas_[j]->buffers();
    TORCH_CHECK(slots.size() == param_index.size() && buffer_slots.size() == buffer_index.size(),
                kApi, ": the replica on ", used[j], " has ", slots.size(), " parameters and ",
                buffer_slots.size(), " buffers where the module has ", param_index.size(), " and ",
                buffer_index.size(),
                " (a post-replicate hook that registers tensors); turn cuda_graphs off");
    auto bound = bind_slots(slots, param_index, storage[j].params, used[j]);
    bind_slots(buffer_slots, buffer_index, storage[j].buffers, used[j]);
    std::vector<at::Tensor> grad_leaves;
    for (const auto k : c10::irange(bound.size())) {
      bound[k].requires_grad_(params[k].requires_grad());
      if (params[k].requires_grad()) {
        grad_leaves.push_back(bound[k]);
      }
    }
    steps_.bind(j, std::move(grad_leaves));
  }
}

std::vector<at::Tensor> GraphedReplicas::run(const std::vector<std::vector<at::Tensor>>& chunks,
                                             const Call& call) {
  if (c10::InferenceMode::is_enabled()) {
    return {}; // the engine runs it eagerly; no replicas of inference tensors either
  }
  const size_t n = chunks.size();
  auto layout = current_layout();
  if (layout != layout_ || steps_.replicas() < n) {
    rebuild(n);
    layout_ = std::move(layout);
  }
  const auto originals = module_->modules();
  std::string key;
  for (const auto& m : originals) {
    key += m->is_training() ? '1' : '0';
  }
  auto outputs = steps_.run(
      steps_.signature(key, chunks), chunks, [&](size_t j, const std::vector<at::Tensor>& inputs) {
        // Training flags as the module's (pre-order: each module's own call comes last).
        const auto copies = replicas_[j]->modules();
        for (const auto k : c10::irange(std::min(originals.size(), copies.size()))) {
          copies[k]->train(originals[k]->is_training());
        }
        auto args = inputs;
        return std::vector<at::Tensor>{call(replicas_[j], args)};
      });
  std::vector<at::Tensor> out;
  if (outputs) {
    for (auto& replica : *outputs) {
      out.push_back(std::move(replica.at(0)));
    }
  }
  return out;
}

int64_t GraphedReplicas::captures_made() const {
  return steps_.captures_made();
}

const std::shared_ptr<torch::nn::Module>& GraphedReplicas::module() const {
  return module_;
}

} // namespace torchdp::detail
