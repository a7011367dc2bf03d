#pragma once

#include <c10/core/Device.h>

#include <string>
#include <vector>

namespace torchdp {

/// True when torchdp was compiled with its CUDA fast paths and CUDA devices are visible.
bool has_cuda();
/// True when torchdp was compiled with its NCCL transport.
bool has_nccl();
/// The number of visible CUDA devices (0 on CPU-only builds or machines).
int64_t cuda_device_count();

/// All visible CUDA devices in index order, as `torch::nn::parallel::data_parallel` uses them when
/// no device list is given. Throws a c10::Error naming `api` when there is no CUDA device.
std::vector<c10::Device> default_devices(const char* api);

/// Normalises one device for `api`: `cpu:0` and `meta:0` become `cpu` and `meta`, `cuda` without an
/// index becomes the current CUDA device. Unsupported device types and CUDA indices that are not
/// visible raise a c10::Error that names `api`, the device and the fix.
c10::Device normalize_device(c10::Device device, const char* api);

/// Normalises every device of a list (see normalize_device) and rejects an empty list. A device may
/// appear more than once, as in PyTorch: `[cpu, cpu, cpu]` gives three replicas on the CPU.
std::vector<c10::Device> normalize_devices(const std::vector<c10::Device>& devices,
                                           const char* api);

/// Refuses an output device that the outputs can reach but their gradients cannot come back from:
/// `meta` (no data) when the list has several devices and none of them is meta (one device
/// gathers nothing; meta replicas compute no values anyway). Raises a c10::ValueError naming
/// `api`.
void check_output_device(const std::vector<c10::Device>& devices, c10::Device output,
                         const char* api);

/// "[cuda:0, cuda:1]": for error messages.
std::string devices_to_string(const std::vector<c10::Device>& devices);

namespace detail {
/// The device a tensor reports, normalised the way normalize_device normalises (cpu and meta lose
/// their index).
c10::Device canonical(c10::Device device);
} // namespace detail

} // namespace torchdp
