#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace torchdp::detail {

// Note [Graphed replicas in C++]
// DataParallelOptions::cuda_graphs: the C++ form of the Python cuda_graphs option (Note [Graphed
// replicas] in python/torchdp/_graphs.py). Replicas are built once, by a Replicator of their own
// (post-replicate hooks and the device check run then), and kept: replica 0's parameters are leaf
// tensors over the module's own parameter storage and its buffers share the module's buffers;
// replica j >= 1 holds one flat tensor per dtype for its parameters and one for its buffers,
// refreshed from the module before every forward (one packing copy per dtype on the first device,
// one copy per device). Per input signature (each replica's input shapes, dtypes and devices,
// the training flags, grad mode and autocast state) each replica's forward and, when gradients are
// needed, its backward are captured once as CUDA graphs, after warm-up steps whose effects on
// buffers and random number generators are undone; the backward graph packs the parameter
// gradients into one flat tensor per dtype (zeros for unused parameters). A forward replays the
// forward graphs; one autograd node (inputs: the scattered chunks and the module's parameters)
// replays the backward graphs, sums the flat gradients on the first device and hands every
// parameter its slice. A second forward of a signature whose previous backward is still pending
// runs eagerly (run() returns nothing); a backward through a forward whose graphs were replayed
// since raises. Parameters or buffers with new storage make the next forward rebuild everything.
class GraphedReplicas {
 public:
  /// Calls the forward of one replica on its arguments.
  using Call = std::function<at::Tensor(const std::shared_ptr<torch::nn::Module>&,
                                        std::vector<at::Tensor>&)>;

  GraphedReplicas(std::shared_ptr<torch::nn::Module> module, std::vector<c10::Device> devices,
                  size_t max_signatures);
  ~GraphedReplicas();
  GraphedReplicas(const GraphedReplicas&) = delete;
  GraphedReplicas& operator=(const GraphedReplicas&) = delete;

  /// One output per replica (chunks[j] are replica j's arguments, on devices[j]), or an empty
  /// vector when this forward has to run eagerly.
  std::vector<at::Tensor> run(const std::vector<std::vector<at::Tensor>>& chunks, const Call& call);
  /// Signatures captured so far (all of them, also those dropped by a rebuild).
  int64_t captures_made() const;
  /// The module the replicas were made of.
  const std::shared_ptr<torch::nn::Module>& module() const;

  struct State; // implementation detail (graphed_replicas.cpp)

 private:
  std::shared_ptr<State> state_;
};

/// Whether this build can capture CUDA graphs (TORCHDP_WITH_CUDA).
bool cuda_graphs_available();

} // namespace torchdp::detail
