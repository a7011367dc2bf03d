#pragma once

#include <torchdp/comm.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <vector>

/// Differentiable versions of the comm layer, as C++ autograd nodes, so gradients flow from
/// replicas back to the original tensors whichever language drives the forward:
///
/// | forward                 | backward                                   |
/// |-------------------------|--------------------------------------------|
/// | broadcast_coalesced     | reduce_add_coalesced of the gradients      |
/// | reduce_add_coalesced    | broadcast_coalesced of the gradient        |
/// | scatter                 | gather of the gradients to the input       |
/// | gather                  | scatter of the gradient to the inputs      |
///
/// Each backward is built from the differentiable forward of its partner, so double backward
/// (gradient penalties) works. Undefined incoming gradients count as zeros. Outputs record history
/// only when grad mode is on and their input requires grad.
namespace torchdp::autograd {

/// Default size of the gradient buckets of broadcast_coalesced's backward (25 MiB, as
/// DistributedDataParallel).
constexpr size_t kDefaultGradBucketSize = 25 * 1024 * 1024;

/// The gradient bucket size that differentiable broadcasts made on this thread use: the innermost
/// active GradBucketSizeGuard's, else kDefaultGradBucketSize.
size_t grad_bucket_size();

/// Sets the gradient bucket size (bytes; 0: one bucket) of differentiable broadcasts made on this
/// thread while it lives (DataParallelOptions::bucket_cap_mb and Python's bucket_cap_mb use it).
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

/// Differentiable comm::broadcast_coalesced. Outputs for devices[0] share storage and version
/// counter with the inputs, but are distinct tensors that carry the broadcast's history. The
/// backward reduce-adds the gradients of all devices in buckets taken from the end of `tensors`,
/// each as soon as its gradients exist (overlapping the rest of the backward pass), on a side
/// stream per CUDA device.
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

/// Differentiable comm::gather. When every input is 0-dim and dim is 0, each is viewed as a
/// one-element vector and the result is a vector with one entry per input, with a warning, as
/// torch.nn.parallel's Gather does.
at::Tensor gather(at::TensorList inputs, c10::Device destination, int64_t dim = 0);

} // namespace torchdp::autograd
