// C++ benchmark of torchdp against LibTorch's own data parallelism.
//
// For three Cloneable models (cpp_mlp200: 200 x Linear(256,256)+ReLU, batch 512; cpp_convnet: 8
// Conv2d(3x3)+BatchNorm2d+ReLU blocks in VGG-11's plan with max pooling, global average pool,
// Linear(512,10), batch 256 of 64x64 images; cpp_convnet_flat: 8 such blocks of 64 channels
// without pooling, the conv net of runs before 2026-12-02) it times full training steps (zero_grad,
// forward, loss = out.pow(2).mean(), backward, SGD step) in these modes:
//   single              the model on one device
//   libtorch_dp         torch::nn::parallel::data_parallel over all devices (LibTorch)
//   torchdp             torchdp::DataParallel (module holder) over all devices
//   torchdp_functional  torchdp::data_parallel over all devices
//   torchdp_graphs      torchdp::DataParallel with cuda_graphs over all devices (GPUs only)
//   single_graphs       the same on the first device alone (GPUs only)
//   single_shard        the model on the first device with batch / n (one replica's share, n the
//                       device count): single's time / its time ("ideal_speedup_vs_single") is what
//                       n devices would reach with perfect overlap and no communication
// and the time of one differentiable replicate() call (torch::nn::parallel::replicate vs
// torchdp::replicate). cpp_script_mlp200 is cpp_mlp200's model, with the same weights, as a
// TorchScript module (bench_script.cpp): modes single, torchdp (torchdp::ScriptDataParallel) and
// torchdp_new_replicas (its replicas rebuilt at each step); LibTorch's data_parallel cannot
// replicate a torch::jit::Module, so its speedup_vs_libtorch is against cpp_mlp200's libtorch_dp.
// Results go to a JSON file in the format of benchmarks/common.py.
//
// Usage:
//   torchdp_bench_cpp --out PATH [--smoke] [--steps N] [--warmup N] [--libtorch-steps N]
//                     [--models LIST] [--device-ids LIST] [--strict]
// --smoke runs tiny models on two CPU replicas ({kCPU, kCPU}), 1 warm-up and 2 steps, and skips
// LibTorch's data_parallel (its Scatter needs CUDA). Without --smoke every visible GPU is used.
// LibTorch's data_parallel and replicate deep-clone the module on every call (~10x slower than
// one GPU), so they run --libtorch-steps (default 5) steps.
// A configuration that fails is recorded with an "error" and the run continues. Exit status: 0 when
// the results file was written (with --strict: only when no configuration failed), 1 otherwise,
// 2 on bad arguments.

#include "bench_script.h"

#include <torchdp/config.h>
#include <torchdp/torchdp.h>

#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>
#include <torch/version.h>
// LibTorch's data_parallel and replicate: the header includes CUDA headers (c10/cuda/CUDAStream.h
// through torch/csrc/autograd/functions/comm.h), so only CUDA builds have them; without it the
// LibTorch configurations are recorded as skipped. (Defining TORCHDP_BENCH_LIBTORCH_DP=1 forces
// them in, for a compile check against a stubbed header.)
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
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

// ---- models -------------------------------------------------------------------------------------

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
  ConvNetImpl(std::vector<int64_t> plan, int64_t in_channels, int64_t classes)
      : plan(std::move(plan)), in_channels(in_channels), classes(classes) {
    reset();
  }
  void reset() override {
    features = register_module("features", torch::nn::Sequential());
    int64_t in = in_channels;
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
  int64_t in_channels;
  int64_t classes;
  torch::nn::Sequential features{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ConvNet);

// ---- JSON, written by hand ----------------------------------------------------------------------

std::string json_string(const std::string& s) {
  std::ostringstream o;
  o << '"';
  for (const unsigned char c : s) {
    switch (c) {
      case '"':
        o << "\\\"";
        break;
      case '\\':
        o << "\\\\";
        break;
      case '\n':
        o << "\\n";
        break;
      case '\r':
        o << "\\r";
        break;
      case '\t':
        o << "\\t";
        break;
      default:
        if (c < 0x20) {
          o << "\\u" << std::hex << std::setw(4) << std::setfill('0') << static_cast<int>(c)
            << std::dec << std::setfill(' ');
        } else {
          o << c;
        }
    }
  }
  o << '"';
  return o.str();
}

std::string json_number(double v) {
  if (!std::isfinite(v)) {
    return "null";
  }
  std::ostringstream o;
  o << std::setprecision(10) << v;
  return o.str();
}

std::string json_number(std::optional<double> v) {
  return v ? json_number(*v) : "null";
}

std::string json_list(const std::vector<double>& values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    s += (i ? ", " : "") + json_number(values[i]);
  }
  return s + "]";
}

/// One record: keys in insertion order, values already JSON.
struct Record {
  std::vector<std::pair<std::string, std::string>> fields;

  Record& set(const std::string& key, std::string json) {
    for (auto& f : fields) {
      if (f.first == key) {
        f.second = std::move(json);
        return *this;
      }
    }
    fields.emplace_back(key, std::move(json));
    return *this;
  }
  Record& str(const std::string& key, const std::string& value) {
    return set(key, json_string(value));
  }
  Record& num(const std::string& key, std::optional<double> value) {
    return set(key, json_number(value));
  }
  Record& null(const std::string& key) {
    return set(key, "null");
  }
  bool has(const std::string& key) const {
    return std::any_of(fields.begin(), fields.end(), [&](const auto& f) {
      return f.first == key;
    });
  }
  std::string dump(const std::string& indent) const {
    std::string s = indent + "{";
    for (size_t i = 0; i < fields.size(); ++i) {
      s += (i ? ", " : "") + json_string(fields[i].first) + ": " + fields[i].second;
    }
    return s + "}";
  }
};

// ---- timing -------------------------------------------------------------------------------------

std::string now_hms() {
  const std::time_t t = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%H:%M:%S", std::localtime(&t));
  return buf;
}

void progress(const std::string& message) {
  std::cout << "[bench_cpp " << now_hms() << "] " << message << std::endl;
}

void synchronize(const std::vector<torch::Device>& devices) {
  for (const auto& d : devices) {
    if (d.is_cuda()) {
      torch::cuda::synchronize(d.index());
    }
  }
}

/// Milliseconds of each of `steps` calls of `step` after `warmup` calls, synchronising every
/// device around each call (as benchmarks/common.py time_steps).
std::vector<double> time_steps(const std::function<void()>& step,
                               const std::vector<torch::Device>& devices, int warmup, int steps) {
  for (int i = 0; i < warmup; ++i) {
    step();
  }
  synchronize(devices);
  std::vector<double> times;
  times.reserve(steps);
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
    r.null(prefix + "_median");
    return;
  }
  const double median = n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
  auto quantile = [&](double q) {
    const auto i = static_cast<size_t>(std::llround(q * static_cast<double>(n - 1)));
    return times[std::min(n - 1, i)];
  };
  r.num(prefix + "_median", median);
  r.num(prefix + "_p10", quantile(0.10));
  r.num(prefix + "_p90", quantile(0.90));
  r.num(prefix + "_min", times.front());
  r.num(prefix + "_max", times.back());
  r.num(prefix + "_count", static_cast<double>(n));
}

void reset_peak_memory(const std::vector<torch::Device>& devices) {
#if TORCHDP_WITH_CUDA
  for (const auto& d : devices) {
    if (d.is_cuda()) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
    }
  }
#endif
}

/// Peak allocated memory per CUDA device since the last reset, in GiB ([] on the CPU).
std::vector<double> peak_memory_gib(const std::vector<torch::Device>& devices) {
  std::vector<double> peaks;
#if TORCHDP_WITH_CUDA
  for (const auto& d : devices) {
    if (d.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
      const double gib =
          static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024 * 1024);
      peaks.push_back(std::round(gib * 1000.0) / 1000.0);
    }
  }
#endif
  return peaks;
}

std::string error_message(const std::exception& e) {
  std::string message;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    message = c10_error->what_without_backtrace();
  } else {
    message = e.what();
  }
  if (message.size() > 1500) {
    message = message.substr(0, 1500) + " [...]";
  }
  return message;
}

std::string device_list(const std::vector<torch::Device>& devices) {
  std::string s;
  for (size_t i = 0; i < devices.size(); ++i) {
    s += (i ? "," : "") + devices[i].str();
  }
  return s;
}

// ---- the benchmark ------------------------------------------------------------------------------

struct Settings {
  std::string out;
  bool smoke = false;
  int steps = 10;
  int warmup = 2;
  int libtorch_steps = 5;
  bool strict = false;
  std::vector<std::string> models; // empty: all
  std::vector<int> device_ids;     // empty: every visible GPU
  bool wants(const std::string& model) const {
    return models.empty() || std::find(models.begin(), models.end(), model) != models.end();
  }
};

const std::vector<std::string> kModels = {"cpp_mlp200", "cpp_convnet", "cpp_convnet_flat",
                                          "cpp_script_mlp200"};

struct Bench {
  Settings settings;
  std::vector<torch::Device> devices; // the data-parallel device list
  std::deque<Record> records;         // a deque: references to records stay valid
  int failures = 0;
  std::map<std::string, std::string> descriptions; // model name -> what it is, in every record

  Record base(const std::string& bench, const std::string& model, const std::string& mode,
              size_t gpus) const {
    Record r;
    r.str("bench", bench).str("model", model).str("mode", mode);
    if (const auto d = descriptions.find(model); d != descriptions.end()) {
      r.str("model_desc", d->second);
    }
    r.num("gpus", static_cast<double>(gpus)).str("dtype", "fp32");
    r.str("devices",
          device_list(gpus == 1 ? std::vector<torch::Device>{devices.front()} : devices));
    if (settings.smoke) {
      r.set("smoke", "true");
    }
    return r;
  }

  /// Runs `body` (which fills the record's timings); a failure becomes an "error" record.
  Record& run(Record r, const std::string& time_key, const std::function<void(Record&)>& body) {
    const std::string label = field(r, "model") + " " + field(r, "bench") + " " + field(r, "mode");
    try {
      body(r);
    } catch (const std::exception& e) {
      ++failures;
      r.null(time_key).str("error", error_message(e));
      progress(label + ": FAILED: " + error_message(e));
    }
    r.null("speedup_vs_single");
    if (!r.has("peak_mem_gib")) {
      r.set("peak_mem_gib", "[]");
    }
    records.push_back(std::move(r));
    return records.back();
  }

  Record& skip(Record r, const std::string& time_key, const std::string& why) {
    r.null(time_key).null("speedup_vs_single").set("peak_mem_gib", "[]").str("skipped", why);
    progress(field(r, "model") + " " + field(r, "bench") + " " + field(r, "mode") + ": skipped (" +
             why + ")");
    records.push_back(std::move(r));
    return records.back();
  }

  static std::string field(const Record& r, const std::string& key) {
    for (const auto& f : r.fields) {
      if (f.first == key) {
        return f.second.size() >= 2 && f.second.front() == '"'
                   ? f.second.substr(1, f.second.size() - 2)
                   : f.second;
      }
    }
    return "";
  }

  static std::optional<double> median_of(const Record& r, const std::string& key) {
    const auto v = field(r, key);
    if (v.empty() || v == "null") {
      return std::nullopt;
    }
    return std::stod(v);
  }

  /// One training-step configuration: `forward` runs the (data-parallel) forward of `model`.
  template <typename Model>
  void train_step(Record& r, Model model, const torch::Tensor& input,
                  const std::function<torch::Tensor(const torch::Tensor&)>& forward, int steps) {
    const auto& dev0 = devices.front();
    model->to(dev0);
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
    // The first step on its own: its loss and gradient norm tell whether the modes compute the same
    // thing (BatchNorm's batch statistics are per replica under data parallelism).
    {
      opt.zero_grad();
      auto loss = forward(x).pow(2).mean();
      loss.backward();
      auto sq = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(dev0));
      for (const auto& p : model->parameters()) {
        if (p.grad().defined()) {
          sq += p.grad().detach().to(torch::kDouble).pow(2).sum().to(dev0);
        }
      }
      r.num("loss_first", loss.item<double>()).num("grad_norm_first", sq.sqrt().item<double>());
      opt.step();
    }
    synchronize(devices);
    reset_peak_memory(devices);
    const auto times = time_steps(
        [&]() {
          step();
        },
        devices, std::max(0, settings.warmup - 1), steps);
    summarize(r, times, "step_ms");
    r.set("peak_mem_gib",
          json_list(peak_memory_gib(field(r, "gpus") == "1" ? std::vector<torch::Device>{dev0}
                                                            : devices)));
  }

  template <typename Model>
  void bench_model(const std::string& name, const std::function<Model()>& make,
                   const torch::Tensor& input) {
    const size_t n = devices.size();
    const auto& devs = devices;
    const int steps = settings.steps;
    [[maybe_unused]] const int lt_steps = std::min(settings.libtorch_steps, settings.steps);

    // Train steps.
    auto& single = run(base("cpp_train_step", name, "single", 1), "step_ms_median", [&](Record& r) {
      auto model = make();
      train_step(
          r, model, input,
          [&](const torch::Tensor& x) {
            return model->forward(x);
          },
          steps);
    });
    const auto single_ms = median_of(single, "step_ms_median");
    report(single, "step_ms_median", single_ms);

    // One replica's share of the batch on one device: the bound of every data-parallel mode.
    if (n >= 2) {
      const int64_t share = input.size(0) / static_cast<int64_t>(n);
      auto r = base("cpp_train_step", name, "single_shard", 1);
      r.num("shards", static_cast<double>(n)).num("batch", static_cast<double>(share));
      auto& shard = run(std::move(r), "step_ms_median", [&](Record& r) {
        auto model = make();
        train_step(
            r, model, input.narrow(0, 0, share),
            [&](const torch::Tensor& x) {
              return model->forward(x);
            },
            steps);
      });
      speedup(shard, "step_ms_median", "ideal_speedup_vs_single", single_ms);
      report(shard, "step_ms_median", std::nullopt);
    }

    std::optional<double> libtorch_ms;
    if (!TORCHDP_BENCH_LIBTORCH_DP || settings.smoke) {
      skip(base("cpp_train_step", name, "libtorch_dp", n), "step_ms_median",
           "LibTorch's torch::nn::parallel::data_parallel needs CUDA (its Scatter runs "
           "torch::cuda::scatter)");
    } else {
#if TORCHDP_BENCH_LIBTORCH_DP
      auto& r =
          run(base("cpp_train_step", name, "libtorch_dp", n), "step_ms_median", [&](Record& r) {
            auto model = make();
            train_step(
                r, model, input,
                [&](const torch::Tensor& x) {
                  return torch::nn::parallel::data_parallel(model, x, devs);
                },
                lt_steps);
          });
      libtorch_ms = median_of(r, "step_ms_median");
      report(r, "step_ms_median", single_ms);
#endif
    }

    {
      auto& r = run(base("cpp_train_step", name, "torchdp", n), "step_ms_median", [&](Record& r) {
        auto model = make();
        model->to(devs.front());
        torchdp::DataParallel dp(model, torchdp::DataParallelOptions().device_ids(devs));
        train_step(
            r, model, input,
            [&](const torch::Tensor& x) {
              return dp->forward(x);
            },
            steps);
      });
      speedup(r, "step_ms_median", "speedup_vs_libtorch", libtorch_ms);
      report(r, "step_ms_median", single_ms);
    }
    {
      auto& r = run(base("cpp_train_step", name, "torchdp_functional", n), "step_ms_median",
                    [&](Record& r) {
                      auto model = make();
                      train_step(
                          r, model, input,
                          [&](const torch::Tensor& x) {
                            return torchdp::data_parallel(model, x, devs);
                          },
                          steps);
                    });
      speedup(r, "step_ms_median", "speedup_vs_libtorch", libtorch_ms);
      report(r, "step_ms_median", single_ms);
    }

    // CUDA graphs (DataParallelOptions::cuda_graphs): over all devices, and on the first device
    // alone (the one-GPU baseline with the same graphs). GPUs only.
    if (!settings.smoke && torchdp::detail::cuda_graphs_available()) {
      auto graphed = [&](const std::vector<torch::Device>& on) {
        return [&, on](Record& r) {
          auto model = make();
          model->to(on.front());
          torchdp::DataParallel dp(model,
                                   torchdp::DataParallelOptions().device_ids(on).cuda_graphs(true));
          train_step(
              r, model, input,
              [&](const torch::Tensor& x) {
                return dp->forward(x);
              },
              steps);
        };
      };
      auto& one = run(base("cpp_train_step", name, "single_graphs", 1), "step_ms_median",
                      graphed({devs.front()}));
      report(one, "step_ms_median", single_ms);
      auto& r =
          run(base("cpp_train_step", name, "torchdp_graphs", n), "step_ms_median", graphed(devs));
      speedup(r, "step_ms_median", "speedup_vs_libtorch", libtorch_ms);
      report(r, "step_ms_median", single_ms);
    }

    // Replicate time: one differentiable replicate() onto all devices.
    auto replicate_bench = [&](const std::string& mode, int count,
                               const std::function<void(Model&)>& call) -> Record& {
      auto& r = run(base("cpp_replicate", name, mode, n), "replicate_ms_median", [&](Record& r) {
        auto model = make();
        model->to(devs.front());
        model->train();
        const auto times = time_steps(
            [&]() {
              call(model);
            },
            devs, settings.warmup, count);
        summarize(r, times, "replicate_ms");
      });
      int64_t modules = 0;
      {
        auto probe = make();
        modules = static_cast<int64_t>(probe->modules(/*include_self=*/true).size());
      }
      r.num("modules", static_cast<double>(modules));
      return r;
    };
    std::optional<double> lt_ms;
#if TORCHDP_BENCH_LIBTORCH_DP
    // Runs on CPU device lists too (clone(device) and ReduceAdd need no CUDA).
    auto& lt = replicate_bench("libtorch_replicate", lt_steps, [&](Model& m) {
      auto replicas = torch::nn::parallel::replicate(m, devs);
    });
    lt_ms = median_of(lt, "replicate_ms_median");
    report(lt, "replicate_ms_median", std::nullopt);
#else
    skip(base("cpp_replicate", name, "libtorch_replicate", n), "replicate_ms_median",
         "torch/nn/parallel/data_parallel.h (LibTorch's replicate) needs a CUDA build");
#endif
    auto& ours = replicate_bench("torchdp_replicate", steps, [&](Model& m) {
      auto replicas = torchdp::replicate(m, devs);
    });
    speedup(ours, "replicate_ms_median", "speedup_vs_libtorch", lt_ms);
    report(ours, "replicate_ms_median", std::nullopt);
  }

  /// The scripted model: training steps in each mode, then replicate() with and without the
  /// kept replicas. `libtorch_ms`: the same model's LibTorch data_parallel step, when measured.
  void bench_script(const std::string& name, const std::function<torch::jit::Module()>& make,
                    const torch::Tensor& input, std::optional<double> libtorch_ms) {
    const size_t n = devices.size();
    std::optional<double> single_ms;
    for (const std::string mode : {"single", "torchdp", "torchdp_new_replicas"}) {
      const bool one = mode == "single";
      const auto on = one ? std::vector<torch::Device>{devices.front()} : devices;
      auto& r =
          run(base("cpp_train_step", name, mode, one ? 1 : n), "step_ms_median", [&](Record& r) {
            auto module = make();
            auto step = torchdp_bench::script_train_step(module, input, on, mode);
            const auto loss = step(); // the first step: loss and gradient norm
            r.num("loss_first", loss.item<double>())
                .num("grad_norm_first", torchdp_bench::script_grad_norm(module));
            synchronize(devices);
            reset_peak_memory(on);
            summarize(r,
                      time_steps(
                          [&]() {
                            step();
                          },
                          on, std::max(0, settings.warmup - 1), settings.steps),
                      "step_ms");
            r.set("peak_mem_gib", json_list(peak_memory_gib(on)));
          });
      if (one) {
        single_ms = median_of(r, "step_ms_median");
      } else {
        speedup(r, "step_ms_median", "speedup_vs_libtorch", libtorch_ms);
      }
      report(r, "step_ms_median", single_ms);
    }
    for (const bool cached : {true, false}) {
      const auto mode = cached ? "torchdp_replicate" : "torchdp_new_replicas";
      auto& r = run(base("cpp_replicate", name, mode, n), "replicate_ms_median", [&](Record& r) {
        const auto call = torchdp_bench::script_replicate(make(), devices, cached);
        summarize(r, time_steps(call, devices, settings.warmup, settings.steps), "replicate_ms");
      });
      report(r, "replicate_ms_median", std::nullopt);
    }
  }

  void speedup(Record& r, const std::string& time_key, const std::string& key,
               std::optional<double> reference_ms) {
    const auto ms = median_of(r, time_key);
    if (ms && reference_ms && *ms > 0) {
      r.num(key, *reference_ms / *ms);
    } else {
      r.null(key);
    }
  }

  void report(Record& r, const std::string& time_key, std::optional<double> single_ms) {
    if (field(r, "bench") == "cpp_train_step") {
      speedup(r, time_key, "speedup_vs_single", single_ms);
    }
    const auto ms = median_of(r, time_key);
    if (!ms) {
      return;
    }
    std::ostringstream o;
    o << field(r, "model") << " " << field(r, "bench") << " " << field(r, "mode") << " ("
      << field(r, "devices") << "): " << std::fixed << std::setprecision(2) << *ms << " ms";
    for (const char* key :
         {"speedup_vs_single", "speedup_vs_libtorch", "ideal_speedup_vs_single"}) {
      const auto v = median_of(r, key);
      if (v) {
        o << ", " << key << " " << std::setprecision(2) << *v << "x";
      }
    }
    const auto peak = field(r, "peak_mem_gib");
    if (!peak.empty() && peak != "[]") {
      o << ", peak GiB " << peak;
    }
    progress(o.str());
  }

  bool write(int cuda_devices) const {
    std::ofstream f(settings.out);
    if (!f) {
      std::cerr << "torchdp_bench_cpp: cannot write " << settings.out << "\n";
      return false;
    }
    std::ostringstream torch_version;
#if defined(TORCH_VERSION_MAJOR) && defined(TORCH_VERSION_MINOR) && defined(TORCH_VERSION_PATCH)
    torch_version << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "."
                  << TORCH_VERSION_PATCH;
#else
    torch_version << "unknown";
#endif
    // The GPUs' names and the date, so that a C++-only results file says where it ran.
    std::string gpus = "[";
#if TORCHDP_WITH_CUDA
    for (int i = 0; i < cuda_devices; ++i) {
      gpus += (i ? ", " : "") + json_string(at::cuda::getDeviceProperties(i)->name);
    }
#endif
    gpus += "]";
    char date[32] = "";
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    f << "{\"machine\": {\"source\": \"cpp\", \"torchdp_version\": " << json_string(TORCHDP_VERSION)
      << ", \"date\": " << json_string(date) << ", \"gpus\": " << gpus
      << ", \"torchdp_git_revision\": "
      << json_string(std::getenv("TORCHDP_GIT_REV") ? std::getenv("TORCHDP_GIT_REV") : "")
      << ", \"libtorch\": " << json_string(torch_version.str())
      << ", \"cuda_devices\": " << cuda_devices
      << ", \"torchdp_with_cuda\": " << (TORCHDP_WITH_CUDA ? "true" : "false")
      << ", \"torchdp_with_nccl\": " << (TORCHDP_WITH_NCCL ? "true" : "false")
      << ", \"devices\": " << json_string(device_list(devices))
      << ", \"smoke\": " << (settings.smoke ? "true" : "false") << ", \"steps\": " << settings.steps
      << ", \"warmup\": " << settings.warmup << ", \"libtorch_steps\": " << settings.libtorch_steps
      << "},\n \"records\": [\n";
    for (size_t i = 0; i < records.size(); ++i) {
      f << records[i].dump("  ") << (i + 1 < records.size() ? ",\n" : "\n");
    }
    f << " ]}\n";
    return static_cast<bool>(f);
  }
};

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> items;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    items.push_back(item);
  }
  return items;
}

void usage(std::ostream& o) {
  o << "usage: torchdp_bench_cpp --out PATH [--smoke] [--steps N] [--warmup N] "
       "[--libtorch-steps N] [--models LIST] [--device-ids LIST] [--strict]\n"
       "  --out PATH          JSON results file (benchmarks/common.py format)\n"
       "  --smoke             tiny models on two CPU replicas, 1 warm-up + 2 steps; skips "
       "LibTorch's\n"
       "                      data_parallel (needs CUDA)\n"
       "  --steps N           timed steps per configuration (default 10; smoke 2)\n"
       "  --warmup N          warm-up steps (default 2; smoke 1)\n"
       "  --libtorch-steps N  timed steps of LibTorch's data_parallel/replicate (default 5)\n"
       "  --models LIST       comma list of cpp_mlp200, cpp_convnet, cpp_convnet_flat,\n"
       "                      cpp_script_mlp200 (default: all)\n"
       "  --device-ids LIST   CUDA indices of the replicas, e.g. 0,0 for two replicas on one GPU\n"
       "                      (default: every visible GPU)\n"
       "  --strict            exit 1 when a configuration failed (default: record it, exit 0)\n";
}

} // namespace

int main(int argc, char** argv) {
  Settings s;
  std::optional<int> steps, warmup, libtorch_steps;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "torchdp_bench_cpp: " << a << " needs a value\n";
        usage(std::cerr);
        std::exit(2);
      }
      return argv[++i];
    };
    auto int_value = [&]() -> int {
      const auto v = value();
      try {
        const int n = std::stoi(v);
        if (n >= 0) {
          return n;
        }
      } catch (const std::exception&) {
      }
      std::cerr << "torchdp_bench_cpp: " << a << " expects a non-negative integer, got " << v
                << "\n";
      std::exit(2);
    };
    if (a == "--out") {
      s.out = value();
    } else if (a == "--smoke") {
      s.smoke = true;
    } else if (a == "--strict") {
      s.strict = true;
    } else if (a == "--steps") {
      steps = int_value();
    } else if (a == "--warmup") {
      warmup = int_value();
    } else if (a == "--libtorch-steps") {
      libtorch_steps = int_value();
    } else if (a == "--device-ids") {
      const auto list = value();
      for (const auto& id : split_commas(list)) {
        size_t used = 0;
        int v = -1;
        try {
          v = std::stoi(id, &used);
        } catch (const std::exception&) {
        }
        if (v < 0 || used != id.size()) {
          std::cerr << "torchdp_bench_cpp: --device-ids expects a comma list of CUDA indices "
                       "(e.g. 0,1 or 0,0), got '"
                    << list << "'\n";
          return 2;
        }
        s.device_ids.push_back(v);
      }
    } else if (a == "--models") {
      const auto list = value();
      for (const auto& m : split_commas(list)) {
        if (std::find(kModels.begin(), kModels.end(), m) == kModels.end()) {
          std::cerr << "torchdp_bench_cpp: --models: unknown model '" << m << "' in '" << list
                    << "'; expected a comma list of cpp_mlp200, cpp_convnet, cpp_convnet_flat, "
                       "cpp_script_mlp200\n";
          return 2;
        }
        s.models.push_back(m);
      }
    } else if (a == "--help" || a == "-h") {
      usage(std::cout);
      return 0;
    } else {
      std::cerr << "torchdp_bench_cpp: unknown argument " << a << "\n";
      usage(std::cerr);
      return 2;
    }
  }
  if (s.out.empty()) {
    std::cerr << "torchdp_bench_cpp: --out PATH is required\n";
    usage(std::cerr);
    return 2;
  }
  s.steps = steps.value_or(s.smoke ? 2 : 10);
  s.warmup = warmup.value_or(s.smoke ? 1 : 2);
  s.libtorch_steps = libtorch_steps.value_or(s.smoke ? 2 : 5);
  if (s.steps < 1) {
    std::cerr << "torchdp_bench_cpp: --steps must be at least 1\n";
    return 2;
  }

  Bench bench;
  bench.settings = s;
  const int cuda_devices =
      torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (s.smoke) {
    bench.devices = {torch::Device(torch::kCPU), torch::Device(torch::kCPU)};
  } else if (cuda_devices > 0) {
    for (const int i : s.device_ids) {
      if (i >= cuda_devices) {
        std::cerr << "torchdp_bench_cpp: --device-ids: cuda:" << i << " does not exist ("
                  << cuda_devices << " visible)\n";
        return 2;
      }
      bench.devices.emplace_back(torch::kCUDA, static_cast<torch::DeviceIndex>(i));
    }
    for (int i = 0; s.device_ids.empty() && i < cuda_devices; ++i) {
      bench.devices.emplace_back(torch::kCUDA, static_cast<torch::DeviceIndex>(i));
    }
  } else {
    bench.devices = {torch::Device(torch::kCPU)};
    Record r = bench.base("cpp_train_step", "cpp_mlp200", "single", 1);
    r.null("step_ms_median").null("speedup_vs_single").set("peak_mem_gib", "[]");
    r.str("error",
          "no CUDA device visible (torch::cuda::device_count() == 0); use --smoke for a "
          "CPU run");
    bench.records.push_back(r);
    progress("no CUDA device visible; use --smoke for a CPU run");
    bench.write(0);
    return 1;
  }
  progress("devices " + device_list(bench.devices) + ", torchdp " + TORCHDP_VERSION +
           (TORCHDP_WITH_CUDA ? " (CUDA" : " (no CUDA") + (TORCHDP_WITH_NCCL ? ", NCCL)" : ")") +
           ", steps " + std::to_string(s.steps) + ", warm-up " + std::to_string(s.warmup) +
           ", LibTorch steps " + std::to_string(s.libtorch_steps));

  // Sizes: the GPU benchmark, or tiny ones for the CPU smoke run.
  const int64_t mlp_layers = s.smoke ? 8 : 200;
  const int64_t mlp_width = s.smoke ? 32 : 256;
  const int64_t mlp_batch = s.smoke ? 16 : 512;
  // cpp_convnet: 8 conv+BN blocks in VGG-11's plan (64, pool, 128, pool, 256, 256, pool, 512,
  // 512, pool, 512, 512, pool; 9.2M parameters), the shape of the reference measurement's conv
  // net (one GPU ~11 ms, LibTorch's replicate ~150 ms on an H200). cpp_convnet_flat: 8 blocks of
  // 64 channels at full resolution (0.3M parameters, GPU-bound), the conv net of earlier runs.
  constexpr int64_t P = ConvNetImpl::kPool;
  const std::vector<int64_t> vgg_plan =
      s.smoke ? std::vector<int64_t>{8, P, 16, P}
              : std::vector<int64_t>{64, P, 128, P, 256, 256, P, 512, 512, P, 512, 512, P};
  const std::vector<int64_t> flat_plan(s.smoke ? 2 : 8, s.smoke ? 8 : 64);
  const int64_t conv_batch = s.smoke ? 8 : 256;
  const int64_t conv_hw = s.smoke ? 16 : 64;

  auto plan_text = [](const std::vector<int64_t>& plan) {
    std::string t;
    for (const int64_t c : plan) {
      t +=
          (t.empty() ? "" : ",") + (c == ConvNetImpl::kPool ? std::string("M") : std::to_string(c));
    }
    return t;
  };
  const std::string conv_shape = ", batch " + std::to_string(conv_batch) + " of 3x" +
                                 std::to_string(conv_hw) + "x" + std::to_string(conv_hw);
  bench.descriptions = {
      {"cpp_mlp200", std::to_string(mlp_layers) + " x (Linear(" + std::to_string(mlp_width) + ", " +
                         std::to_string(mlp_width) + "), ReLU), batch " +
                         std::to_string(mlp_batch)},
      {"cpp_convnet", "Conv2d(3x3)+BatchNorm2d+ReLU blocks, plan " + plan_text(vgg_plan) +
                          " (M: MaxPool2d(2)), global average pool, Linear" + conv_shape},
      {"cpp_convnet_flat", "Conv2d(3x3)+BatchNorm2d+ReLU blocks, plan " + plan_text(flat_plan) +
                               ", global average pool, Linear" + conv_shape},
      {"cpp_script_mlp200",
       "cpp_mlp200's model and weights as a TorchScript module: " + std::to_string(mlp_layers) +
           " x (Linear(" + std::to_string(mlp_width) + ", " + std::to_string(mlp_width) +
           "), ReLU), batch " + std::to_string(mlp_batch)},
  };

  torch::manual_seed(0);
  const auto mlp_input = torch::randn({mlp_batch, mlp_width});
  const auto conv_input = torch::randn({conv_batch, 3, conv_hw, conv_hw});

  try {
    if (s.wants("cpp_mlp200")) {
      bench.bench_model<Mlp>(
          "cpp_mlp200",
          [&]() {
            torch::manual_seed(1);
            return Mlp(mlp_layers, mlp_width);
          },
          mlp_input);
    }
    const std::pair<const char*, const std::vector<int64_t>*> conv_nets[] = {
        {"cpp_convnet", &vgg_plan}, {"cpp_convnet_flat", &flat_plan}};
    for (const auto& net : conv_nets) {
      if (s.wants(net.first)) {
        const auto* plan = net.second;
        bench.bench_model<ConvNet>(
            net.first,
            [plan]() {
              torch::manual_seed(2);
              return ConvNet(*plan, 3, 10);
            },
            conv_input);
      }
    }
    if (s.wants("cpp_script_mlp200")) {
      std::optional<double> libtorch_ms;
      for (const auto& r : bench.records) {
        if (Bench::field(r, "model") == "cpp_mlp200" && Bench::field(r, "mode") == "libtorch_dp" &&
            Bench::field(r, "bench") == "cpp_train_step") {
          libtorch_ms = Bench::median_of(r, "step_ms_median");
        }
      }
      bench.bench_script(
          "cpp_script_mlp200",
          [&]() {
            torch::manual_seed(1); // cpp_mlp200's weights
            return torchdp_bench::script_mlp(Mlp(mlp_layers, mlp_width)->parameters());
          },
          mlp_input, libtorch_ms);
    }
  } catch (const std::exception& e) {
    // Not expected (every configuration catches its own failures); keep what was measured.
    ++bench.failures;
    progress(std::string("FAILED outside a configuration: ") + error_message(e));
  }

  if (!bench.write(cuda_devices)) {
    return 1;
  }
  progress("wrote " + std::to_string(bench.records.size()) + " records to " + s.out +
           (bench.failures ? " (" + std::to_string(bench.failures) + " failed)" : ""));
  return bench.failures && s.strict ? 1 : 0;
}
