#pragma once

// Averaging gradients over the processes of a c10d process group: DataParallelOptions::
// process_group (see Note [Reducing across processes] in process_group.cpp). Compiled when the
// libtorch torchdp is built against ships the c10d headers (TORCHDP_WITH_C10D).

#include <torchdp/config.h>

#if TORCHDP_WITH_C10D

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace torchdp::detail {

/// Keeps one DataParallel's module in step with the other processes of a group.
class ProcessGroupSync {
 public:
  ProcessGroupSync(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string api);

  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const {
    return group_;
  }

  /// At the first call, and when the parameters changed: checks that every process wraps the
  /// same parameters and buffers and takes group rank 0's values. Otherwise group rank 0's
  /// buffers when `buffers`.
  void before_forward(const torch::nn::Module& module, bool buffers);

  /// Hooks `outputs` (those that require grad) so that a backward pass through them ends with the
  /// module's gradients averaged over the group. `bucket_bytes`: 0 gives one bucket per device
  /// and dtype. Call after before_forward(), whose parameters it buckets.
  void watch(const torch::nn::Module& module, const std::vector<at::Tensor>& outputs,
             size_t bucket_bytes);

  /// The backward passes this object still remembers (their hooks ran, their end did not come
  /// yet): at most kMaxPasses, the oldest dropped first.
  size_t remembered_passes() const;
  static constexpr size_t kMaxPasses = 1024;

  struct Layout;
  struct Passes;

 private:
  std::shared_ptr<Layout> layout_of(const torch::nn::Module& module, size_t bucket_bytes);
  void check_same_module(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& buffers);
  void broadcast(const std::vector<at::Tensor>& tensors);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string api_;
  bool state_synced_ = false;
  // The parameters that the processes last agreed on.
  std::vector<at::Tensor> synced_params_;
  // Each one's requires_grad, dtype and device: a conversion (to(kDouble), to(device)) keeps the
  // parameters but gives them new AccumulateGrad nodes, which the layout must follow.
  std::vector<std::tuple<bool, c10::ScalarType, c10::Device>> synced_kinds_;
  std::shared_ptr<Layout> layout_;
  std::shared_ptr<Passes> passes_;
};

} // namespace torchdp::detail

#endif // TORCHDP_WITH_C10D
