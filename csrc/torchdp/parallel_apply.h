#pragma once

#include <torchdp/structure.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchdp {

/// Runs `fn(i)` for i in [0, n) at once with devices[i], the caller's stream of it and thread-local
/// state current: task 0 on the caller, the rest on persistent workers (serially on the caller when
/// nested). Rethrows the lowest index's error as "Caught <type> in replica <i> on device <d>.".
void parallel_run(size_t n, const std::vector<c10::Device>& devices,
                  const std::function<void(size_t)>& fn);

namespace detail {
/// Raises a c10::Error naming `api` under torch.jit.trace (replicas on workers escape the trace)
/// and inside torch.func transforms (the replicas' parameters are not the wrapped tensors).
void check_forward_context(const char* api);
} // namespace detail

/// Thrown by the interruptible parallel_run when `interrupted` returned true.
class Interrupted : public std::exception {
 public:
  const char* what() const noexcept override {
    return "torchdp::parallel_run: interrupted while waiting for the replicas";
  }
};

/// parallel_run whose wait polls `interrupted()` every `poll_ms` ms and throws Interrupted once it
/// returns true, leaving running tasks to finish alone (Note [Interruptible waits]). Tasks may
/// outlive the call, so `fn` must own everything it uses.
void parallel_run(size_t n, const std::vector<c10::Device>& devices,
                  const std::function<void(size_t)>& fn, const std::function<bool()>& interrupted,
                  int poll_ms = 50);

/// Like torch::nn::parallel::parallel_apply: runs modules[i]->forward(inputs[i]) via parallel_run;
/// output i is moved to devices[i], or to the device of inputs[i] without a device list.
template <typename ModuleType>
std::vector<at::Tensor> parallel_apply(
    std::vector<ModuleType>& modules, const std::vector<at::Tensor>& inputs,
    const std::optional<std::vector<c10::Device>>& devices = std::nullopt) {
  TORCH_CHECK(modules.size() == inputs.size(), "torchdp::parallel_apply: got ", modules.size(),
              " modules but ", inputs.size(), " inputs; pass one input per module");
  if (devices) {
    TORCH_CHECK(modules.size() == devices->size(), "torchdp::parallel_apply: got ", modules.size(),
                " modules but ", devices->size(), " devices; pass one device per module");
  }
  std::vector<c10::Device> where;
  where.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    where.push_back(devices ? (*devices)[i] : inputs[i].device());
  }
  std::vector<at::Tensor> outputs(modules.size());
  parallel_run(modules.size(), where, [&](size_t i) {
    outputs[i] = modules[i]->forward(inputs[i]).to(where[i]);
  });
  return outputs;
}

/// Several arguments per module: runs `std::apply(modules[i]->forward, inputs[i])` via
/// parallel_run, as scatter() of a tuple gives them. Outputs whose type the structure engine knows
/// (tensors, and std::vector, std::tuple, c10::Dict... of tensors) have their tensors moved to
/// devices[i], or to the device of the first tensor of inputs[i] without a device list.
///
///   auto parts = torchdp::scatter(std::make_tuple(x, y), devices);
///   auto outputs = torchdp::parallel_apply(replicas, parts, devices);  // a vector of forward's
///   type
template <typename ModuleType, typename... Args>
auto parallel_apply(std::vector<ModuleType>& modules,
                    const std::vector<std::tuple<Args...>>& inputs,
                    const std::optional<std::vector<c10::Device>>& devices = std::nullopt) {
  using Output = std::decay_t<decltype(modules[0]->forward(std::declval<const Args&>()...))>;
  constexpr const char* api = "torchdp::parallel_apply";
  TORCH_CHECK(modules.size() == inputs.size(), api, ": got ", modules.size(), " modules but ",
              inputs.size(), " inputs; pass one input per module");
  if (devices) {
    TORCH_CHECK(modules.size() == devices->size(), api, ": got ", modules.size(), " modules but ",
                devices->size(), " devices; pass one device per module");
  }
  std::vector<c10::Device> where;
  where.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (devices) {
      where.push_back((*devices)[i]);
      continue;
    }
    std::optional<c10::Device> found;
    if constexpr (detail::IsStructure<std::tuple<Args...>>::value) {
      const auto tensors = detail::tensors_of(c10::IValue(inputs[i]));
      if (!tensors.empty()) {
        found = tensors.front().device();
      }
    }
    TORCH_CHECK(found.has_value(), api, ": input ", i,
                " holds no tensor to take the replica's device from; pass the devices");
    where.push_back(*found);
  }
  std::vector<std::optional<Output>> results(modules.size());
  parallel_run(modules.size(), where, [&](size_t i) {
    auto out = std::apply(
        [&](const Args&... a) {
          return modules[i]->forward(a...);
        },
        inputs[i]);
    if constexpr (detail::IsStructure<Output>::value) {
      results[i] = detail::to_device(c10::IValue(std::move(out)), where[i], api,
                                     detail::ValueNames{"the output", false})
                       .template to<Output>();
    } else {
      results[i] = std::move(out);
    }
  });
  std::vector<Output> outputs;
  outputs.reserve(results.size());
  for (auto& r : results) {
    outputs.push_back(std::move(*r));
  }
  return outputs;
}

} // namespace torchdp
