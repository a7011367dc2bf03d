#include <torchdp/autograd.h>
#include <torchdp/reduction.h>

#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <utility>

// Note [Reduction seam]
// Losses: one enum and one name map, used by parallel_loss (C++) and DataParallelCriterion
// (Python, through the binding), so the two accept the same names with the same error.
// Gradients: every place that combines the gradients of several contributors goes through a
// GradReduction, as DDP's comm hooks do. The broadcast's backward calls it once per bucket; the
// built-in sum and average run in the transport, whose flat bucket sums scale_() in place (the
// sum: one branch, no copy); a hook replaces the transport for its buckets. The process-group
// engine averages across processes with the average's scale_() before its all-reduce (as DDP
// divides before summing, which keeps low-precision values in range).

namespace torchdp {

const char* loss_reduction_name(LossReduction reduction) {
  switch (reduction) {
    case LossReduction::Mean:
      return "mean";
    case LossReduction::BatchMean:
      return "batchmean";
    case LossReduction::Sum:
      return "sum";
    case LossReduction::None:
      return "none";
  }
  TORCH_CHECK(false, "torchdp: unknown LossReduction ", static_cast<int>(reduction));
}

LossReduction loss_reduction_from_name(std::string_view name, std::string_view api) {
  std::string choices;
  for (const auto reduction : kLossReductions) {
    if (name == loss_reduction_name(reduction)) {
      return reduction;
    }
    choices += choices.empty() ? "'" : ", '";
    choices += loss_reduction_name(reduction);
    choices += "'";
  }
  TORCH_CHECK_VALUE(false, api, ": reduction must be one of ", choices, ", got '", name, "'");
}

GradReduction GradReduction::sum() {
  return GradReduction(Kind::Sum);
}

GradReduction GradReduction::average() {
  return GradReduction(Kind::Average);
}

GradReduction GradReduction::from_hook(Hook hook, std::string name) {
  TORCH_CHECK_VALUE(static_cast<bool>(hook), "torchdp::GradReduction::from_hook: the hook '", name,
                    "' is empty");
  GradReduction reduction(Kind::Hook);
  reduction.hook_ = std::move(hook);
  reduction.name_ = std::move(name);
  return reduction;
}

std::string GradReduction::name() const {
  switch (kind_) {
    case Kind::Sum:
      return "sum";
    case Kind::Average:
      return "average";
    case Kind::Hook:
      break;
  }
  return name_;
}

std::vector<at::Tensor> GradReduction::operator()(
    const std::vector<std::vector<at::Tensor>>& per_device, c10::Device destination,
    size_t buffer_size) const {
  if (kind_ != Kind::Hook) {
    return comm::reduce_coalesced(per_device, destination, buffer_size, *this);
  }
  auto result = hook_(per_device, destination);
  const size_t count = per_device.empty() ? 0 : per_device.front().size();
  TORCH_CHECK(result.size() == count, "torchdp: the gradient reduction '", name_, "' returned ",
              result.size(), " tensors for a bucket of ", count);
  for (const auto k : c10::irange(count)) {
    const auto& like = per_device.front()[k];
    TORCH_CHECK(result[k].defined() && result[k].sizes() == like.sizes() &&
                    result[k].scalar_type() == like.scalar_type(),
                "torchdp: the gradient reduction '", name_, "' returned for tensor ", k, " ",
                result[k].defined()
                    ? c10::str(result[k].scalar_type(), " of sizes ", result[k].sizes())
                    : std::string("an undefined tensor"),
                ", expected ", like.scalar_type(), " of sizes ", like.sizes());
  }
  return result;
}

at::Tensor GradReduction::scaled(const at::Tensor& t, size_t contributors) const {
  if (kind_ == Kind::Average && contributors != 1) {
    return t.div(static_cast<double>(contributors));
  }
  return t;
}

void GradReduction::divide_(const at::Tensor& t, size_t contributors) {
  t.div_(static_cast<double>(contributors));
}

namespace {
thread_local std::optional<GradReduction> reduction_override;
} // namespace

const GradReduction& grad_reduction() {
  static const GradReduction kSum;
  return reduction_override ? *reduction_override : kSum;
}

GradReductionGuard::GradReductionGuard(GradReduction reduction)
    : previous_(std::move(reduction_override)) {
  reduction_override = std::move(reduction);
}

GradReductionGuard::~GradReductionGuard() {
  reduction_override = std::move(previous_);
}

namespace detail {

at::Tensor combine_losses(std::vector<at::Tensor> losses, const std::vector<int64_t>& counts,
                          int64_t total, LossReduction reduction, int64_t dim,
                          c10::Device destination) {
  if (reduction == LossReduction::None) {
    return autograd::gather(losses, destination, dim);
  }
  const bool weighted = reduction == LossReduction::Mean || reduction == LossReduction::BatchMean;
  at::Tensor result;
  for (const auto i : c10::irange(losses.size())) {
    auto loss = losses[i].to(destination);
    if (weighted) {
      loss = loss * (static_cast<double>(counts[i]) / static_cast<double>(total));
    }
    result = result.defined() ? result + loss : loss;
  }
  return result;
}

} // namespace detail

} // namespace torchdp
