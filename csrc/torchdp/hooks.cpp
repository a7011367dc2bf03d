#include <torchdp/devices.h>
#include <torchdp/hooks.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace torchdp {
namespace detail {
namespace {

struct Registry {
  std::mutex mutex;
  uint64_t next_id = 1;
  // Ordered by id, i.e. by registration order.
  std::map<uint64_t, std::shared_ptr<const HookEntry>> hooks;
  std::atomic<size_t> count{0};
};

Registry& registry() {
  // Leaked on purpose: hooks may be removed from static destructors of other translation units.
  static auto* r = new Registry();
  return *r;
}

PostReplicateHookHandle add(
    std::string description_suffix, std::function<bool(const torch::nn::Module&)> matches,
    PostReplicateHook fn, std::optional<std::weak_ptr<torch::nn::Module>> instance = std::nullopt) {
  TORCH_CHECK(static_cast<bool>(fn), "torchdp::register_post_replicate_hook: the hook is empty; ",
              "pass a callable");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto id = r.next_id++;
  auto entry = std::make_shared<HookEntry>();
  entry->description =
      "post-replicate hook #" + std::to_string(id) + " (" + description_suffix + ")";
  entry->matches = std::move(matches);
  entry->fn = std::move(fn);
  entry->instance = std::move(instance);
  r.hooks.emplace(id, std::move(entry));
  r.count = r.hooks.size();
  return PostReplicateHookHandle(id);
}

} // namespace

PostReplicateHookHandle register_type_hook(std::string type_name,
                                           std::function<bool(const torch::nn::Module&)> matches,
                                           PostReplicateHook fn) {
  return add("for type " + type_name, std::move(matches), std::move(fn));
}

PostReplicateHookHandle register_instance_hook(const std::shared_ptr<torch::nn::Module>& module,
                                               PostReplicateHook fn) {
  TORCH_CHECK(module != nullptr,
              "torchdp::register_post_replicate_hook: the module instance is null");
  std::weak_ptr<torch::nn::Module> weak = module;
  const torch::nn::Module* raw = module.get();
  return add(
      "for instance of " + module->name(),
      [weak, raw](const torch::nn::Module& m) {
        // The weak_ptr guards against a new module at a destroyed one's address.
        if (&m != raw) {
          return false;
        }
        auto alive = weak.lock();
        return alive.get() == raw;
      },
      std::move(fn), weak);
}

namespace {
// Drops the hooks of module instances that died (the registry's lock held).
void purge_dead_instances(Registry& r) {
  for (auto it = r.hooks.begin(); it != r.hooks.end();) {
    const auto& instance = it->second->instance;
    it = instance && instance->expired() ? r.hooks.erase(it) : std::next(it);
  }
  r.count = r.hooks.size();
}
} // namespace

std::vector<std::shared_ptr<const HookEntry>> hooks_for(const torch::nn::Module& original) {
  auto& r = registry();
  std::vector<std::shared_ptr<const HookEntry>> entries;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    purge_dead_instances(r);
    entries.reserve(r.hooks.size());
    for (const auto& kv : r.hooks) {
      entries.push_back(kv.second);
    }
  }
  std::vector<std::shared_ptr<const HookEntry>> matching;
  for (auto& e : entries) {
    if (e->matches(original)) {
      matching.push_back(std::move(e));
    }
  }
  return matching;
}

bool no_hooks_registered() {
  auto& r = registry();
  if (r.count.load() == 0) {
    return true;
  }
  // Only instance hooks of modules that died left: drop them.
  std::lock_guard<std::mutex> lock(r.mutex);
  purge_dead_instances(r);
  return r.hooks.empty();
}

} // namespace detail

void PostReplicateHookHandle::remove() {
  if (id_ == 0) {
    return;
  }
  auto& r = detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.hooks.erase(id_);
  r.count = r.hooks.size();
}

bool PostReplicateHookHandle::active() const {
  if (id_ == 0) {
    return false;
  }
  auto& r = detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  detail::purge_dead_instances(r);
  return r.hooks.count(id_) != 0;
}

namespace detail {
namespace {
bool find_in(const torch::nn::Module& module, const std::string& path, c10::Device expected,
             std::optional<Misplaced>& found) {
  auto visit = [&](const std::string& key, const at::Tensor& t, const char* kind) {
    if (!t.defined() || canonical(t.device()) == expected) {
      return false;
    }
    found = Misplaced{path.empty() ? key : path + "." + key, path, module.name(), kind, t.device()};
    return true;
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (visit(p.key(), p.value(), "parameter")) {
      return true;
    }
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    if (visit(b.key(), b.value(), "buffer")) {
      return true;
    }
  }
  for (const auto& c : module.named_children()) {
    if (find_in(*c.value(), path.empty() ? c.key() : path + "." + c.key(), expected, found)) {
      return true;
    }
  }
  return false;
}
} // namespace

std::optional<Misplaced> find_misplaced(const torch::nn::Module& module, c10::Device expected) {
  std::optional<Misplaced> found;
  find_in(module, "", canonical(expected), found);
  return found;
}
} // namespace detail

void check_replica_devices(const torch::nn::Module& replica, c10::Device device,
                           int64_t replica_index, const char* api) {
  const auto expected = detail::canonical(device);
  const auto bad = detail::find_misplaced(replica, expected);
  TORCH_CHECK(!bad, api, ": replica ", replica_index, " must live on ", expected, ", but its ",
              bad->kind, " '", bad->name, "' (module ",
              bad->module_path.empty() ? "<root>" : bad->module_path, ", type ", bad->module_type,
              ") is on ", bad->device,
              ". A post-replicate hook (or the module's own code) put it there; register a hook "
              "with torchdp::register_post_replicate_hook that places it on the replica's device "
              "(the `device` argument), e.g. `t = t.to(device)`");
}

} // namespace torchdp
