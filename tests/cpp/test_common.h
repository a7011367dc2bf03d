#pragma once

#include "catch_shim.h"

#include <torch/torch.h>
#include <torchdp/torchdp.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace torchdp_test {

/// `n` CPU devices: the full machinery runs on one host with them.
inline std::vector<torch::Device> cpu_devices(size_t n) {
  return std::vector<torch::Device>(n, torch::Device(torch::kCPU));
}

/// True when TORCHDP_REQUIRE_CUDA=1: a GPU run must not skip its CUDA cases.
inline bool cuda_required() {
  const char* v = std::getenv("TORCHDP_REQUIRE_CUDA");
  return v != nullptr && std::string(v) == "1";
}

/// The first `n` CUDA devices, or an empty list when fewer are visible (the caller skips, or fails
/// when TORCHDP_REQUIRE_CUDA=1).
inline std::vector<torch::Device> cuda_devices(size_t n) {
  std::vector<torch::Device> out;
  if (!torchdp::has_cuda() || torchdp::cuda_device_count() < static_cast<int64_t>(n)) {
    return out;
  }
  for (size_t i = 0; i < n; ++i) {
    out.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
  }
  return out;
}

#define TORCHDP_NEED_CUDA(devices, n)                                                       \
  auto devices = ::torchdp_test::cuda_devices(n);                                           \
  if (devices.empty()) {                                                                    \
    if (::torchdp_test::cuda_required()) {                                                  \
      FAIL("TORCHDP_REQUIRE_CUDA=1 but fewer than " << (n) << " CUDA devices are visible"); \
    }                                                                                       \
    TORCHDP_SKIP("needs " << (n) << " CUDA device(s)");                                     \
  }

/// Copies every parameter and buffer of `src` into `dst` (same structure).
inline void copy_state(torch::nn::Module& dst, const torch::nn::Module& src) {
  torch::NoGradGuard no_grad;
  auto sp = src.named_parameters();
  for (auto& p : dst.named_parameters()) {
    p.value().copy_(sp[p.key()]);
  }
  auto sb = src.named_buffers();
  for (auto& b : dst.named_buffers()) {
    b.value().copy_(sb[b.key()]);
  }
}

/// True when `fn` throws a c10::Error whose message contains every one of `parts`.
template <typename Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

/// Sets the environment variable `name` to `value` for a scope (unset afterwards).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

#define TORCHDP_CHECK_THROWS_WITH(expr, ...)                                 \
  do {                                                                       \
    const std::string _msg = ::torchdp_test::error_message([&] {             \
      expr;                                                                  \
    });                                                                      \
    for (const std::string& _part : std::vector<std::string>{__VA_ARGS__}) { \
      INFO("message: " << _msg);                                             \
      CHECK(_msg.find(_part) != std::string::npos);                          \
    }                                                                        \
  } while (0)

/// A linear layer with a registered `mask` buffer and an unregistered member derived from it
/// (`cache_`, the float mask used by forward). The copy constructor that clone() uses copies
/// `cache_` by reference, so without a post-replicate hook every replica uses the original's cache,
/// which lives on the original's device.
struct MaskedLinearImpl : torch::nn::Cloneable<MaskedLinearImpl> {
  MaskedLinearImpl(int64_t in, int64_t out) : in_(in), out_(out) {
    reset();
    refresh_cache();
  }
  void reset() override {
    weight = register_parameter("weight", torch::randn({out_, in_}) * 0.3);
    bias = register_parameter("bias", torch::randn({out_}) * 0.1);
    mask = register_buffer("mask", (torch::arange(out_ * in_) % 3 != 0).reshape({out_, in_}));
  }
  /// Recomputes the cache from this module's own mask, on the mask's device.
  void refresh_cache() {
    cache_ = mask.to(weight.scalar_type());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::nn::functional::linear(x, weight * cache_, bias);
  }
  int64_t in_, out_;
  torch::Tensor weight, bias, mask, cache_;
};
TORCH_MODULE(MaskedLinear);

/// Masked layer inside a small net, so hooks must find it below the root.
struct MaskedNetImpl : torch::nn::Cloneable<MaskedNetImpl> {
  MaskedNetImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    masked = register_module("masked", MaskedLinear(8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return masked(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr};
  MaskedLinear masked{nullptr};
};
TORCH_MODULE(MaskedNet);

/// Conv + BatchNorm + Linear: buffers updated in place during training.
struct ConvBnNetImpl : torch::nn::Cloneable<ConvBnNetImpl> {
  ConvBnNetImpl() {
    reset();
  }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    fc = register_module("fc", torch::nn::Linear(4 * 5 * 5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn(conv(x)));
    return fc(h.flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvBnNet);

/// Two positions share one Linear (registered twice) and a tied parameter.
struct SharedNetImpl : torch::nn::Cloneable<SharedNetImpl> {
  SharedNetImpl() {
    reset();
  }
  void reset() override {
    a = register_module("a", torch::nn::Linear(5, 5));
    b = register_module("b", a); // the same module at a second position
    scale = register_parameter("scale", torch::ones({5}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return b(a(x)) * scale;
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(SharedNet);

/// A module that is not Cloneable.
struct PlainImpl : torch::nn::Module {
  PlainImpl() {
    w = register_parameter("w", torch::ones({2, 2}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x.matmul(w);
  }
  torch::Tensor w;
};
TORCH_MODULE(Plain);

/// Throws from forward in one replica (the one whose input's first element is negative).
struct ThrowingImpl : torch::nn::Cloneable<ThrowingImpl> {
  ThrowingImpl() {
    reset();
  }
  void reset() override {
    w = register_parameter("w", torch::ones({1}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (x.select(0, 0).sum().item<double>() < 0) {
      throw c10::ValueError({__func__, __FILE__, __LINE__}, "Badness!");
    }
    return x * w;
  }
  torch::Tensor w;
};
TORCH_MODULE(Throwing);

} // namespace torchdp_test
