#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <optional>
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

} // namespace torchdp
