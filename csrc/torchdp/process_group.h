#pragma once

// The engine behind both front ends' process_group option, over tensors and a group, never a
// module (Note [Reducing across processes] in process_group.cpp). Built with TORCHDP_WITH_C10D.

#include <torchdp/config.h>

#if TORCHDP_WITH_C10D

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace torchdp::detail {

/// Keeps one DataParallel's parameters and buffers in step with the other processes of a group.
class ProcessGroupSync {
 public:
  ProcessGroupSync(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string api);

  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const {
    return group_;
  }

  /// Whether `params` are the tensors last agreed on, alike in requires_grad, dtype and device.
  bool agreed(const std::vector<at::Tensor>& params) const;

  /// Checks that every process holds matching parameters and buffers, takes group rank 0's values
  /// and remembers `params` for watch(). `sparse[i]`: params[i] gets sparse gradients (empty:
  /// none). Every process must call it at the same forward.
  void agree(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& buffers,
             const std::vector<bool>& sparse);

  /// Copies group rank 0's values of `tensors` (the buffers) into every process's.
  void broadcast(const std::vector<at::Tensor>& tensors);

  /// The C++ module's forward: agree() when the module's parameters are not agreed(), else
  /// broadcast() of its buffers when `buffers`. Sparse: Embedding/EmbeddingBag with sparse().
  void before_forward(const torch::nn::Module& module, bool buffers);

  /// Hooks the non-leaf `outputs` that require grad so that a backward through them averages the
  /// agreed parameters' gradients (`bucket_bytes` 0: one bucket per device and dtype).
  void watch(const std::vector<at::Tensor>& outputs, size_t bucket_bytes);

  /// Backward passes whose hooks ran and whose end has not come, at most max_passes().
  size_t remembered_passes() const;
  static constexpr size_t kMaxPasses = 1024;
  size_t max_passes() const;
  void set_max_passes(size_t n);

  /// How many reductions (one per backward pass that wrote a watched gradient) have run.
  int64_t reductions() const;

  struct Layout;
  struct Passes;

 private:
  std::shared_ptr<Layout> layout_of(size_t bucket_bytes);
  void check_same_module(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& buffers);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string api_;
  bool state_synced_ = false;
  // The parameters that the processes last agreed on, and which of them get sparse gradients.
  std::vector<at::Tensor> synced_params_;
  std::vector<bool> synced_sparse_;
  // Each one's requires_grad, dtype and device: a conversion (to(kDouble), to(device)) keeps the
  // parameters but gives them new AccumulateGrad nodes, which the layout must follow.
  std::vector<std::tuple<bool, c10::ScalarType, c10::Device>> synced_kinds_;
  std::shared_ptr<Layout> layout_;
  std::shared_ptr<Passes> passes_;
};

} // namespace torchdp::detail

#endif // TORCHDP_WITH_C10D
