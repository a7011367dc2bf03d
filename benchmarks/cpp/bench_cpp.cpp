// C++ benchmark of torchdp against LibTorch's own data parallelism: full training steps (zero_grad,
// forward, loss = out.pow(2).mean(), backward, SGD step) of cpp_mlp200 (200 x Linear(256,256)+ReLU,
// batch 512) and cpp_convnet (8 Conv2d(3x3)+BatchNorm2d+ReLU blocks in VGG-11's plan with max
// pooling, global average pool, Linear(512,10), batch 256 of 64x64 images), in the modes single,
// single_shard (batch / n on one device: the bound of n devices without communication, as
// ideal_speedup_vs_single), libtorch_dp (torch::nn::parallel::data_parallel), torchdp
// (torchdp::DataParallel), torchdp_functional (torchdp::data_parallel), and on GPUs single_graphs
// and torchdp_graphs (cuda_graphs on the first device, and on all). Writes a JSON results file in
// the format of benchmarks/common.py.
//
//   torchdp_bench_cpp --out PATH [--smoke] [--steps N] [--warmup N] [--models LIST]
//                     [--device-ids LIST]
// --smoke: tiny models on two CPU replicas, 1 warm-up and 2 steps, no LibTorch data_parallel (its
// Scatter needs CUDA). Otherwise every visible GPU (--device-ids 0,0: two replicas on one GPU).
// LibTorch's data_parallel deep-clones the module at every call, so it runs at most 5 steps. A
// failing configuration is recorded with an "error". Exit status 2 on bad arguments.

#include <torchdp/config.h>
#include <torchdp/torchdp.h>

#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>
#include <torch/version.h>
// LibTorch's data_parallel and replicate: the header includes CUDA headers, so only CUDA builds
// have them; without it the LibTorch configurations are recorded as skipped.
#ifndef TORCHDP_BENCH_LIBTORCH_DP
#define TORCHDP_BENCH_LIBTORCH_DP TORCHDP_WITH_CUDA
#endif
#if TORCHDP_BENCH_LIBTORCH_DP
#include <torch/nn/parallel/data_parallel.h>
#endif
#if TORCHDP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using Devices = std::vector<torch::Device>;
using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

/// `layers` x (Linear(width, width), ReLU) in a Sequential; Cloneable, as LibTorch's replicate
/// and torchdp need. (A bare Sequential cannot be held by DataParallel: its forward is a template.)
struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl(int64_t layers, int64_t width) : layers(layers), width(width) {
    reset();
  }
  void reset() override {
    body = register_module("body", torch::nn::Sequential());
    for (int64_t i = 0; i < layers; ++i) {
      body->push_back(torch::nn::Linear(width, width));
      body->push_back(torch::nn::ReLU());
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return body->forward(x);
  }
  int64_t layers;
  int64_t width;
  torch::nn::Sequential body{nullptr};
};
TORCH_MODULE(Mlp);

/// A VGG-style stack from a plan: each positive entry c is a block Conv2d(3x3, padding 1) to c
/// channels, BatchNorm2d(c), ReLU; each kPool entry a MaxPool2d(2); then global average pool and
/// Linear(last channels, classes).
struct ConvNetImpl : torch::nn::Cloneable<ConvNetImpl> {
  static constexpr int64_t kPool = -1;
  ConvNetImpl(std::vector<int64_t> plan, int64_t classes)
      : plan(std::move(plan)), classes(classes) {
    reset();
  }
  void reset() override {
    features = register_module("features", torch::nn::Sequential());
    int64_t in = 3;
    for (const int64_t c : plan) {
      if (c == kPool) {
        features->push_back(torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
        continue;
      }
      features->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, c, 3).padding(1)));
      features->push_back(torch::nn::BatchNorm2d(c));
      features->push_back(torch::nn::ReLU());
      in = c;
    }
    head = register_module("head", torch::nn::Linear(in, classes));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head->forward(features->forward(x).mean({2, 3}));
  }
  std::vector<int64_t> plan;
  int64_t classes;
  torch::nn::Sequential features{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ConvNet);

std::string quote(const std::string& s) {
  std::string o = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
    }
    if (c < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
      o += escaped;
    } else {
      o += static_cast<char>(c);
    }
  }
  return o + "\"";
}

std::string number(std::optional<double> v) {
  if (!v || !std::isfinite(*v)) {
    return "null";
  }
  std::ostringstream o;
  o << std::setprecision(10) << *v;
  return o.str();
}

std::string json_list(const std::vector<double>& values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    s += (i ? ", " : "") + number(values[i]);
  }
  return s + "]";
}

/// One record: its fields' JSON values.
struct Record {
  std::map<std::string, std::string> fields;

  Record& set(const std::string& key, std::string json) {
    fields[key] = std::move(json);
    return *this;
  }
  Record& str(const std::string& key, const std::string& value) {
    return set(key, quote(value));
  }
  Record& num(const std::string& key, std::optional<double> value) {
    return set(key, number(value));
  }
  /// The field's JSON ("" when missing), or its text without quotes.
  std::string get(const std::string& key, bool unquote = false) const {
    const auto f = fields.find(key);
    const std::string v = f == fields.end() ? "" : f->second;
    return unquote && v.size() >= 2 && v.front() == '"' ? v.substr(1, v.size() - 2) : v;
  }
  std::optional<double> value(const std::string& key) const {
    const auto v = get(key);
    return v.empty() || v == "null" ? std::nullopt : std::optional<double>(std::stod(v));
  }
  std::string dump() const {
    std::string s;
    for (const auto& [key, value] : fields) {
      s += (s.empty() ? "  {" : ", ") + quote(key) + ": " + value;
    }
    return s + "}";
  }
};

void progress(const std::string& message) {
  const std::time_t t = std::time(nullptr);
  char stamp[16];
  std::strftime(stamp, sizeof stamp, "%H:%M:%S", std::localtime(&t));
  std::cout << "[bench_cpp " << stamp << "] " << message << std::endl;
}

void synchronize(const Devices& devices) {
  for (const auto& d : devices) {
    if (d.is_cuda()) {
      torch::cuda::synchronize(d.index());
    }
  }
}

/// Milliseconds of each of `steps` calls of `step` after `warmup` calls, synchronising every
/// device around each call (as benchmarks/common.py time_steps).
std::vector<double> time_steps(const std::function<void()>& step, const Devices& devices,
                               int warmup, int steps) {
  for (int i = 0; i < warmup; ++i) {
    step();
  }
  synchronize(devices);
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    step();
    synchronize(devices);
    const auto stop = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return times;
}

/// Median and spread, with the keys and quantile rule of benchmarks/common.py summarize().
void summarize(Record& r, std::vector<double> times, const std::string& prefix) {
  std::sort(times.begin(), times.end());
  const size_t n = times.size();
  if (n == 0) {
    r.num(prefix + "_median", std::nullopt);
    return;
  }
  auto quantile = [&](double q) {
    return times[std::min(n - 1, static_cast<size_t>(std::llround(q * (n - 1.0))))];
  };
  r.num(prefix + "_median", n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]));
  r.num(prefix + "_p10", quantile(0.10)).num(prefix + "_p90", quantile(0.90));
  r.num(prefix + "_min", times.front()).num(prefix + "_max", times.back());
  r.num(prefix + "_count", static_cast<double>(n));
}

void reset_peak_memory(const Devices& devices) {
#if TORCHDP_WITH_CUDA
  for (const auto& d : devices) {
    if (d.is_cuda()) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
    }
  }
#endif
}

/// Peak allocated memory per CUDA device since the last reset, in GiB ([] on the CPU).
std::vector<double> peak_memory_gib(const Devices& devices) {
  std::vector<double> peaks;
#if TORCHDP_WITH_CUDA
  for (const auto& d : devices) {
    if (d.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
      const double gib = static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30);
      peaks.push_back(std::round(gib * 1000.0) / 1000.0);
    }
  }
#endif
  return peaks;
}

std::string error_message(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string message = c10_error ? c10_error->what_without_backtrace() : e.what();
  return message.size() > 1500 ? message.substr(0, 1500) + " [...]" : message;
}

std::string device_list(const Devices& devices) {
  std::string s;
  for (size_t i = 0; i < devices.size(); ++i) {
    s += (i ? "," : "") + devices[i].str();
  }
  return s;
}

struct Bench {
  bool smoke = false;
  int steps = 10;
  int warmup = 2;
  int libtorch_steps = 5;
  Devices devices;                                 // the data-parallel device list
  std::deque<Record> records;                      // a deque: references to records stay valid
  std::map<std::string, std::string> descriptions; // model name -> what it is, in every record
  int failures = 0;

  Record base(const std::string& bench, const std::string& model, const std::string& mode,
              size_t gpus) const {
    Record r;
    r.str("bench", bench).str("model", model).str("mode", mode);
    if (const auto d = descriptions.find(model); d != descriptions.end()) {
      r.str("model_desc", d->second);
    }
    r.num("gpus", static_cast<double>(gpus)).str("dtype", "fp32");
    r.str("devices", device_list(gpus == 1 ? Devices{devices.front()} : devices));
    if (smoke) {
      r.set("smoke", "true");
    }
    return r;
  }

  /// Runs `body`, which fills the record's timings, and adds the record with its speedups over
  /// `single_ms` and (`vs_libtorch`) `libtorch_ms`; a failure becomes an "error", `skipped` a
  /// skipped record.
  Record& add(Record r, const std::string& time_key, const std::function<void(Record&)>& body,
              std::optional<double> single_ms, std::optional<double> libtorch_ms, bool vs_libtorch,
              const std::string& skipped = "") {
    const std::string label = r.get("model", true) + " " + r.get("bench", true) + " " +
                              r.get("mode", true) + " (" + r.get("devices", true) + "): ";
    try {
      if (!skipped.empty()) {
        r.num(time_key, std::nullopt).str("skipped", skipped);
      } else {
        body(r);
      }
    } catch (const std::exception& e) {
      ++failures;
      r.num(time_key, std::nullopt).str("error", error_message(e));
    }
    const auto ms = r.value(time_key);
    auto ratio = [&](std::optional<double> ref) -> std::optional<double> {
      return ms && ref && *ms > 0 ? std::optional<double>(*ref / *ms) : std::nullopt;
    };
    const bool train = r.get("bench", true) == "cpp_train_step";
    const bool shard = r.get("mode", true) == "single_shard";
    r.num("speedup_vs_single", train && !shard ? ratio(single_ms) : std::nullopt);
    if (shard) {
      r.num("ideal_speedup_vs_single", ratio(single_ms));
    }
    if (vs_libtorch) {
      r.num("speedup_vs_libtorch", ratio(libtorch_ms));
    }
    if (r.get("peak_mem_gib").empty()) {
      r.set("peak_mem_gib", "[]");
    }
    std::ostringstream o;
    o << label;
    if (!skipped.empty() || !r.get("error").empty()) {
      o << (skipped.empty() ? "FAILED: " + r.get("error", true) : "skipped (" + skipped + ")");
    } else {
      o << std::fixed << std::setprecision(2) << ms.value_or(NAN) << " ms";
      for (const char* key :
           {"speedup_vs_single", "ideal_speedup_vs_single", "speedup_vs_libtorch"}) {
        if (const auto v = r.value(key)) {
          o << ", " << key << " " << *v << "x";
        }
      }
      o << ", peak GiB " << r.get("peak_mem_gib");
    }
    progress(o.str());
    records.push_back(std::move(r));
    return records.back();
  }

  /// Times training steps of `model` (on devices[0]) through `forward` into `r`: first one step
  /// alone, whose loss and gradient norm tell whether the modes compute the same thing (BatchNorm's
  /// batch statistics are per replica under data parallelism), then warm-up and timed steps.
  template <typename Model>
  void train_step(Record& r, Model model, const torch::Tensor& input, const Forward& forward,
                  int count, const Devices& used) {
    const auto& dev0 = devices.front();
    model->train();
    const auto x = input.to(dev0);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-3));
    auto step = [&]() {
      opt.zero_grad();
      auto loss = forward(x).pow(2).mean();
      loss.backward();
      opt.step();
      return loss;
    };
    opt.zero_grad();
    auto loss = forward(x).pow(2).mean();
    loss.backward();
    auto sq = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(dev0));
    for (const auto& p : model->parameters()) {
      if (p.grad().defined()) {
        sq += p.grad().detach().to(torch::kDouble).pow(2).sum().to(dev0);
      }
    }
    r.num("loss_first", loss.item<double>());
    r.num("grad_norm_first", sq.sqrt().item<double>());
    opt.step();
    synchronize(devices);
    reset_peak_memory(used);
    summarize(r, time_steps(step, devices, std::max(0, warmup - 1), count), "step_ms");
    r.set("peak_mem_gib", json_list(peak_memory_gib(used)));
  }

  template <typename Model>
  void bench_model(const std::string& name, const std::function<Model()>& make,
                   const torch::Tensor& input) {
    const Devices& devs = devices;
    const Devices one{devs.front()};
    const size_t n = devs.size();
    auto holder = [](const Devices& on, bool graphs) {
      return [on, graphs](Model m) -> Forward {
        torchdp::DataParallel dp(m,
                                 torchdp::DataParallelOptions().device_ids(on).cuda_graphs(graphs));
        return [dp](const torch::Tensor& x) mutable {
          return dp->forward(x);
        };
      };
    };
    auto plain = [](Model m) -> Forward {
      return [m](const torch::Tensor& x) mutable {
        return m->forward(x);
      };
    };
    struct Mode {
      std::string name;
      size_t gpus;
      std::function<Forward(Model)> wrap;
    };
    std::vector<Mode> modes = {{"single", 1, plain}, {"single_shard", 1, plain}};
#if TORCHDP_BENCH_LIBTORCH_DP
    modes.push_back({"libtorch_dp", n, [devs](Model m) -> Forward {
                       return [m, devs](const torch::Tensor& x) {
                         return torch::nn::parallel::data_parallel(m, x, devs);
                       };
                     }});
#else
    modes.push_back({"libtorch_dp", n, nullptr});
#endif
    modes.push_back({"torchdp", n, holder(devs, false)});
    modes.push_back({"torchdp_functional", n, [devs](Model m) -> Forward {
                       return [m, devs](const torch::Tensor& x) {
                         return torchdp::data_parallel(m, x, devs);
                       };
                     }});
    if (!smoke && torchdp::detail::cuda_graphs_available()) {
      modes.push_back({"single_graphs", 1, holder(one, true)});
      modes.push_back({"torchdp_graphs", n, holder(devs, true)});
    }

    std::optional<double> single_ms, libtorch_ms;
    for (const auto& mode : modes) {
      const bool shard = mode.name == "single_shard";
      if (shard && n < 2) {
        continue;
      }
      const int64_t batch = shard ? input.size(0) / static_cast<int64_t>(n) : input.size(0);
      auto r = base("cpp_train_step", name, mode.name, mode.gpus);
      if (shard) {
        r.num("shards", static_cast<double>(n)).num("batch", static_cast<double>(batch));
      }
      const bool libtorch = mode.name == "libtorch_dp";
      const std::string skipped = libtorch && (!mode.wrap || smoke)
                                      ? "LibTorch's torch::nn::parallel::data_parallel "
                                        "needs CUDA (its Scatter runs torch::cuda::scatter)"
                                      : "";
      auto& rec = add(
          std::move(r), "step_ms_median",
          [&](Record& r) {
            auto model = make();
            model->to(devs.front());
            train_step(r, model, input.narrow(0, 0, batch), mode.wrap(model),
                       libtorch ? std::min(libtorch_steps, steps) : steps,
                       mode.gpus == 1 ? one : devs);
          },
          single_ms, libtorch_ms, mode.name.rfind("torchdp", 0) == 0, skipped);
      if (mode.name == "single") {
        single_ms = rec.value("step_ms_median");
      } else if (libtorch) {
        libtorch_ms = rec.value("step_ms_median");
      }
    }
  }

  bool write(const std::string& path, int cuda_devices) const {
    std::ofstream f(path);
    std::string gpus; // the GPUs' names and the date say where a C++-only results file ran
#if TORCHDP_WITH_CUDA
    for (int i = 0; i < cuda_devices; ++i) {
      gpus += (i ? ", " : "") + quote(at::cuda::getDeviceProperties(i)->name);
    }
#endif
    char date[32] = "";
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    const char* rev = std::getenv("TORCHDP_GIT_REV");
    f << "{\"machine\": {\"source\": \"cpp\", \"torchdp_version\": " << quote(TORCHDP_VERSION)
      << ", \"date\": " << quote(date) << ", \"gpus\": [" << gpus
      << "], \"torchdp_git_revision\": " << quote(rev ? rev : "") << ", \"libtorch\": "
      << quote(std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
               "." + std::to_string(TORCH_VERSION_PATCH))
      << ", \"cuda_devices\": " << cuda_devices
      << ", \"torchdp_with_cuda\": " << (TORCHDP_WITH_CUDA ? "true" : "false")
      << ", \"torchdp_with_nccl\": " << (TORCHDP_WITH_NCCL ? "true" : "false")
      << ", \"devices\": " << quote(device_list(devices))
      << ", \"smoke\": " << (smoke ? "true" : "false") << ", \"steps\": " << steps
      << ", \"warmup\": " << warmup << ", \"libtorch_steps\": " << libtorch_steps
      << "},\n \"records\": [\n";
    for (size_t i = 0; i < records.size(); ++i) {
      f << records[i].dump() << (i + 1 < records.size() ? ",\n" : "\n");
    }
    f << " ]}\n";
    return static_cast<bool>(f);
  }
};

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> items;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    items.push_back(item);
  }
  return items;
}

int usage(const std::string& error) {
  (error.empty() ? std::cout : std::cerr)
      << (error.empty() ? "" : "torchdp_bench_cpp: " + error + "\n")
      << "usage: torchdp_bench_cpp --out PATH [--smoke] [--steps N] [--warmup N] "
         "[--models cpp_mlp200,cpp_convnet] [--device-ids 0,1]\n";
  return error.empty() ? 0 : 2;
}

} // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> all_models = {"cpp_mlp200", "cpp_convnet"};
  Bench bench;
  std::string out;
  std::optional<int> steps, warmup;
  std::vector<std::string> models = all_models;
  std::vector<int> device_ids;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      bench.smoke = true;
      continue;
    }
    if (i + 1 >= argc) {
      return usage(a == "--help" || a == "-h" ? "" : "unknown argument or no value: " + a);
    }
    const std::string v = argv[++i];
    try {
      if (a == "--out") {
        out = v;
      } else if (a == "--steps" || a == "--warmup") {
        (a == "--steps" ? steps : warmup) = std::stoi(v);
      } else if (a == "--models") {
        models = split_commas(v);
        for (const auto& m : models) {
          if (std::find(all_models.begin(), all_models.end(), m) == all_models.end()) {
            return usage("--models: unknown model '" + m + "'");
          }
        }
      } else if (a == "--device-ids") {
        for (const auto& id : split_commas(v)) {
          size_t used = 0;
          device_ids.push_back(std::stoi(id, &used));
          if (used != id.size() || device_ids.back() < 0) {
            throw std::invalid_argument(id);
          }
        }
      } else {
        return usage("unknown argument " + a);
      }
    } catch (const std::exception&) {
      return usage(a + ": not a valid value: '" + v + "'");
    }
  }
  if (out.empty()) {
    return usage("--out PATH is required");
  }
  bench.steps = steps.value_or(bench.smoke ? 2 : 10);
  bench.warmup = warmup.value_or(bench.smoke ? 1 : 2);
  bench.libtorch_steps = bench.smoke ? 2 : 5;
  if (bench.steps < 1 || bench.warmup < 0) {
    return usage("--steps must be at least 1, --warmup at least 0");
  }
  const int cuda_devices =
      torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (bench.smoke) {
    bench.devices = {torch::Device(torch::kCPU), torch::Device(torch::kCPU)};
  } else if (cuda_devices == 0) {
    std::cerr << "torchdp_bench_cpp: no CUDA device visible; use --smoke for a CPU run\n";
    return 1;
  }
  for (int i = 0; !bench.smoke && device_ids.empty() && i < cuda_devices; ++i) {
    bench.devices.emplace_back(torch::kCUDA, static_cast<torch::DeviceIndex>(i));
  }
  for (const int i : bench.smoke ? std::vector<int>{} : device_ids) {
    if (i >= cuda_devices) {
      return usage("--device-ids: cuda:" + std::to_string(i) + " does not exist");
    }
    bench.devices.emplace_back(torch::kCUDA, static_cast<torch::DeviceIndex>(i));
  }
  progress("devices " + device_list(bench.devices) + ", torchdp " + TORCHDP_VERSION + ", steps " +
           std::to_string(bench.steps) + ", warm-up " + std::to_string(bench.warmup));

  // Sizes: the GPU benchmark, or tiny ones for the CPU smoke run. cpp_convnet: 8 conv+BN blocks in
  // VGG-11's plan (9.2M parameters), the shape of the reference measurement's conv net (one GPU
  // ~11 ms, LibTorch's replicate ~150 ms on an H200).
  const bool s = bench.smoke;
  const int64_t layers = s ? 8 : 200, width = s ? 32 : 256, mlp_batch = s ? 16 : 512;
  constexpr int64_t P = ConvNetImpl::kPool;
  const std::vector<int64_t> plan =
      s ? std::vector<int64_t>{8, P, 16, P}
        : std::vector<int64_t>{64, P, 128, P, 256, 256, P, 512, 512, P, 512, 512, P};
  const int64_t conv_batch = s ? 8 : 256, hw = s ? 16 : 64;
  std::string plan_text;
  for (const int64_t c : plan) {
    plan_text += (plan_text.empty() ? "" : ",") + (c == P ? std::string("M") : std::to_string(c));
  }
  const std::string mlp_desc = std::to_string(layers) + " x (Linear(" + std::to_string(width) +
                               ", " + std::to_string(width) + "), ReLU), batch " +
                               std::to_string(mlp_batch);
  bench.descriptions = {
      {"cpp_mlp200", mlp_desc},
      {"cpp_convnet", "Conv2d(3x3)+BatchNorm2d+ReLU blocks, plan " + plan_text +
                          " (M: MaxPool2d(2)), global average pool, Linear, batch " +
                          std::to_string(conv_batch) + " of 3x" + std::to_string(hw) + "x" +
                          std::to_string(hw)},
  };
  auto wants = [&](const std::string& m) {
    return std::find(models.begin(), models.end(), m) != models.end();
  };

  torch::manual_seed(0);
  const auto mlp_input = torch::randn({mlp_batch, width});
  const auto conv_input = torch::randn({conv_batch, 3, hw, hw});
  auto make_mlp = [&]() {
    torch::manual_seed(1);
    return Mlp(layers, width);
  };
  if (wants("cpp_mlp200")) {
    bench.bench_model<Mlp>("cpp_mlp200", make_mlp, mlp_input);
  }
  if (wants("cpp_convnet")) {
    auto make_conv = [&]() {
      torch::manual_seed(2);
      return ConvNet(plan, 10);
    };
    bench.bench_model<ConvNet>("cpp_convnet", make_conv, conv_input);
  }
  if (!bench.write(out, cuda_devices)) {
    std::cerr << "torchdp_bench_cpp: cannot write " << out << "\n";
    return 1;
  }
  progress("wrote " + std::to_string(bench.records.size()) + " records to " + out + " (" +
           std::to_string(bench.failures) + " failed)");
  return 0;
}
