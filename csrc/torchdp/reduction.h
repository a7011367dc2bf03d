#pragma once

// The one place where torchdp names how losses and gradients are combined (Note [Reduction seam]
// in reduction.cpp): the loss reductions shared by parallel_loss and Python's
// DataParallelCriterion, and the gradient reduction that buckets and the transport call through.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <array>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace torchdp {

/// How the per-replica losses combine (parallel_loss, DataParallelCriterion).
enum class LossReduction {
  Mean,      ///< average weighted by each chunk's number of samples (the whole-batch mean)
  BatchMean, ///< each replica's sum over its chunk's batch size, combined like Mean (KLDivLoss)
  Sum,       ///< sum of the replicas' losses
  None,      ///< the per-sample losses, concatenated along the batch dimension
};

/// Every loss reduction, in the order of their names in errors and documentation.
inline constexpr std::array<LossReduction, 4> kLossReductions = {
    LossReduction::Mean, LossReduction::BatchMean, LossReduction::Sum, LossReduction::None};

/// The reduction's name, as torch.nn's losses spell it ("mean", "batchmean", "sum", "none").
const char* loss_reduction_name(LossReduction reduction);

/// The reduction named `name`; a ValueError naming `api`, the name and the choices otherwise.
LossReduction loss_reduction_from_name(std::string_view name, std::string_view api);

/// How the gradients of several contributors (replicas, processes) combine, as a DDP comm hook
/// does: the sum (the default, torch.nn.DataParallel's), the average, or a function of one's own
/// over each gradient bucket. Copyable; the default costs one branch per bucket.
class GradReduction {
 public:
  /// A comm hook: reduces one bucket, per_device[j][k] being tensor k's gradient from replica j,
  /// to one tensor per k on `destination` (same sizes and dtypes; never an input's storage).
  using Hook = std::function<std::vector<at::Tensor>(
      const std::vector<std::vector<at::Tensor>>& per_device, c10::Device destination)>;

  /// The sum.
  GradReduction() = default;
  static GradReduction sum();
  /// The sum divided by the number of contributors.
  static GradReduction average();
  /// `hook` reduces every bucket; `name` says which in errors and printing.
  static GradReduction from_hook(Hook hook, std::string name);

  bool is_sum() const {
    return kind_ == Kind::Sum;
  }
  /// The sum or the average (not a hook).
  bool is_builtin() const {
    return kind_ != Kind::Hook;
  }
  /// "sum", "average" or the hook's name.
  std::string name() const;

  /// Reduces one bucket: the hook, else the transport (comm::reduce_add_coalesced's buckets of
  /// `buffer_size` bytes), each bucket's sum scaled by scale_().
  std::vector<at::Tensor> operator()(const std::vector<std::vector<at::Tensor>>& per_device,
                                     c10::Device destination, size_t buffer_size) const;

  /// Scales `t` in place into its share of a reduction over `contributors`: the average divides
  /// (a sum of them, or one of them before they are summed), the sum leaves it. Not for hooks.
  void scale_(const at::Tensor& t, size_t contributors) const {
    if (kind_ == Kind::Average && contributors != 1) {
      divide_(t, contributors);
    }
  }
  /// scale_() on a new tensor (`t` itself for the sum).
  at::Tensor scaled(const at::Tensor& t, size_t contributors) const;

 private:
  enum class Kind { Sum, Average, Hook };
  explicit GradReduction(Kind kind) : kind_(kind) {}
  static void divide_(const at::Tensor& t, size_t contributors);

  Kind kind_ = Kind::Sum;
  Hook hook_;
  std::string name_;
};

/// This thread's gradient reduction: the innermost GradReductionGuard's, else the sum. A
/// differentiable broadcast (replicate, DataParallel's forward) keeps it for its backward.
const GradReduction& grad_reduction();

/// Sets this thread's gradient reduction while it lives:
///
///   torchdp::GradReductionGuard average(torchdp::GradReduction::average());
///   auto loss = model->forward(x).sum();   // model: torchdp::DataParallel
///   loss.backward();                       // each .grad: the replicas' mean, not their sum
class GradReductionGuard {
 public:
  explicit GradReductionGuard(GradReduction reduction);
  ~GradReductionGuard();
  GradReductionGuard(const GradReductionGuard&) = delete;
  GradReductionGuard& operator=(const GradReductionGuard&) = delete;

 private:
  std::optional<GradReduction> previous_;
};

namespace detail {

/// Combines the per-replica `losses` (0-dim, except with None) on `destination`; `counts[i]` is
/// replica i's number of samples, `total` their sum. parallel_loss's combination step.
at::Tensor combine_losses(std::vector<at::Tensor> losses, const std::vector<int64_t>& counts,
                          int64_t total, LossReduction reduction, int64_t dim,
                          c10::Device destination);

} // namespace detail

namespace comm {

/// The transport's reduction (transport/comm.cpp): reduce_add_coalesced is this with the sum.
std::vector<at::Tensor> reduce_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                         c10::Device destination, size_t buffer_size,
                                         const GradReduction& reduction);

} // namespace comm

namespace autograd {

/// Differentiable comm::reduce_coalesced (the average's backward divides the broadcast gradient);
/// a hook reduces as it is, recording history where its operations do. The broadcast's backward
/// reduces each gradient bucket with this.
std::vector<at::Tensor> reduce_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                         c10::Device destination, size_t buffer_size,
                                         const GradReduction& reduction);

} // namespace autograd

} // namespace torchdp
