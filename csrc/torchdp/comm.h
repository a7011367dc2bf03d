#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <optional>
#include <vector>

/// Tensor transport between devices, without autograd (see autograd.h for the differentiable
/// versions). Every function works on any device list torchdp supports (cuda, cpu, meta); on CUDA
/// devices the NCCL transport is used when torchdp was compiled with it (see transport/nccl_comm.h),
/// otherwise peer copies on each device's current stream.
namespace torchdp::comm {

/// Bucket size of the coalesced operations, as in torch.cuda.comm (10 MiB).
constexpr size_t kDefaultBufferSize = 10 * 1024 * 1024;

/// Copies `tensors` (all on devices[0]) to every device of `devices`. The result has one list per
/// device; result[0] holds the input tensors themselves (as in PyTorch), every other copy has its
/// own storage and its own version counter. Dense tensors travel in flat buckets of at most
/// `buffer_size` bytes per dtype; sparse tensors travel one by one.
std::vector<std::vector<at::Tensor>> broadcast_coalesced(at::TensorList tensors,
                                                         const std::vector<c10::Device>& devices,
                                                         size_t buffer_size = kDefaultBufferSize);

/// Sums `per_device[j][k]` over j into one tensor per k on `destination`. Every per-device list
/// must have the same length, the k-th tensors the same size and dtype, and each list must live on
/// one device. The results have their own storage (never an input's).
std::vector<at::Tensor> reduce_add_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                             c10::Device destination,
                                             size_t buffer_size = kDefaultBufferSize);

/// Splits `tensor` along `dim` and puts chunk i on devices[i]. Without `chunk_sizes` the split is
/// `tensor.chunk(devices.size(), dim)`, which can give fewer chunks than devices (a batch of 5 on 4
/// devices gives 3 chunks). A chunk already on its target device is a view of the input.
std::vector<at::Tensor> scatter(
    const at::Tensor& tensor, const std::vector<c10::Device>& devices,
    const std::optional<std::vector<int64_t>>& chunk_sizes = std::nullopt, int64_t dim = 0);

/// Concatenates `tensors` along `dim` on `destination`. All dimensions but `dim` must agree.
at::Tensor gather(at::TensorList tensors, c10::Device destination, int64_t dim = 0);

} // namespace torchdp::comm
