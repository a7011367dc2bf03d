#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <optional>
#include <vector>

/// Tensor transport between cuda, cpu and meta devices, without autograd (see autograd.h): NCCL
/// where compiled in (transport/nccl_comm.h), else copies on each device's current stream.
namespace torchdp::comm {

/// Bucket size of the coalesced operations, as in torch.cuda.comm (10 MiB).
constexpr size_t kDefaultBufferSize = 10 * 1024 * 1024;

/// Copies `tensors` (all on devices[0]) to every device. result[0] holds the inputs themselves (as
/// in PyTorch); other copies have their own storage and version counter. Dense tensors travel in
/// buckets of at most `buffer_size` bytes per dtype, sparse ones one by one.
std::vector<std::vector<at::Tensor>> broadcast_coalesced(at::TensorList tensors,
                                                         const std::vector<c10::Device>& devices,
                                                         size_t buffer_size = kDefaultBufferSize);

/// Sums `per_device[j][k]` over j into one tensor per k on `destination`. The lists must match in
/// length, sizes and dtypes, each on one device. The results never share an input's storage.
std::vector<at::Tensor> reduce_add_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                             c10::Device destination,
                                             size_t buffer_size = kDefaultBufferSize);

/// Splits `tensor` along `dim`, chunk i on devices[i]; without `chunk_sizes` as tensor.chunk(),
/// which can give fewer chunks than devices. A chunk already on its device is a view of the input.
std::vector<at::Tensor> scatter(
    const at::Tensor& tensor, const std::vector<c10::Device>& devices,
    const std::optional<std::vector<int64_t>>& chunk_sizes = std::nullopt, int64_t dim = 0);

/// Concatenates `tensors` along `dim` on `destination`. All dimensions but `dim` must agree, unless
/// `pad_value` is given: then tensors that differ in another dimension (generated sequences of
/// different lengths) are padded at its end with `pad_value` to the largest size. The number of
/// dimensions must agree either way, and `pad_value` must fit the tensors' dtype.
at::Tensor gather(at::TensorList tensors, c10::Device destination, int64_t dim = 0,
                  const std::optional<at::Scalar>& pad_value = std::nullopt);

} // namespace torchdp::comm
