#include "test_common.h"

#include <torchdp/devices.h>

#include <string>
#include <vector>

using torchdp_test::cpu_devices;

namespace {
constexpr const char* kApi = "torchdp_test::api";
} // namespace

TEST_CASE("normalize_device drops the index of cpu and meta devices", "[cpu][devices]") {
  const auto spec = GENERATE(as<std::string>{}, "cpu", "cpu:0", "meta", "meta:0");
  const torch::Device input(spec);
  const auto out = torchdp::normalize_device(input, kApi);
  INFO("input " << input);
  CHECK(out.type() == input.type());
  CHECK_FALSE(out.has_index());
  CHECK(out == torch::Device(input.type()));
  CHECK(out.str() == (input.is_cpu() ? "cpu" : "meta"));
}

TEST_CASE("detail::canonical drops the index of cpu and meta only", "[cpu][devices]") {
  CHECK(torchdp::detail::canonical(torch::Device("cpu:0")) == torch::Device(torch::kCPU));
  CHECK(torchdp::detail::canonical(torch::Device("meta:0")) == torch::Device(torch::kMeta));
  // A CUDA device keeps its index; constructing one needs no GPU.
  CHECK(torchdp::detail::canonical(torch::Device("cuda:1")) == torch::Device("cuda:1"));
}

TEST_CASE("normalize_devices keeps duplicates and order", "[cpu][devices]") {
  const std::vector<torch::Device> in{torch::Device("cpu:0"), torch::Device(torch::kCPU),
                                      torch::Device("cpu:0")};
  const auto out = torchdp::normalize_devices(in, kApi);
  REQUIRE(out.size() == 3);
  for (const auto& d : out) {
    CHECK(d == torch::Device(torch::kCPU));
  }

  const auto mixed =
      torchdp::normalize_devices({torch::Device("meta:0"), torch::Device("cpu:0")}, kApi);
  REQUIRE(mixed.size() == 2);
  CHECK(mixed[0] == torch::Device(torch::kMeta));
  CHECK(mixed[1] == torch::Device(torch::kCPU));

  CHECK(torchdp::normalize_devices(cpu_devices(5), kApi).size() == 5);
}

TEST_CASE("normalize_devices rejects an empty list and names the API", "[cpu][devices]") {
  TORCHDP_CHECK_THROWS_WITH(torchdp::normalize_devices({}, "torchdp::my_api"), "torchdp::my_api",
                            "empty device list");
}

TEST_CASE("unsupported device types are rejected with the API and device named", "[cpu][devices]") {
  const auto device = GENERATE(torch::Device("xpu"), torch::Device(torch::kMPS),
                               torch::Device("xpu:1"), torch::Device(torch::kHIP));
  const std::string name = device.str();
  INFO("device " << name);
  TORCHDP_CHECK_THROWS_WITH(torchdp::normalize_device(device, "torchdp::my_api"), "torchdp::my_api",
                            "(device " + name + ")", "not supported", "cuda", "cpu", "meta");
  // Inside a list as well, after valid entries.
  TORCHDP_CHECK_THROWS_WITH(
      torchdp::normalize_devices({torch::Device(torch::kCPU), device}, "torchdp::list_api"),
      "torchdp::list_api", "(device " + name + ")", "not supported");
}

TEST_CASE("CUDA devices without CUDA give a clear error", "[cpu][devices]") {
  const auto count = torchdp::cuda_device_count();
  CHECK(count >= 0);
  if (count == 0) {
    CHECK_FALSE(torchdp::has_cuda());
    const auto device =
        GENERATE(torch::Device("cuda:0"), torch::Device("cuda"), torch::Device("cuda:3"));
    const std::string name = device.str();
    INFO("device " << name);
    TORCHDP_CHECK_THROWS_WITH(torchdp::normalize_device(device, "torchdp::my_api"),
                              "torchdp::my_api", "device " + name, "no CUDA device is visible",
                              "Use CPU devices");
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::normalize_devices({torch::Device(torch::kCPU), device}, "torchdp::list_api"),
        "torchdp::list_api", "no CUDA device is visible");
  } else {
    // An index past the visible devices is named together with the visible range.
    const torch::Device missing(torch::kCUDA, static_cast<c10::DeviceIndex>(count));
    TORCHDP_CHECK_THROWS_WITH(torchdp::normalize_device(missing, "torchdp::my_api"),
                              "torchdp::my_api", "device " + missing.str(), "does not exist",
                              "only " + std::to_string(count) + " CUDA device(s)");
    CHECK(torchdp::normalize_device(torch::Device("cuda:0"), kApi) == torch::Device("cuda:0"));
    const auto current = torchdp::normalize_device(torch::Device(torch::kCUDA), kApi);
    CHECK(current.is_cuda());
    CHECK(current.has_index());
  }
}

TEST_CASE("default_devices lists the visible CUDA devices or fails naming the API",
          "[cpu][devices]") {
  const auto count = torchdp::cuda_device_count();
  if (count == 0) {
    TORCHDP_CHECK_THROWS_WITH(torchdp::default_devices("torchdp::my_api"), "torchdp::my_api",
                              "no device list was given", "no CUDA device is visible",
                              "torch::kCPU");
  } else {
    const auto devices = torchdp::default_devices("torchdp::my_api");
    REQUIRE(static_cast<int64_t>(devices.size()) == count);
    for (size_t i = 0; i < devices.size(); ++i) {
      CHECK(devices[i] == torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(i)));
    }
  }
}

TEST_CASE("devices_to_string formats a list", "[cpu][devices]") {
  struct Case {
    std::vector<torch::Device> devices;
    std::string expected;
  };
  const auto c = GENERATE(values<Case>({
      {{}, "[]"},
      {{torch::Device(torch::kCPU)}, "[cpu]"},
      {{torch::Device("cuda:0"), torch::Device("cuda:1")}, "[cuda:0, cuda:1]"},
      {{torch::Device(torch::kCPU), torch::Device(torch::kMeta), torch::Device(torch::kCPU)},
       "[cpu, meta, cpu]"},
  }));
  CHECK(torchdp::devices_to_string(c.devices) == c.expected);
}
