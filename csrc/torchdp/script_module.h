#pragma once

#include <torchdp/data_parallel.h>
#include <torchdp/replicate.h>
#include <torchdp/structure.h>

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace torchdp {

// Note [Replicating TorchScript modules]
// A torch::jit::Module is a tree of script objects whose slots hold submodules, parameters,
// buffers and other attributes; its methods belong to its class type, which replicas share (as
// Python's replicate does through _replicate_for_data_parallel). Each replica is one new object
// per module object of the original, built once per device list and kept while the original's
// object tree and slot kinds stay the same. Each call refreshes every slot: submodule slots point
// at the replica's own objects (shared submodules stay shared), parameters and the other tensor
// attributes (buffers, plain tensor members) take their copies from one coalesced broadcast,
// differentiable for parameters and for tensors that require grad, and every other attribute is
// the original's value (the training flag included). Replica 0's tensors share storage with the
// original's.

/// Builds and refreshes the replicas of one scripted module (Note [Replicating TorchScript
/// modules]). replicate() returns replicas valid until the next call; one caller at a time.
class ScriptReplicator {
 public:
  explicit ScriptReplicator(torch::jit::Module module);
  ~ScriptReplicator();
  ScriptReplicator(const ScriptReplicator&) = delete;
  ScriptReplicator& operator=(const ScriptReplicator&) = delete;

  /// One replica per device. With `detach`, replica tensors carry no autograd history.
  std::vector<torch::jit::Module> replicate(const std::vector<c10::Device>& devices,
                                            bool detach = false);
  /// Drops the cached replica objects: the next replicate() builds them anew.
  void invalidate();
  /// How many times replica objects were built (once per device list and object tree).
  int64_t skeleton_builds() const;
  /// The replicated module.
  const torch::jit::Module& module() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Replicas of the scripted `module`, one per device (Note [Replicating TorchScript modules]),
/// built afresh at each call: keep a ScriptReplicator (or use ScriptDataParallel) to reuse them.
/// Its tensors must be on one device; when that is not devices[0] they are copied to every device.
std::vector<torch::jit::Module> replicate(const torch::jit::Module& module,
                                          const std::vector<c10::Device>& devices,
                                          bool detach = false);

/// Runs `modules[i].forward(inputs[i])` in parallel (parallel_run): a tuple input is unpacked into
/// positional arguments, any other value is the one argument. Output i is moved to devices[i], or
/// without a device list to the device of the first tensor of inputs[i].
///
///   auto replicas = torchdp::replicate(module, devices);
///   auto inputs = torchdp::scatter(c10::IValue(std::make_tuple(x, mask)), devices);
///   auto outputs = torchdp::parallel_apply(replicas, inputs, devices);
///   auto out = torchdp::gather(outputs, devices[0]);
std::vector<c10::IValue> parallel_apply(
    std::vector<torch::jit::Module>& modules, const std::vector<c10::IValue>& inputs,
    const std::optional<std::vector<c10::Device>>& devices = std::nullopt);

/// Data parallelism for a scripted module (torch::jit::load, or a torch::jit::Module built in
/// C++): each forward splits the tensors inside its arguments along `dim` (tuples, lists and dicts
/// of tensors too; other values go to every replica), runs one replica per chunk in parallel and
/// gathers the outputs, of any such structure, on `output_device`. Gradients are summed into the
/// module's parameters, in buckets of `bucket_cap_mb`, as DataParallel's. Options: device_ids,
/// output_device, dim, place_module, bucket_cap_mb; cuda_graphs and process_group are refused.
/// With no device list and no GPU the module is called directly.
///
/// Example::
///
///   auto module = torch::jit::load("model.pt");
///   torchdp::ScriptDataParallel dp(module, torchdp::DataParallelOptions().device_ids(gpus));
///   torch::optim::SGD opt(dp.parameters(), 0.1);
///   auto out = dp.forward({x, mask}).toTuple();  // a tuple of two gathered tensors
class ScriptDataParallel {
 public:
  explicit ScriptDataParallel(torch::jit::Module module, DataParallelOptions options = {});

  /// The data-parallel forward: `inputs` are forward's positional arguments, `kwargs` its
  /// keyword arguments; returns the gathered output.
  c10::IValue forward(std::vector<c10::IValue> inputs,
                      const torch::jit::Kwargs& kwargs = torch::jit::Kwargs());
  /// Same as forward().
  c10::IValue operator()(std::vector<c10::IValue> inputs,
                         const torch::jit::Kwargs& kwargs = torch::jit::Kwargs()) {
    return forward(std::move(inputs), kwargs);
  }
  /// The forward without the gather: one output per replica, on its device.
  std::vector<c10::IValue> forward_replicas(
      std::vector<c10::IValue> inputs, const torch::jit::Kwargs& kwargs = torch::jit::Kwargs());

  /// The wrapped module (its parameters are the ones trained).
  torch::jit::Module& module() {
    return module_;
  }
  const torch::jit::Module& module() const {
    return module_;
  }
  /// The module's distinct parameters, for an optimizer.
  std::vector<at::Tensor> parameters() const;
  /// Sets the module's training flag (the replicas follow at the next forward).
  void train(bool on = true) {
    module_.train(on);
  }
  void eval() {
    module_.eval();
  }
  bool is_training() const {
    return module_.is_training();
  }
  /// The devices in use (empty when forwards call the module directly).
  const std::vector<c10::Device>& device_ids() const {
    return device_ids_;
  }
  /// Where outputs are gathered (nullopt when calling the module directly).
  std::optional<c10::Device> output_device() const {
    return output_device_;
  }
  int64_t dim() const {
    return options_.dim();
  }
  /// The options given at construction.
  const DataParallelOptions& options() const {
    return options_;
  }
  /// The replica cache (skeleton_builds(), invalidate()).
  ScriptReplicator& replicator() {
    return *replicator_;
  }

 private:
  // The per-replica outputs; the buffer copy of Note [Buffers of failed forwards] goes to
  // `buffers` when given (the gather then releases it).
  std::vector<c10::IValue> run(std::vector<c10::IValue> inputs, const torch::jit::Kwargs& kwargs,
                               std::shared_ptr<BufferSnapshot>* buffers);
  // Checks (or with place_module makes) the module's placement on device_ids[0].
  void ensure_placement();

  torch::jit::Module module_;
  DataParallelOptions options_;
  std::unique_ptr<ScriptReplicator> replicator_;
  detail::Step step_{"torchdp::ScriptDataParallel", " (DataParallelOptions::dim)"};
  std::vector<c10::Device> device_ids_;
  std::optional<c10::Device> output_device_;
};

} // namespace torchdp
