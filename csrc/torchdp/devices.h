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

/// All visible CUDA devices in index order (PyTorch's default list); throws naming `api` if none.
std::vector<c10::Device> default_devices(const char* api);

/// Normalises one device for `api`: `cpu:0` and `meta:0` lose their index, `cuda` gets the current
/// device. Unsupported types and invisible CUDA indices raise a c10::Error naming `api`.
c10::Device normalize_device(c10::Device device, const char* api);

/// Normalises every device of a list (see normalize_device) and rejects an empty list. A device may
/// appear more than once, as in PyTorch: `[cpu, cpu, cpu]` gives three replicas on the CPU.
std::vector<c10::Device> normalize_devices(const std::vector<c10::Device>& devices,
                                           const char* api);

/// Raises a c10::ValueError naming `api` for a `meta` output device of a list of several non-meta
/// devices, since gradients cannot come back from it.
void check_output_device(const std::vector<c10::Device>& devices, c10::Device output,
                         const char* api);

/// "[cuda:0, cuda:1]": for error messages.
std::string devices_to_string(const std::vector<c10::Device>& devices);

namespace detail {
/// A tensor's device normalised as by normalize_device (cpu and meta lose their index).
c10::Device canonical(c10::Device device);
} // namespace detail

} // namespace torchdp
