#pragma once

#include <torchdp/comm.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <vector>

/// Differentiable comm operations as C++ autograd nodes; each backward is its partner's
/// differentiable forward, so double backward works. Undefined gradients count as zeros; outputs
/// record history only when grad mode is on and an input requires grad.
namespace torchdp::autograd {

/// Default gradient bucket size of broadcast_coalesced's backward (25 MiB, as in DDP).
constexpr size_t kDefaultGradBucketSize = 25 * 1024 * 1024;

/// This thread's gradient bucket size: the innermost GradBucketSizeGuard's, else the default.
size_t grad_bucket_size();

/// Sets this thread's gradient bucket size (bytes; 0: one bucket) while it lives.
class GradBucketSizeGuard {
 public:
  explicit GradBucketSizeGuard(size_t bytes);
  ~GradBucketSizeGuard();
  GradBucketSizeGuard(const GradBucketSizeGuard&) = delete;
  GradBucketSizeGuard& operator=(const GradBucketSizeGuard&) = delete;

 private:
  std::optional<size_t> previous_;
};

/// Bytes of a bucket size given in MiB (as DDP's bucket_cap_mb), checked: finite and >= 0.
size_t bucket_bytes_from_mib(double mib, const char* api);

/// Differentiable comm::broadcast_coalesced; outputs for devices[0] alias the inputs but carry the
/// broadcast's history. Gradients reduce in buckets: Note [Gradient buckets and reduction streams].
std::vector<std::vector<at::Tensor>> broadcast_coalesced(
    at::TensorList tensors, const std::vector<c10::Device>& devices,
    size_t buffer_size = comm::kDefaultBufferSize);

/// Differentiable comm::reduce_add_coalesced.
std::vector<at::Tensor> reduce_add_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                             c10::Device destination,
                                             size_t buffer_size = comm::kDefaultBufferSize);

/// Differentiable comm::scatter (may return fewer chunks than devices).
std::vector<at::Tensor> scatter(
    const at::Tensor& input, const std::vector<c10::Device>& devices,
    const std::optional<std::vector<int64_t>>& chunk_sizes = std::nullopt, int64_t dim = 0);

/// Differentiable comm::gather. 0-dim inputs with dim 0 are gathered into a vector, with a
/// warning, as torch.nn.parallel's Gather does. With `pad_value`, inputs that differ in other
/// dimensions are padded at their end to the largest size (comm::gather); padded positions get no
/// gradient.
at::Tensor gather(at::TensorList inputs, c10::Device destination, int64_t dim = 0,
                  const std::optional<at::Scalar>& pad_value = std::nullopt);

} // namespace torchdp::autograd
