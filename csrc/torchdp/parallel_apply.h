#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <optional>
#include <vector>

namespace torchdp {

/// Runs `fn(i)` for i in [0, n), each on its own worker with devices[i] as the current device and
/// the caller's current stream of devices[i] as the current stream. Task 0 runs on the calling
/// thread, the others on persistent worker threads, reused from call to call: every task starts
/// at once on a worker of its own, so the tasks of one call run at the same time whatever other
/// threads call concurrently (tasks may wait for each other). A forked child starts new workers.
/// The caller's thread-local state (grad mode, inference mode, autocast enabled flags and dtypes,
/// autocast cache flag, profiler state) is carried into every worker.
///
/// When tasks throw, the exception of the lowest index is rethrown after all tasks finished, as a
/// c10::Error of the same class when it is one (IndexError, ValueError, ...) and a c10::Error
/// otherwise, with the message "Caught <type> in replica <i> on device <d>.\n<original message>".
/// Called from inside a worker (nested data parallelism), the tasks run one after the other on the
/// calling thread instead.
void parallel_run(size_t n, const std::vector<c10::Device>& devices,
                  const std::function<void(size_t)>& fn);

namespace detail {
/// Raises a c10::Error naming `api` where a data-parallel forward cannot run correctly: while
/// torch.jit.trace records the calling thread (replicas on workers would be missing from the
/// trace), and inside a torch.func transform (vmap, grad, jacrev: the replicas' copies of the
/// parameters are not the tensors the transform wraps). parallel_run checks it too.
void check_forward_context(const char* api);
} // namespace detail

/// Thrown by the interruptible parallel_run when `interrupted` returned true.
class Interrupted : public std::exception {
 public:
  const char* what() const noexcept override {
    return "torchdp::parallel_run: interrupted while waiting for the replicas";
  }
};

/// parallel_run whose wait can be cut short (Note [Interruptible waits]): while the calling
/// thread waits for the workers (after task 0), it calls `interrupted()` every `poll_ms`
/// milliseconds; when that returns true, it throws Interrupted at once, without waiting for the
/// tasks still running. Those tasks finish later on their own (their errors are dropped); the next
/// call runs on other workers, so it does not queue behind them.
/// Because tasks may outlive the call, `fn` must own everything it uses (no references to the
/// caller's stack). When `interrupted` never returns true this behaves as parallel_run.
void parallel_run(size_t n, const std::vector<c10::Device>& devices,
                  const std::function<void(size_t)>& fn, const std::function<bool()>& interrupted,
                  int poll_ms = 50);

/// Like torch::nn::parallel::parallel_apply: runs modules[i]->forward(inputs[i]) for every i in
/// parallel (see parallel_run) and returns the outputs, output i moved to devices[i] (or to the
/// device of inputs[i] when no device list is given).
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
