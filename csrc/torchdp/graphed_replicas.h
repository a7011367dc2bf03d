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
// cuda_graphs=True replays each replica's forward and backward as CUDA graphs: a model of many
// small layers is bound by the CPU, and every replica issues as many kernels as the whole model
// does on one device. Graphs need fixed addresses, so the replicas are kept between steps:
// replica 0 reads the module's own parameter storage and buffers; replica j >= 1 holds one flat
// tensor per dtype for its parameters and one for its buffers, refreshed from the module before
// every forward (one packing copy per dtype on the first device, one copy per device). Per input
// signature, each replica's forward and, when gradients are needed, its backward are captured
// once, after warm-up steps whose effects on buffers and random number generators are undone;
// the backward graph packs the parameter gradients into one flat tensor per dtype (zeros for
// unused parameters). One autograd node (inputs: the chunks and the module's parameters) replays
// the backward graphs, sums the flat gradients on the first device and hands every parameter its
// slice. A second forward of a signature whose backward is still pending runs eagerly; a backward
// through a forward whose graphs were replayed since raises. GraphedSteps is that engine, over
// tensors only; each front end (GraphedReplicas here, python/torchdp/_graphs.py) builds the
// replicas, installs the engine's storage in them and calls their forwards.
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
  /// `buffers` (all on devices[0]): replica 0 over their own storage (detached parameters, the
  /// buffers themselves), replica j >= 1 over flat tensors on devices[j].
  std::vector<Storage> rebuild(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                               size_t n);
  /// Replica j's leaves for the parameters that require grad, in order: the graphs
  /// differentiate with respect to them.
  void bind(size_t j, std::vector<at::Tensor> grad_leaves);
  /// Replicas laid out by the last rebuild().
  size_t replicas() const;

  /// The input signature of a forward: `key` (what the tensors do not tell apart: training
  /// flags, the other arguments), the inputs' shapes, strides, dtypes and devices, grad mode and
  /// autocast state. A front end keys what it keeps per capture by it.
  std::string signature(const std::string& key,
                        const std::vector<std::vector<at::Tensor>>& inputs) const;
  /// Every replica's output tensors, or nothing when this forward has to run eagerly (inference
  /// mode, a pending backward of the same signature, no room for another signature).
  std::optional<std::vector<std::vector<at::Tensor>>> run(
      const std::string& signature, const std::vector<std::vector<at::Tensor>>& inputs,
      const Forward& forward);
  /// Signatures captured so far (also those dropped by a rebuild).
  int64_t captures_made() const;

  struct State; // implementation detail (graphed_steps.cpp)

 private:
  std::shared_ptr<State> state_;
};

/// DataParallelOptions::cuda_graphs: GraphedSteps over replicas of a torch::nn::Module, built by
/// a Replicator of their own (post-replicate hooks and the device check run then). Parameters or
/// buffers with new storage make the next forward rebuild everything.
class GraphedReplicas {
 public:
  /// Calls the forward of one replica on its arguments.
  using Call = std::function<at::Tensor(const std::shared_ptr<torch::nn::Module>&,
                                        std::vector<at::Tensor>&)>;

  GraphedReplicas(std::shared_ptr<torch::nn::Module> module, std::vector<c10::Device> devices,
                  size_t max_signatures);

  /// One output per replica (chunks[j] are replica j's arguments, on devices[j]), or an empty
  /// vector when this forward has to run eagerly.
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
