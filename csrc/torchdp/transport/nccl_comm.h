#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

/// NCCL transport for comm.cpp (only when TORCHDP_WITH_NCCL is 1). Communicators, one set per
/// device list, are never destroyed: that can hang in the driver at exit. Collectives run on each
/// device's current stream, ordered with the compute around them.
namespace torchdp::nccl {

/// True when NCCL can serve this device list: at least two devices, all CUDA, none listed twice,
/// and the environment variable TORCHDP_DISABLE_NCCL is unset or 0.
bool usable(const std::vector<c10::Device>& devices);

/// True when `ncclReduce` supports this dtype.
bool reduce_supports(at::ScalarType dtype);

/// Broadcasts each contiguous sources[k] on devices[0] into the preallocated contiguous
/// destinations[j][k] of the same byte size, in one NCCL group (destinations[0] is unused).
void broadcast_each(const std::vector<at::Tensor>& sources,
                    const std::vector<std::vector<at::Tensor>>& destinations,
                    const std::vector<c10::Device>& devices);

/// Sums the contiguous inputs[j] (on devices[j], same numel and dtype) into `output` on root.
void reduce(const std::vector<at::Tensor>& inputs, at::Tensor& output, size_t root,
            const std::vector<c10::Device>& devices);

} // namespace torchdp::nccl
