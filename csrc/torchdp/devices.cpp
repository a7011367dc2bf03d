#include <torchdp/config.h>
#include <torchdp/devices.h>

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace torchdp {

int64_t cuda_device_count() {
  if (!at::detail::getCUDAHooks().hasCUDA()) {
    return 0;
  }
  return at::detail::getCUDAHooks().deviceCount();
}

bool has_cuda() {
  return TORCHDP_WITH_CUDA && cuda_device_count() > 0;
}

bool has_nccl() {
  return TORCHDP_WITH_NCCL != 0;
}

std::vector<c10::Device> default_devices(const char* api) {
  const auto count = cuda_device_count();
  TORCH_CHECK(count > 0, api,
              ": no device list was given and no CUDA device is visible. Pass an explicit "
              "device list, for example {torch::kCPU, torch::kCPU}, to run on the CPU");
  std::vector<c10::Device> devices;
  devices.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
  }
  return devices;
}

namespace detail {
c10::Device canonical(c10::Device device) {
  if (device.is_cpu() || device.is_meta()) {
    return c10::Device(device.type());
  }
  return device;
}
} // namespace detail

c10::Device normalize_device(c10::Device device, const char* api) {
  switch (device.type()) {
    case c10::DeviceType::CPU:
    case c10::DeviceType::Meta:
      return c10::Device(device.type());
    case c10::DeviceType::CUDA: {
      const auto count = cuda_device_count();
      TORCH_CHECK(count > 0, api, ": device ", device,
                  " was requested but no CUDA device is visible (torchdp has_cuda() is false). "
                  "Use CPU devices, or run where CUDA devices are visible");
      if (!device.has_index()) {
        const auto current = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice();
        return c10::Device(c10::kCUDA, current.index());
      }
      TORCH_CHECK(device.index() >= 0 && device.index() < count, api, ": device ", device,
                  " does not exist: only ", count,
                  " CUDA device(s) are visible (cuda:0 to cuda:", count - 1,
                  "). Check device_ids and CUDA_VISIBLE_DEVICES");
      return device;
    }
    default:
      TORCH_CHECK(false, api, ": device type ", device.type(), " (device ", device,
                  ") is not supported; torchdp runs on cuda, cpu and meta devices");
  }
}

std::vector<c10::Device> normalize_devices(const std::vector<c10::Device>& devices,
                                           const char* api) {
  TORCH_CHECK(!devices.empty(), api,
              ": expected at least one device, got an empty device list. Pass the devices to "
              "use, for example {torch::Device(\"cuda:0\"), torch::Device(\"cuda:1\")}");
  std::vector<c10::Device> out;
  out.reserve(devices.size());
  for (const auto& d : devices) {
    out.push_back(normalize_device(d, api));
  }
  return out;
}

void check_output_device(const std::vector<c10::Device>& devices, c10::Device output,
                         const char* api) {
  if (!output.is_meta() || devices.size() < 2) {
    return; // one device: nothing is gathered to output_device
  }
  for (const auto& d : devices) {
    if (d.is_meta()) {
      return; // a list with meta replicas computes no values anyway
    }
  }
  TORCH_CHECK_VALUE(false, api, ": output_device meta holds no data, so with devices ",
                    devices_to_string(devices),
                    " the outputs' gradients could not flow back to the replicas; pass an output "
                    "device of the list (for example ",
                    devices.front(), "), or meta devices");
}

std::string devices_to_string(const std::vector<c10::Device>& devices) {
  // c10::str, not "[" + std::string: GCC 12 and 13 warn -Wrestrict on that inlined concatenation.
  return c10::str("[", c10::Join(", ", devices), "]");
}

} // namespace torchdp
