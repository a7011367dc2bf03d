#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torchdp::detail {

// Note [Graphed replicas]
// cuda_graphs=True replays each replica's forward and backward as CUDA graphs (CPU-bound models of
// many small layers). Graphs need fixed addresses: replica 0 reads the module's own storage and
// replica j >= 1 flat tensors per dtype, refreshed before each forward. Per input signature both
// are captured once, after a warm-up whose buffer and RNG effects are undone; one autograd node
// replays the backward graphs and sums the flat gradients. A forward whose signature awaits its
// backward runs eagerly; a backward through graphs replayed since raises.

/// The engine of Note [Graphed replicas], over tensors; its front ends (GraphedReplicas,
/// python/torchdp/_graphs.py) build the replicas, install its storage and call their forwards.
class GraphedSteps {
 public:
  /// Runs replica j's forward on `inputs` (on devices[j]) and returns its output tensors.
  using Forward =
      std::function<std::vector<at::Tensor>(size_t j, const std::vector<at::Tensor>& inputs)>;

  /// What replica j's parameters and buffers are made of, in the order given to rebuild().
  struct Storage {
    std::vector<at::Tensor> params, buffers;
  };

  /// `api` names the option in errors ("torchdp.DataParallel(cuda_graphs=True)").
  GraphedSteps(std::vector<c10::Device> devices, size_t max_signatures, std::string api);
  ~GraphedSteps();
  GraphedSteps(const GraphedSteps&) = delete;
  GraphedSteps& operator=(const GraphedSteps&) = delete;

  /// Drops every capture and lays out replicas 0..n-1 for the module's distinct `params` and
  /// `buffers` (on devices[0]): replica 0 over their storage, j >= 1 over flat tensors.
  std::vector<Storage> rebuild(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                               size_t n);
  /// Replica j's leaves for the parameters that require grad, which the graphs differentiate by.
  void bind(size_t j, std::vector<at::Tensor> grad_leaves);
  /// Replicas laid out by the last rebuild().
  size_t replicas() const;

  /// `key` (training flags, other arguments) plus the inputs' metadata, grad mode and autocast.
  std::string signature(const std::string& key,
                        const std::vector<std::vector<at::Tensor>>& inputs) const;
  /// Every replica's outputs, or nothing when this forward runs eagerly (inference mode, a pending
  /// backward of its signature, max_signatures reached).
  std::optional<std::vector<std::vector<at::Tensor>>> run(
      const std::string& signature, const std::vector<std::vector<at::Tensor>>& inputs,
      const Forward& forward);
  /// Signatures captured so far (also those dropped by a rebuild).
  int64_t captures_made() const;

  struct State; // implementation detail (graphed_steps.cpp)

 private:
  std::shared_ptr<State> state_;
};

/// DataParallelOptions::cuda_graphs: GraphedSteps over replicas of a torch::nn::Module made by a
/// Replicator of their own. New parameter or buffer storage rebuilds everything.
class GraphedReplicas {
 public:
  /// Calls the forward of one replica on its arguments.
  using Call = std::function<at::Tensor(const std::shared_ptr<torch::nn::Module>&,
                                        std::vector<at::Tensor>&)>;

  GraphedReplicas(std::shared_ptr<torch::nn::Module> module, std::vector<c10::Device> devices,
                  size_t max_signatures);

  /// One output per replica (chunks[j]: replica j's arguments), or none when it runs eagerly.
  std::vector<at::Tensor> run(const std::vector<std::vector<at::Tensor>>& chunks, const Call& call);
  int64_t captures_made() const;
  /// The module the replicas were made of.
  const std::shared_ptr<torch::nn::Module>& module() const;

 private:
  std::vector<int64_t> current_layout() const;
  void rebuild(size_t n);

  std::shared_ptr<torch::nn::Module> module_;
  std::vector<c10::Device> devices_;
  GraphedSteps steps_;
  std::vector<int64_t> layout_;
  std::vector<std::shared_ptr<torch::nn::Module>> replicas_;
};

/// Whether this build can capture CUDA graphs (TORCHDP_WITH_CUDA).
bool cuda_graphs_available();

} // namespace torchdp::detail
