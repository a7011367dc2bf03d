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
// LibTorch's torch::nn::parallel::replicate deep-clones the module for every device on every call:
// clone() runs reset(), which re-initialises every parameter, and then copies the values over. That
// is what makes its data_parallel slower than one GPU. torchdp instead keeps a *skeleton* per
// replica, built once with clone(), and on every call only
//   1. broadcasts the original's parameters and buffers to the devices
//      (autograd::broadcast_coalesced, coalesced; buffers that do not require grad, and everything
//      in detach mode, without history),
//   2. rebinds each registered tensor of each replica *in place* to its device's copy: the
//      replica's TensorImpl takes the copy's storage, metadata and version counter, and its
//      gradient edge points at the broadcast node. Rebinding in place matters: a C++ module reads its tensors
//      through member fields (LinearImpl::weight) that share the TensorImpl with the parameter
//      registry.
//   3. runs the post-replicate hooks (replica 0 first), then checks every replica tensor's device.
// The replica on devices[0] shares storage and version counter with the original, so in-place
// buffer updates there (BatchNorm running statistics) land in the original; gradients of all
// replicas are reduce-added into the original parameters' .grad. Parameters and submodules shared
// inside the original are broadcast once and stay shared. The skeleton is rebuilt when the module's
// structure (submodules, parameter and buffer names) or any training flag changes. The original's
// tensors are never written.

/// Builds and refreshes the replicas of one module (see Note [Replicating Modules]).
///
/// The replicas returned by replicate() are the same objects from call to call, refreshed in place:
/// they are valid until the next call. One Replicator serves one caller at a time.
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

/// Replicas of `module`, one per device (see Note [Replicating Modules]). A module whose tensors
/// are not on devices[0] is copied to every device (then no replica shares storage with it). The
/// module and all its submodules must be Cloneable. Skeletons are cached per module and device
/// list, so the replicas of the previous call of the same module are refreshed and returned again.
std::vector<std::shared_ptr<torch::nn::Module>> replicate(
    const std::shared_ptr<torch::nn::Module>& module, const std::vector<c10::Device>& devices,
    bool detach = false);

/// Drops the replica skeletons that replicate() and data_parallel() cache per module. They hold
/// the last call's copies on every device and, through their autograd edges, the module's own
/// parameters; a destroyed module's entry is otherwise dropped only at the next replicate() or
/// data_parallel() call. (torchdp::DataParallel keeps its own skeletons, freed with it.)
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
// The replica on devices[0] shares storage and version counter with the original, so a forward
// that updates a buffer in place there (BatchNorm's running statistics, spectral norm's vectors, a
// counter) updates the original. When the forward then fails on another replica (a chunk too
// small for BatchNorm, out of memory on one device, a shape error), the original would be left
// with one replica's update of a step that never happened. DataParallel and data_parallel (C++ and
// Python) therefore copy the original's buffers before replicating and, when the forward, the
// replication's hooks or the gather fail, copy all of them back. Version counters cannot tell which
// changed: BatchNorm's kernels update the running statistics without bumping them. The copy is
// kept from step to step and refreshed in place, one _foreach_copy_ per device and dtype, taken
// from the walk that replication makes anyway: in C++ from the placement check's, in Python inside
// the kept-replica cache's replicate (ReplicaCache), which hands it to the forward through a
// thread-local slot (python/torchdp/replicate.py). Paths without
// a cache (cache_replicas=False, the functional C++ data_parallel) walk and copy anew each call.
// Parameters are not copied: changing them in place inside a forward is rare and copying them every
// step would cost a model's worth of memory traffic.
// A failed forward undoes only its own changes: a snapshot is registered on its tensors from
// take() to release(), and restore() writes nothing back when another forward used any of them
// meanwhile (running when the snapshot was taken, or started since): their updates cannot be told
// apart from this forward's, and a successful forward's update is never to be lost. It warns once.

/// A copy of some tensors that can be written back into them. Undefined and meta tensors (no data),
/// tensors whose elements overlap (expanded ones: no in-place write can change them) and sparse
/// ones are skipped, and a tensor listed twice is copied once. A snapshot can be taken again: when
/// the tensors are the same as last time, their copies are refreshed in place (one _foreach_copy_
/// per device and dtype), so a snapshot kept from step to step costs no allocation. See Note
/// [Buffers of failed forwards].
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
  /// Copies `tensors` (replacing what the snapshot held) at the start of a forward, and marks
  /// them as used by that forward until release().
  void take(const std::vector<at::Tensor>& tensors);
  /// Writes the copy back into the tensors; returns how many. Writes nothing (returns 0, and
  /// warns once) when another snapshot's forward used the same tensors since this one was taken.
  size_t restore();
  /// Ends the forward: its tensors are no longer marked as used by it (also done by take() and
  /// the destructor).
  void release();
  /// How many tensors the snapshot holds.
  size_t size() const {
    return tensors_.size();
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
/// Moves every registered parameter and buffer of `module` (recursively) to `device` in place, as
/// module->to(device) does, but also between backends whose tensors Tensor::set_data() refuses to
/// mix (cpu and meta). Parameters stay the same tensors (and leaves); their gradients move along.
void move_module(torch::nn::Module& module, c10::Device device);
} // namespace detail

} // namespace torchdp
