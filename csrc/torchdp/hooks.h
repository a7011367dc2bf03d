#pragma once

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <c10/util/Type.h>

#include <any>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace torchdp {

/// State shared by the copies of one module position during one replicate call (SyncBatchNorm's
/// `ctx` convention): replica 0 sees it first and can leave values for the others.
class ReplicaContext {
 public:
  ReplicaContext(std::string path, std::vector<c10::Device> devices)
      : path_(std::move(path)), devices_(std::move(devices)) {}

  /// Qualified name of the module position ("" for the root, "features.0" for a child).
  const std::string& path() const {
    return path_;
  }
  /// The replica devices of this call; index i is replica i's device.
  const std::vector<c10::Device>& devices() const {
    return devices_;
  }
  /// Named values shared between the copies, e.g. `ctx.values["master"] = ...`.
  std::map<std::string, std::any> values;

 private:
  std::string path_;
  std::vector<c10::Device> devices_;
};

/// A post-replicate hook: called per replica of each matching module, replica 0 first.
using PostReplicateHook =
    std::function<void(torch::nn::Module& replica, const torch::nn::Module& original,
                       c10::Device device, int64_t replica_index, ReplicaContext& ctx)>;

/// Returned by register_post_replicate_hook; dropping it keeps the hook (as RemovableHandle).
class PostReplicateHookHandle {
 public:
  PostReplicateHookHandle() = default;
  explicit PostReplicateHookHandle(uint64_t id) : id_(id) {}
  /// Unregisters the hook. Calling it again does nothing.
  void remove();
  /// True while the hook is registered.
  bool active() const;
  uint64_t id() const {
    return id_;
  }

 private:
  uint64_t id_ = 0;
};

namespace detail {

/// One registered hook.
struct HookEntry {
  std::string description; // e.g. "post-replicate hook #3 (type MaskedLinearImpl)"
  std::function<bool(const torch::nn::Module&)> matches;
  PostReplicateHook fn;
  // Instance hooks: the module, whose death unregisters the hook (at the next lookup).
  std::optional<std::weak_ptr<torch::nn::Module>> instance;
};

PostReplicateHookHandle register_type_hook(std::string type_name,
                                           std::function<bool(const torch::nn::Module&)> matches,
                                           PostReplicateHook fn);
PostReplicateHookHandle register_instance_hook(const std::shared_ptr<torch::nn::Module>& module,
                                               PostReplicateHook fn);

/// The hooks that apply to `original`, in registration order.
std::vector<std::shared_ptr<const HookEntry>> hooks_for(const torch::nn::Module& original);

/// True when no hook is registered at all (lets replicate skip the per-module lookups).
bool no_hooks_registered();

// The Impl class of a module type given as Impl or as a holder (ModuleHolder's ContainedType).
template <typename T, typename = void>
struct contained {
  using type = T;
};
template <typename T>
struct contained<T, std::void_t<typename T::ContainedType>> {
  using type = typename T::ContainedType;
};

template <typename ModuleType, typename Fn>
PostReplicateHook typed(Fn fn) {
  if constexpr (std::is_constructible_v<bool, const Fn&>) {
    if (!static_cast<bool>(fn)) {
      return {}; // an empty std::function or a null pointer: rejected at registration
    }
  }
  return [fn = std::move(fn)](torch::nn::Module& replica, const torch::nn::Module& original,
                              c10::Device device, int64_t index, ReplicaContext& ctx) {
    fn(dynamic_cast<ModuleType&>(replica), dynamic_cast<const ModuleType&>(original), device, index,
       ctx);
  };
}

} // namespace detail

/// Registers `fn` for every `ModuleType` (Impl or holder, subclasses included), called as
/// `fn(ModuleType& replica, const ModuleType& original, c10::Device device, int64_t replica_index,
/// torchdp::ReplicaContext& ctx)`.
template <typename ModuleType, typename Fn>
PostReplicateHookHandle register_post_replicate_hook(Fn fn) {
  using Impl = typename detail::contained<std::decay_t<ModuleType>>::type;
  static_assert(
      std::is_base_of_v<torch::nn::Module, Impl>,
      "register_post_replicate_hook<T>: T must be a torch::nn::Module subclass or holder");
  return detail::register_type_hook(
      c10::demangle(typeid(Impl).name()),
      [](const torch::nn::Module& m) {
        return dynamic_cast<const Impl*>(&m) != nullptr;
      },
      detail::typed<Impl>(std::move(fn)));
}

/// Registers `hook` for one module instance (its replicas only).
inline PostReplicateHookHandle register_post_replicate_hook(
    const std::shared_ptr<torch::nn::Module>& module, PostReplicateHook hook) {
  return detail::register_instance_hook(module, std::move(hook));
}

/// Registers a typed hook for one module instance, given as a shared_ptr or a holder.
template <typename ModuleType, typename Fn>
PostReplicateHookHandle register_post_replicate_hook(const std::shared_ptr<ModuleType>& module,
                                                     Fn fn) {
  return detail::register_instance_hook(module, detail::typed<ModuleType>(std::move(fn)));
}
template <typename ModuleType, typename Fn>
PostReplicateHookHandle register_post_replicate_hook(
    const torch::nn::ModuleHolder<ModuleType>& module, Fn fn) {
  return detail::register_instance_hook(module.ptr(), detail::typed<ModuleType>(std::move(fn)));
}

namespace detail {
/// A registered tensor found on the wrong device.
struct Misplaced {
  std::string name;        // qualified name, e.g. "masked.mask"
  std::string module_path; // qualified module name ("" for the root)
  std::string module_type;
  const char* kind; // "parameter" or "buffer"
  c10::Device device;
};
/// The first registered parameter or buffer of `module` (pre-order) not on `expected`.
std::optional<Misplaced> find_misplaced(const torch::nn::Module& module, c10::Device expected);
} // namespace detail

/// Raises a c10::Error naming the first tensor of `replica` not on `device`, and the fix.
void check_replica_devices(const torch::nn::Module& replica, c10::Device device,
                           int64_t replica_index, const char* api);

} // namespace torchdp
