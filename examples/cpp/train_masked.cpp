// Trains a small regression model with torchdp::DataParallel and checks that the result matches
// training the same model on one device.
//
// The model has a masked layer (MaskedLinearImpl) that keeps an *unregistered* tensor, a float
// cache of its `mask` buffer, for use in forward. DataParallel refreshes the registered parameters
// and buffers of each replica in place, but it cannot know about such a cache: the copy constructor
// that clone() uses copies it by reference, so every replica would still read the original's
// cache, on the original's device. A post-replicate hook registered for MaskedLinearImpl recomputes
// the cache of every replica from the replica's own mask, so it lives on the replica's device.
//
// Usage:
//   torchdp_example_train_masked [--devices cpu,cpu,cpu | cuda:0,cuda:1] [--steps N] [--batch N]
// Default devices: every visible CUDA device, or two CPU replicas ({cpu, cpu}) without CUDA.
// Exit status: 0 when the weights match, 1 when they do not (or training failed), 2 on bad
// arguments.

#include <torchdp/torchdp.h>

#include <torch/nn.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

/// A linear layer whose weight is multiplied by a fixed 0/1 mask. `mask` is a registered buffer,
/// so it is moved by to() and broadcast to every replica by DataParallel. `cache_` is the float
/// copy of the mask that forward uses; it is not registered, so neither to() nor DataParallel
/// touch it: refresh_cache() must be called after the module moves, and on every replica (the
/// post-replicate hook in main() does that).
struct MaskedLinearImpl : torch::nn::Cloneable<MaskedLinearImpl> {
  MaskedLinearImpl(int64_t in_features, int64_t out_features)
      : in_features(in_features), out_features(out_features) {
    reset();
    refresh_cache();
  }

  void reset() override {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    weight = register_parameter("weight",
                                torch::empty({out_features, in_features}).uniform_(-bound, bound));
    bias = register_parameter("bias", torch::empty({out_features}).uniform_(-bound, bound));
    // Keeps about three connections in four. Drawn from the global generator, so two models built
    // after the same torch::manual_seed get the same mask.
    mask = register_buffer("mask", torch::rand({out_features, in_features}) < 0.75);
  }

  /// Recomputes the cache from this module's own mask, on the mask's device.
  void refresh_cache() {
    cache_ = mask.to(weight.scalar_type());
  }

  torch::Tensor forward(const torch::Tensor& x) {
    TORCH_CHECK(cache_.device() == weight.device(), "MaskedLinear: the mask cache is on ",
                cache_.device(), " but the weight is on ", weight.device(),
                "; call refresh_cache() after moving the module (DataParallel replicas get it from "
                "the post-replicate hook)");
    return torch::nn::functional::linear(x, weight * cache_, bias);
  }

  int64_t in_features;
  int64_t out_features;
  torch::Tensor weight, bias, mask;
  // Unregistered and derived from `mask`. The implicit copy constructor (used by clone(), and so by
  // DataParallel's replica skeletons) copies this handle, i.e. shares the original's tensor.
  torch::Tensor cache_;
};
TORCH_MODULE(MaskedLinear);

/// in -> hidden (tanh) -> masked hidden -> 1.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl(int64_t in_features, int64_t hidden) : in_features(in_features), hidden(hidden) {
    reset();
  }

  void reset() override {
    fc = register_module("fc", torch::nn::Linear(in_features, hidden));
    masked = register_module("masked", MaskedLinear(hidden, 1));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    return masked(torch::tanh(fc(x)));
  }

  int64_t in_features;
  int64_t hidden;
  torch::nn::Linear fc{nullptr};
  MaskedLinear masked{nullptr};
};
TORCH_MODULE(Net);

constexpr int64_t kInFeatures = 16;
constexpr int64_t kHidden = 32;
constexpr int64_t kSamples = 4096;
constexpr uint64_t kDataSeed = 1234;
constexpr uint64_t kModelSeed = 42;
constexpr double kLearningRate = 0.1;
constexpr double kRtol = 1e-4; // fp32 tolerances for the final weight comparison
constexpr double kAtol = 1e-5;

constexpr const char* kUsage =
    "usage: torchdp_example_train_masked [--devices LIST] [--steps N] [--batch N]\n"
    "  --devices LIST  comma-separated devices, e.g. cpu,cpu,cpu or cuda:0,cuda:1\n"
    "                  (default: every visible CUDA device, or cpu,cpu without CUDA)\n"
    "  --steps N       training steps (default 200)\n"
    "  --batch N       batch size (default 64)\n"
    "  -h, --help      show this message\n";

struct Args {
  std::vector<torch::Device> devices; // empty: the default
  int64_t steps = 200;
  int64_t batch = 64;
  bool help = false;
};

bool parse_positive(const std::string& text, int64_t& out) {
  if (text.empty() || text[0] == '-' || text[0] == '+') {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || value <= 0) {
    return false;
  }
  out = static_cast<int64_t>(value);
  return true;
}

bool parse_devices(const std::string& text, std::vector<torch::Device>& out, std::string& error) {
  out.clear();
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    if (item.empty()) {
      error = "empty entry in device list '" + text + "'";
      return false;
    }
    try {
      torch::Device device(item);
      if (!device.is_cpu() && !device.is_cuda()) {
        error = "unsupported device '" + item + "' (use cpu or cuda:N)";
        return false;
      }
      out.push_back(device);
    } catch (const c10::Error&) {
      error = "invalid device '" + item + "' (use cpu or cuda:N)";
      return false;
    }
    start = comma + 1;
  }
  return true;
}

/// Parses argv into `args`; on failure sets `error` and returns false.
bool parse_args(int argc, char** argv, Args& args, std::string& error) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      args.help = true;
      continue;
    }
    std::string value;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (arg == "--devices" || arg == "--steps" || arg == "--batch") {
      if (i + 1 >= argc) {
        error = "option " + arg + " needs a value";
        return false;
      }
      value = argv[++i];
    } else {
      error = "unknown argument '" + arg + "'";
      return false;
    }
    if (arg == "--devices") {
      if (!parse_devices(value, args.devices, error)) {
        return false;
      }
    } else if (arg == "--steps") {
      if (!parse_positive(value, args.steps)) {
        error = "--steps needs a positive integer, got '" + value + "'";
        return false;
      }
    } else if (arg == "--batch") {
      if (!parse_positive(value, args.batch)) {
        error = "--batch needs a positive integer, got '" + value + "'";
        return false;
      }
    } else {
      error = "unknown option '" + arg + "'";
      return false;
    }
  }
  return true;
}

int usage_error(const std::string& error) {
  std::fprintf(stderr, "error: %s\n%s", error.c_str(), kUsage);
  return 2;
}

int train(const std::vector<torch::Device>& devices, int64_t steps, int64_t batch) {
  const torch::Device device0 = devices.front();
  std::printf("torchdp example: masked regression on %s, %lld steps, batch %lld\n",
              torchdp::devices_to_string(devices).c_str(), static_cast<long long>(steps),
              static_cast<long long>(batch));

  // Synthetic regression data, generated on the CPU with a fixed seed: y = sin(2 x.w) + noise.
  torch::manual_seed(kDataSeed);
  const auto inputs = torch::randn({kSamples, kInFeatures});
  const auto teacher = torch::randn({kInFeatures, 1}) / std::sqrt(static_cast<double>(kInFeatures));
  const auto targets = torch::sin(2 * inputs.matmul(teacher)) + 0.05 * torch::randn({kSamples, 1});

  // Two identical models: same seed before each construction.
  torch::manual_seed(kModelSeed);
  Net dp_net(kInFeatures, kHidden);
  torch::manual_seed(kModelSeed);
  Net single_net(kInFeatures, kHidden);

  // Both start on devices[0] (DataParallel wants the wrapped module there). to() moves the mask
  // but not the unregistered cache, so refresh it on the moved modules.
  dp_net->to(device0);
  dp_net->masked->refresh_cache();
  single_net->to(device0);
  single_net->masked->refresh_cache();

  // Every replica of every MaskedLinearImpl recomputes its cache from its own (freshly broadcast)
  // mask. Without this hook, the replicas would share the original's cache on devices[0].
  std::atomic<int64_t> hook_calls{0};
  auto hook = torchdp::register_post_replicate_hook<MaskedLinearImpl>(
      [&hook_calls](MaskedLinearImpl& replica, const MaskedLinearImpl& /*original*/,
                    c10::Device device, int64_t /*replica_index*/,
                    torchdp::ReplicaContext& /*ctx*/) {
        replica.refresh_cache();
        TORCH_CHECK(replica.cache_.device() == device, "hook: replica cache on ",
                    replica.cache_.device(), ", expected ", device);
        hook_calls.fetch_add(1, std::memory_order_relaxed);
      });

  torchdp::DataParallel dp(dp_net, torchdp::DataParallelOptions().device_ids(devices));
  torch::optim::SGD dp_optimizer(dp->parameters(), torch::optim::SGDOptions(kLearningRate));
  torch::optim::SGD single_optimizer(single_net->parameters(),
                                     torch::optim::SGDOptions(kLearningRate));

  const int64_t report_every = std::max<int64_t>(1, steps / 10);
  const int width = static_cast<int>(std::to_string(steps).size());
  double first_loss[2] = {0, 0};
  double last_loss[2] = {0, 0};
  for (int64_t step = 1; step <= steps; ++step) {
    // The same batch for both models, cycling through the data set.
    const auto index = torch::arange((step - 1) * batch, step * batch, torch::kLong) % kSamples;
    const auto x = inputs.index_select(0, index).to(device0);
    const auto y = targets.index_select(0, index).to(device0);

    dp_optimizer.zero_grad();
    auto dp_loss = torch::nn::functional::mse_loss(dp->forward(x), y);
    dp_loss.backward();
    dp_optimizer.step();

    single_optimizer.zero_grad();
    auto single_loss = torch::nn::functional::mse_loss(single_net->forward(x), y);
    single_loss.backward();
    single_optimizer.step();

    const bool report = step % report_every == 0 || step == steps;
    if (step == 1 || report) {
      last_loss[0] = dp_loss.item<double>();
      last_loss[1] = single_loss.item<double>();
      if (step == 1) {
        first_loss[0] = last_loss[0];
        first_loss[1] = last_loss[1];
      }
    }
    if (report) {
      std::printf("step %*lld/%lld  loss %.4f  (dp) %.4f (single)\n", width,
                  static_cast<long long>(step), static_cast<long long>(steps), last_loss[0],
                  last_loss[1]);
    }
  }
  hook.remove();

  std::printf("trained %lld steps: loss %.4f -> %.4f (dp), %.4f -> %.4f (single)\n",
              static_cast<long long>(steps), first_loss[0], last_loss[0], first_loss[1],
              last_loss[1]);
  std::printf("post-replicate hook ran %lld times on %zu device(s)%s\n",
              static_cast<long long>(hook_calls.load()), devices.size(),
              devices.size() == 1 ? " (one device: DataParallel calls the module directly)" : "");

  // The check: DataParallel must have trained the same weights as the single-device model.
  torch::NoGradGuard no_grad;
  const auto dp_params = dp_net->named_parameters();
  const auto single_params = single_net->named_parameters();
  bool ok = dp_params.size() == single_params.size();
  if (!ok) {
    std::printf("FAIL: the models have %zu and %zu parameters\n", dp_params.size(),
                single_params.size());
  }
  double max_diff = 0;
  for (const auto& item : single_params) {
    const auto* dp_param = dp_params.find(item.key());
    if (dp_param == nullptr) {
      std::printf("FAIL: parameter '%s' is missing from the DataParallel model\n",
                  item.key().c_str());
      ok = false;
      continue;
    }
    const auto a = dp_param->to(torch::kCPU);
    const auto b = item.value().to(torch::kCPU);
    const double diff = (a - b).abs().max().item<double>();
    max_diff = std::isnan(diff) ? diff : std::max(max_diff, diff);
    if (!torch::allclose(a, b, kRtol, kAtol)) {
      std::printf("FAIL: parameter '%s' differs (max abs diff %.3g, rtol %g, atol %g)\n",
                  item.key().c_str(), diff, kRtol, kAtol);
      ok = false;
    }
  }
  if (devices.size() > 1 && hook_calls.load() == 0) {
    std::printf("FAIL: the post-replicate hook never ran on %zu devices\n", devices.size());
    ok = false;
  }
  if (!ok) {
    std::printf(
        "FAIL: DataParallel weights do not match single-device training (max abs diff "
        "%.3g)\n",
        max_diff);
    return 1;
  }
  std::printf("OK: DataParallel weights match single-device training (max abs diff %.3g)\n",
              max_diff);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  Args args;
  std::string error;
  if (!parse_args(argc, argv, args, error)) {
    return usage_error(error);
  }
  if (args.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }

  std::vector<torch::Device> devices = args.devices;
  if (devices.empty()) {
    const int64_t n = torchdp::cuda_device_count();
    if (n >= 1) {
      for (int64_t i = 0; i < n; ++i) {
        devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
      }
    } else {
      devices = {torch::Device(torch::kCPU), torch::Device(torch::kCPU)};
    }
  }
  // Validates the list the way DataParallel will (CUDA indices must be visible, ...), so that a
  // bad --devices is reported as a usage error.
  try {
    devices = torchdp::normalize_devices(devices, "torchdp_example_train_masked");
  } catch (const c10::Error& e) {
    return usage_error(e.what_without_backtrace());
  }

  try {
    return train(devices, args.steps, args.batch);
  } catch (const c10::Error& e) {
    std::printf("FAIL: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
  }
  return 1;
}
