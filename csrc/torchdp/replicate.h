#pragma once

#include <torchdp/hooks.h>

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <vector>

namespace torchdp {

// Note [Replicating Modules]
// LibTorch's replicate deep-clones the module per device and call. torchdp clones a skeleton per
// replica once; each call broadcasts the original's tensors, rebinds each replica tensor *in place*
// (C++ modules read tensors through member fields sharing the TensorImpl), runs the hooks and
// checks devices. Structure or training-flag changes rebuild the skeletons; shared tensors stay
// shared. Replica 0 shares storage and version counters with the original, never written.

/// Builds and refreshes the replicas of one module (Note [Replicating Modules]). replicate()
/// returns the same objects each call, valid until the next; one caller at a time.
class Replicator {
 public:
  /// Makes one new skeleton copy of the module; defaults to `module->clone()`.
  using CloneFn = std::function<std::shared_ptr<torch::nn::Module>()>;

  explicit Replicator(std::shared_ptr<torch::nn::Module> module, CloneFn clone = nullptr);
  ~Replicator();
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;

  /// One replica per device. With `detach`, replica tensors carry no autograd history.
  std::vector<std::shared_ptr<torch::nn::Module>> replicate(const std::vector<c10::Device>& devices,
                                                            bool detach = false);
  /// Drops the cached skeletons: the next replicate() builds them anew.
  void invalidate();
  /// How many times skeletons were built (once per device list, plus once per invalidation).
  int64_t skeleton_builds() const;
  /// The replicated module (null once it was destroyed: a Replicator does not keep it alive).
  std::shared_ptr<torch::nn::Module> module() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Replicas of `module`, one per device (Note [Replicating Modules]); it and its submodules must be
/// Cloneable. Cached per module and device list: the previous call's replicas are refreshed and
/// returned again. Tensors not on devices[0] are copied to every device.
std::vector<std::shared_ptr<torch::nn::Module>> replicate(
    const std::shared_ptr<torch::nn::Module>& module, const std::vector<c10::Device>& devices,
    bool detach = false);

/// Drops the skeletons replicate() and data_parallel() cache per module, which hold the last copies
/// and the module's parameters (a destroyed module's entry goes only at the next call otherwise).
void clear_replica_cache();

/// Typed form: the replicas as the module's own type.
template <typename ModuleType,
          typename = std::enable_if_t<!std::is_same_v<ModuleType, torch::nn::Module>>>
std::vector<std::shared_ptr<ModuleType>> replicate(const std::shared_ptr<ModuleType>& module,
                                                   const std::vector<c10::Device>& devices,
                                                   bool detach = false) {
  auto replicas = replicate(std::static_pointer_cast<torch::nn::Module>(module), devices, detach);
  std::vector<std::shared_ptr<ModuleType>> typed;
  typed.reserve(replicas.size());
  for (auto& r : replicas) {
    typed.push_back(std::dynamic_pointer_cast<ModuleType>(r));
  }
  return typed;
}

/// Holder form: `torchdp::replicate(torch::nn::Linear(3, 4), devices)`.
template <typename ModuleType>
std::vector<torch::nn::ModuleHolder<ModuleType>> replicate(
    const torch::nn::ModuleHolder<ModuleType>& module, const std::vector<c10::Device>& devices,
    bool detach = false) {
  auto ptrs = replicate(module.ptr(), devices, detach);
  return std::vector<torch::nn::ModuleHolder<ModuleType>>(ptrs.begin(), ptrs.end());
}

// Note [Buffers of failed forwards]
// Replica 0 shares storage with the original, so a forward updating a buffer in place (BatchNorm's
// statistics) and then failing elsewhere would leave that update. DataParallel and data_parallel
// copy the buffers (not the parameters) before replicating and copy them back when hooks, forward
// or gather fail (version counters cannot tell: BatchNorm does not bump them). restore() writes
// nothing when another forward used the tensors since take(): a successful update is never lost.

/// A copy of some tensors that can be written back (Note [Buffers of failed forwards]). Skips
/// undefined, meta, sparse and self-overlapping ones; taking the same ones again allocates nothing.
class BufferSnapshot {
 public:
  BufferSnapshot() = default;
  explicit BufferSnapshot(const std::vector<at::Tensor>& tensors) {
    take(tensors);
  }
  ~BufferSnapshot() {
    release();
  }
  BufferSnapshot(const BufferSnapshot&) = delete;
  BufferSnapshot& operator=(const BufferSnapshot&) = delete;
  /// Copies `tensors` at the start of a forward, marking them used by it until release().
  void take(const std::vector<at::Tensor>& tensors);
  /// Writes the copy back; returns how many (0, warning once, when another forward intervened).
  size_t restore();
  /// Ends the forward's use of its tensors (also done by take() and the destructor).
  void release();
  /// How many tensors the snapshot holds.
  size_t size() const {
    return tensors_.size();
  }
  /// The id of the forward it was taken for (0 when not taken); while that forward runs its
  /// replicas, detail::EnclosingForwardGuard makes it theirs (Note [Nested forwards]).
  uint64_t take_id() const {
    return take_id_;
  }

 private:
  struct Group { // the tensors of one device and dtype
    std::vector<at::Tensor> sources, copies;
  };
  std::vector<at::Tensor> tensors_, copies_;
  std::vector<Group> groups_;
  uint64_t take_id_ = 0;    // 0: not registered
  bool overlapped_ = false; // another forward used the tensors when this one was taken
};

namespace detail {
/// The distinct tensors of `all` (by TensorImpl), in order of first appearance; `index`, when
/// given, gets for each of `all` the position of its tensor among them.
std::vector<at::Tensor> distinct(const std::vector<at::Tensor>& all,
                                 std::vector<size_t>* index = nullptr);
/// module->to(device) in place, also between backends set_data() refuses to mix (cpu and meta).
/// Parameters stay the same tensors (and leaves); their gradients move along.
void move_module(torch::nn::Module& module, c10::Device device);
} // namespace detail

} // namespace torchdp
