#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

/// NCCL transport for comm.cpp. Compiled only when TORCHDP_WITH_NCCL is 1.
///
/// Communicators are created once per ordered set of distinct CUDA devices (ncclCommInitAll) and
/// kept for the life of the process: destroying them at static-destruction time can hang in the
/// driver. Collectives run on each device's current stream, so they are ordered with the compute
/// that produced their inputs and the compute that reads their outputs.
namespace torchdp::nccl {

/// True when NCCL can serve this device list: at least two devices, all CUDA, none listed twice,
/// and the environment variable TORCHDP_DISABLE_NCCL is unset or 0.
bool usable(const std::vector<c10::Device>& devices);

/// True when `ncclReduce` supports this dtype.
bool reduce_supports(at::ScalarType dtype);

/// Broadcasts every contiguous sources[k] (on devices[0]) into destinations[j][k] (preallocated,
/// contiguous, same number of bytes, on devices[j]; destinations[0] is not used: the root sends in
/// place), all in one NCCL group, so no staging copy is made on the source device.
void broadcast_each(const std::vector<at::Tensor>& sources,
                    const std::vector<std::vector<at::Tensor>>& destinations,
                    const std::vector<c10::Device>& devices);

/// Sums the contiguous inputs[j] (on devices[j], same numel and dtype) into `output` on
/// devices[root].
void reduce(const std::vector<at::Tensor>& inputs, at::Tensor& output, size_t root,
            const std::vector<c10::Device>& devices);

} // namespace torchdp::nccl
