#include <torchdp/autograd.h>
#include <torchdp/comm.h>
#include <torchdp/devices.h>
#include <torchdp/enclosing_forward.h>
#include <torchdp/errors.h>
#include <torchdp/profiling.h>
#include <torchdp/replica_sets.h>
#include <torchdp/replicate.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

namespace torchdp {
namespace {

constexpr const char* kApi = "torchdp::replicate";

using torch::nn::Module;

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

std::string where(const std::string& path) {
  return path.empty() ? std::string("<root>") : path;
}

// One module position of the original, in pre-order (children in registration order).
struct Position {
  std::string path;
  Module* original;
  bool first; // first occurrence of this module object (shared submodules appear again later)
};

// One registered parameter or buffer of one position.
struct SlotSpec {
  size_t position;
  std::string name;
  bool is_param;
};

// One walk over the original; `signature` (structure and training flags) keys the skeletons.
struct Walk {
  std::vector<Position> positions;
  std::vector<SlotSpec> specs;
  std::vector<at::Tensor> tensors; // aligned with specs; undefined where the module registered none
  std::string signature;
};

void walk(Module& m, const std::string& path, Walk& w, std::unordered_set<const Module*>& seen) {
  const size_t pos = w.positions.size();
  w.positions.push_back(Position{path, &m, seen.insert(&m).second});
  w.signature += path;
  w.signature += '|';
  w.signature += std::to_string(reinterpret_cast<uintptr_t>(&m));
  // The type too: a new module of another type at a freed address must not get the old skeleton.
  w.signature += typeid(m).name();
  w.signature += m.is_training() ? "T" : "E";
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    w.specs.push_back(SlotSpec{pos, p.key(), true});
    w.tensors.push_back(p.value());
    w.signature += ";p:" + p.key() + (p.value().defined() ? "" : "!");
  }
  for (const auto& b : m.named_buffers(/*recurse=*/false)) {
    w.specs.push_back(SlotSpec{pos, b.key(), false});
    w.tensors.push_back(b.value());
    w.signature += ";b:" + b.key() + (b.value().defined() ? "" : "!");
  }
  w.signature += '\n';
  for (const auto& c : m.named_children()) {
    walk(*c.value(), join(path, c.key()), w, seen);
  }
}

// One skeleton per device, aligned with the original's positions and slots.
struct ReplicaSet {
  std::vector<c10::Device> devices;
  std::string signature;
  std::vector<std::shared_ptr<Module>> roots;
  std::vector<std::vector<Module*>> modules;  // [replica][position]
  std::vector<std::vector<at::Tensor>> slots; // [replica][spec]: the replica's registered tensors
};

void align(const Module& original, Module& replica, const std::string& path,
           std::vector<Module*>& out) {
  // A class derived from a Cloneable<Base> inherits its clone(): replicas would run Base's forward.
  TORCH_CHECK(typeid(replica) == typeid(original), kApi, ": the clone() of module '", where(path),
              "' (type ", c10::demangle(typeid(original).name()), ") is a ",
              c10::demangle(typeid(replica).name()),
              ": a class derived from a Cloneable module inherits its base's clone(), which builds "
              "the base class. Derive it from torch::nn::Cloneable<",
              c10::demangle(typeid(original).name()), "> itself, or override clone()");
  out.push_back(&replica);
  const auto replica_children = replica.named_children();
  for (const auto& c : original.named_children()) {
    const auto* found = replica_children.find(c.key());
    TORCH_CHECK(found != nullptr, kApi, ": the clone() of module '", where(path), "' (type ",
                original.name(), ") has no submodule '", c.key(),
                "'; clone() must reproduce every registered submodule (register it in reset())");
    // Sequential and AnyModule cast a cloned child to its type: null if its clone() built a base.
    TORCH_CHECK(*found != nullptr, kApi, ": the clone() of module '", where(join(path, c.key())),
                "' (type ", c10::demangle(typeid(*c.value()).name()),
                ") is null: a class derived from a Cloneable module inherits its base's clone(), "
                "which builds the base class. Derive it from torch::nn::Cloneable<",
                c10::demangle(typeid(*c.value()).name()), "> itself, or override clone()");
    align(*c.value(), **found, join(path, c.key()), out);
  }
}

// Keeps the default CPU generator's state: clone() runs reset(), which draws initial values that
// are overwritten at once, and building replicas must not move the caller's random stream.
class CpuRngGuard {
 public:
  CpuRngGuard() : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    state_ = gen_.get_state();
  }
  ~CpuRngGuard() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }
  CpuRngGuard(const CpuRngGuard&) = delete;
  CpuRngGuard& operator=(const CpuRngGuard&) = delete;

 private:
  at::Generator gen_;
  at::Tensor state_;
};

std::shared_ptr<Module> clone_skeleton(const Replicator::CloneFn& clone, const Module& original) {
  try {
    const CpuRngGuard keep_rng;
    auto copy = clone();
    TORCH_CHECK(copy != nullptr, "clone() returned null");
    return copy;
  } catch (const std::exception& e) {
    const auto* c10e = dynamic_cast<const c10::Error*>(&e);
    const std::string message = c10e != nullptr ? c10e->what_without_backtrace() : e.what();
    const bool meta = message.find("incompatible tensor type") != std::string::npos;
    TORCH_CHECK(false, kApi, ": cannot replicate module of type ", original.name(),
                ": building a replica with clone() failed: ", message,
                meta ? "\nLibTorch's Cloneable::clone() cannot copy a module whose tensors live on "
                       "the meta device; keep the module on cpu or cuda (replicas may live on meta)"
                     : "",
                "\ntorchdp builds each replica once with clone(): derive the module and each of "
                "its submodules from torch::nn::Cloneable<YourImpl> and implement reset(), which "
                "must register every parameter, buffer and submodule");
  }
}

ReplicaSet build(const Walk& w, const std::vector<c10::Device>& devices,
                 const Replicator::CloneFn& clone, const Module& original) {
  ReplicaSet set;
  set.devices = devices;
  set.signature = w.signature;
  const size_t n = devices.size();
  set.roots.reserve(n);
  set.modules.resize(n);
  set.slots.resize(n);
  for (const auto j : c10::irange(n)) {
    auto root = clone_skeleton(clone, original);
    auto& modules = set.modules[j];
    modules.reserve(w.positions.size());
    align(original, *root, "", modules);
    auto& slots = set.slots[j];
    slots.resize(w.specs.size());
    size_t s = 0;
    while (s < w.specs.size()) {
      const size_t pos = w.specs[s].position;
      Module& rep = *modules[pos];
      const auto params = rep.named_parameters(/*recurse=*/false);
      const auto buffers = rep.named_buffers(/*recurse=*/false);
      for (; s < w.specs.size() && w.specs[s].position == pos; ++s) {
        const auto& spec = w.specs[s];
        const auto* found = spec.is_param ? params.find(spec.name) : buffers.find(spec.name);
        TORCH_CHECK(found != nullptr, kApi, ": the clone() of module '",
                    where(w.positions[pos].path), "' (type ", rep.name(), ") has no ",
                    spec.is_param ? "parameter '" : "buffer '", spec.name,
                    "'; clone() must reproduce every registered tensor (register it in reset())");
        TORCH_CHECK(found->defined() == w.tensors[s].defined(), kApi, ": the clone() of module '",
                    where(w.positions[pos].path), "' registers ",
                    spec.is_param ? "parameter '" : "buffer '", spec.name, "' as ",
                    found->defined() ? "a tensor" : "undefined", " but the original has it ",
                    w.tensors[s].defined() ? "defined" : "undefined");
        auto& slot = slots[s];
        slot = *found;
        if (slot.defined()) {
          if (slot.is_leaf() && slot.requires_grad()) {
            slot.set_requires_grad(false);
          }
          // Freed now, replaced at the first rebind: n skeletons never hold n copies of the module.
          slot.unsafeGetTensorImpl()->shallow_copy_from(
              at::empty({0}, slot.options()).getIntrusivePtr());
        }
      }
    }
    // Training flags: pre-order, so each module ends with its own original's flag.
    for (const auto p : c10::irange(w.positions.size())) {
      modules[p]->train(w.positions[p].original->is_training());
    }
    set.roots.push_back(std::move(root));
  }
  return set;
}

// Note [Rebinding a replica tensor]
// The replica's TensorImpl takes the value's storage and metadata (set_data minus its same-backend
// check, so a CPU skeleton can take a meta or CUDA copy), its version counter (autograd checks on
// the original see replica 0's in-place updates) and its gradient edge.
void assign_data(const at::Tensor& slot, const at::Tensor& value) {
  TORCH_CHECK(value.layout() == c10::kStrided && slot.layout() == c10::kStrided, kApi,
              ": only strided (dense) parameters and buffers can be replicated, got layout ",
              value.layout());
  if (auto* meta = torch::autograd::impl::get_autograd_meta(slot)) {
    meta->grad_accumulator_.reset();
  }
  slot.unsafeGetTensorImpl()->shallow_copy_from(value.getIntrusivePtr());
}

void rebind(at::Tensor& slot, const at::Tensor& value) {
  assign_data(slot, value);
  slot.unsafeGetTensorImpl()->set_version_counter(value.unsafeGetTensorImpl()->version_counter());
  if (value.grad_fn()) {
    torch::autograd::impl::set_gradient_edge(
        slot, torch::autograd::Edge(value.grad_fn(), value.output_nr()));
  } else if (slot.grad_fn()) {
    torch::autograd::impl::set_gradient_edge(slot, torch::autograd::Edge());
  }
}

} // namespace

struct Replicator::State {
  std::weak_ptr<Module> module;
  CloneFn clone;
  std::mutex mutex;
  std::vector<ReplicaSet> sets; // most recently used last
  int64_t builds = 0;
};

Replicator::Replicator(std::shared_ptr<Module> module, CloneFn clone)
    : state_(std::make_unique<State>()) {
  TORCH_CHECK(module != nullptr, kApi, ": the module is null");
  state_->module = module;
  if (clone) {
    state_->clone = std::move(clone);
  } else {
    std::weak_ptr<Module> weak = module;
    state_->clone = [weak]() {
      auto m = weak.lock();
      TORCH_CHECK(m != nullptr, "the module was destroyed");
      return m->clone();
    };
  }
}

Replicator::~Replicator() = default;

void Replicator::invalidate() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->sets.clear();
}

int64_t Replicator::skeleton_builds() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->builds;
}

std::shared_ptr<Module> Replicator::module() const {
  return state_->module.lock();
}

std::vector<std::shared_ptr<Module>> Replicator::replicate(
    const std::vector<c10::Device>& devices_in, bool detach) {
  const auto devices = normalize_devices(devices_in, kApi);
  auto module = state_->module.lock();
  TORCH_CHECK(module != nullptr, kApi, ": the module of this Replicator was destroyed");
  std::lock_guard<std::mutex> lock(state_->mutex);
  const detail::ProfilerRange range("torchdp.replicate");

  Walk w;
  std::unordered_set<const Module*> seen;
  walk(*module, "", w, seen);

  std::optional<c10::Device> source;
  size_t source_spec = 0;
  std::vector<at::Tensor> unique;
  std::vector<int64_t> unique_of(w.specs.size(), -1);
  std::unordered_map<const c10::TensorImpl*, int64_t> index_of;
  for (const auto s : c10::irange(w.specs.size())) {
    const auto& t = w.tensors[s];
    if (!t.defined()) {
      continue;
    }
    const auto d = detail::canonical(t.device());
    if (!source) {
      source = d;
      source_spec = s;
    } else if (d != *source) {
      const auto& a = w.specs[source_spec];
      const auto& b = w.specs[s];
      TORCH_CHECK(false, kApi, ": the module's tensors must all be on one device, but '",
                  join(w.positions[a.position].path, a.name), "' is on ", *source, " and '",
                  join(w.positions[b.position].path, b.name), "' is on ", t.device(),
                  ". Move the whole module first, e.g. module->to(", devices[0], ")");
    }
    TORCH_CHECK(t.layout() == c10::kStrided, kApi, ": ",
                w.specs[s].is_param ? "parameter '" : "buffer '",
                join(w.positions[w.specs[s].position].path, w.specs[s].name), "' has layout ",
                t.layout(), "; only strided (dense) tensors can be replicated");
    auto [it, inserted] = index_of.emplace(t.unsafeGetTensorImpl(), unique.size());
    if (inserted) {
      unique.push_back(t);
    }
    unique_of[s] = it->second;
  }

  bool built = false;
  ReplicaSet* set = &detail::cached_replica_set(
      state_->sets, devices, w.signature,
      [&] {
        return build(w, devices, state_->clone, *module);
      },
      &built);
  if (built) {
    ++state_->builds;
  }

  const size_t n = devices.size();
  size_t offset = 0;
  const auto copies = unique.empty()
                          ? std::vector<std::vector<at::Tensor>>{}
                          : detail::broadcast_from(unique, *source, devices, detach, &offset);

  try {
    for (const auto j : c10::irange(n)) {
      auto& slots = set->slots[j];
      for (const auto s : c10::irange(w.specs.size())) {
        if (unique_of[s] >= 0) {
          rebind(slots[s], copies[j + offset][unique_of[s]]);
        }
      }
    }

    // Post-replicate hooks: after every replica exists, replica 0 first; one context per module.
    bool hooks_ran = false;
    if (!detail::no_hooks_registered()) {
      std::vector<std::vector<std::shared_ptr<const detail::HookEntry>>> hooks(w.positions.size());
      std::vector<std::unique_ptr<ReplicaContext>> contexts(w.positions.size());
      for (const auto p : c10::irange(w.positions.size())) {
        if (w.positions[p].first) {
          hooks[p] = detail::hooks_for(*w.positions[p].original);
          if (!hooks[p].empty()) {
            contexts[p] = std::make_unique<ReplicaContext>(w.positions[p].path, devices);
          }
        }
      }
      for (const auto j : c10::irange(n)) {
        for (const auto p : c10::irange(w.positions.size())) {
          for (const auto& hook : hooks[p]) {
            hooks_ran = true;
            try {
              hook->fn(*set->modules[j][p], *w.positions[p].original, devices[j],
                       static_cast<int64_t>(j), *contexts[p]);
            } catch (...) {
              // The hook's exception class is kept (c10::ValueError stays one).
              detail::rethrow_with_prefix(
                  c10::str(kApi, ": ", hook->description, " failed on module '",
                           where(w.positions[p].path), "' (type ", w.positions[p].original->name(),
                           ") of replica ", j, " on device ", devices[j], ": "));
            }
          }
        }
      }
    }

    // A full device check when hooks ran or the skeletons are new (clone() may register tensors).
    for (const auto j : c10::irange(n)) {
      if (hooks_ran || built) {
        check_replica_devices(*set->roots[j], devices[j], static_cast<int64_t>(j), kApi);
      } else {
        for (const auto s : c10::irange(w.specs.size())) {
          const auto& t = set->slots[j][s];
          TORCH_CHECK(!t.defined() || detail::canonical(t.device()) == devices[j], kApi,
                      ": replica ", j, " must live on ", devices[j], ", but '",
                      join(w.positions[w.specs[s].position].path, w.specs[s].name), "' is on ",
                      t.device());
        }
      }
    }
  } catch (...) {
    // A half-refreshed or hook-modified skeleton is never reused.
    state_->sets.erase(state_->sets.begin() + (set - state_->sets.data()));
    throw;
  }
  return set->roots;
}

namespace detail {
std::vector<at::Tensor> distinct(const std::vector<at::Tensor>& all, std::vector<size_t>* index) {
  std::vector<at::Tensor> out;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  if (index != nullptr) {
    index->clear();
  }
  for (const auto& t : all) {
    const auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), out.size());
    if (fresh) {
      out.push_back(t);
    }
    if (index != nullptr) {
      index->push_back(it->second);
    }
  }
  return out;
}

void move_module(Module& module, c10::Device device) {
  const auto target = canonical(device);
  std::unordered_set<const c10::TensorImpl*> moved;
  auto move = [&](const at::Tensor& t) {
    if (!t.defined() || canonical(t.device()) == target ||
        !moved.insert(t.unsafeGetTensorImpl()).second) {
      return;
    }
    at::NoGradGuard no_grad;
    auto grad = t.grad();
    assign_data(t, t.to(target));
    if (grad.defined()) {
      t.mutable_grad() = grad.to(target);
    }
  };
  for (const auto& p : module.parameters()) {
    move(p);
  }
  for (const auto& b : module.buffers()) {
    move(b);
  }
}
} // namespace detail

namespace {
struct GlobalCache {
  std::mutex mutex;
  struct Entry {
    std::weak_ptr<Module> module;
    std::shared_ptr<Replicator> replicator;
  };
  std::unordered_map<const Module*, Entry> entries;
};

GlobalCache& global_cache() {
  static auto* cache = new GlobalCache();
  return *cache;
}
} // namespace

std::vector<std::shared_ptr<Module>> replicate(const std::shared_ptr<Module>& module,
                                               const std::vector<c10::Device>& devices,
                                               bool detach) {
  TORCH_CHECK(module != nullptr, kApi, ": the module is null");
  std::shared_ptr<Replicator> replicator;
  {
    auto& cache = global_cache();
    std::lock_guard<std::mutex> lock(cache.mutex);
    for (auto it = cache.entries.begin(); it != cache.entries.end();) {
      it = it->second.module.expired() ? cache.entries.erase(it) : std::next(it);
    }
    auto& entry = cache.entries[module.get()];
    if (!entry.replicator || entry.module.lock() != module) {
      entry.module = module;
      entry.replicator = std::make_shared<Replicator>(module);
    }
    replicator = entry.replicator;
  }
  return replicator->replicate(devices, detach);
}

void clear_replica_cache() {
  std::unordered_map<const Module*, GlobalCache::Entry> dropped;
  {
    auto& cache = global_cache();
    std::lock_guard<std::mutex> lock(cache.mutex);
    dropped.swap(cache.entries);
  }
  // Destroyed here, outside the lock (a skeleton's destructor may run arbitrary module code).
}

namespace {

// Which tensors the forwards in flight use (Note [Buffers of failed forwards]).
struct BufferUses {
  struct Use {
    size_t active = 0;      // snapshots registered on the tensor
    uint64_t last_take = 0; // the latest of their take ids
  };

  std::mutex mutex;
  uint64_t takes = 0;
  std::unordered_map<const c10::TensorImpl*, Use> uses;
  std::unordered_map<uint64_t, uint64_t> active_takes; // take -> its enclosing take

  static BufferUses& instance() {
    static auto* uses = new BufferUses(); // leaked: snapshots may outlive static destructors
    return *uses;
  }

  // Whether `take` is `ancestor` or runs nested inside it. Under the mutex.
  bool within(uint64_t take, uint64_t ancestor) const {
    while (take != 0 && take != ancestor) {
      const auto it = active_takes.find(take);
      take = it == active_takes.end() ? 0 : it->second;
    }
    return take != 0;
  }
};

// Note [Nested forwards]
// A DataParallel inside a replica of another (or a forward run from a replica) snapshots tensors
// that its enclosing forward snapshotted too: replica 0's buffers are the original's. That is
// nesting, not a concurrent forward. While a forward runs its replicas, its take id is the
// enclosing forward of its thread (EnclosingForwardGuard), carried into parallel_run's tasks; a
// take inside it does not count as an overlap, and its release hands its tensors back to the
// enclosing take, whose rollback then still holds. Takes outside that scope, in any thread, are
// concurrent forwards.
thread_local uint64_t enclosing_take = 0;

} // namespace

namespace detail {

uint64_t enclosing_forward() {
  return enclosing_take;
}

EnclosingForwardGuard::EnclosingForwardGuard(uint64_t take) : previous_(enclosing_take) {
  enclosing_take = take;
}

EnclosingForwardGuard::~EnclosingForwardGuard() {
  enclosing_take = previous_;
}

} // namespace detail

void BufferSnapshot::release() {
  if (take_id_ == 0) {
    return;
  }
  auto& registry = BufferUses::instance();
  std::lock_guard<std::mutex> lock(registry.mutex);
  const auto self = registry.active_takes.find(take_id_);
  const uint64_t parent = self != registry.active_takes.end() ? self->second : 0;
  for (const auto& t : tensors_) {
    auto it = registry.uses.find(t.unsafeGetTensorImpl());
    if (it == registry.uses.end()) {
      continue;
    }
    if (--it->second.active == 0) {
      registry.uses.erase(it);
    } else if (it->second.last_take == take_id_ && parent != 0) {
      it->second.last_take = parent; // Note [Nested forwards]
    }
  }
  if (self != registry.active_takes.end()) {
    registry.active_takes.erase(self);
  }
  take_id_ = 0;
  overlapped_ = false;
}

void BufferSnapshot::take(const std::vector<at::Tensor>& tensors) {
  release();
  at::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<at::Tensor> kept;
  kept.reserve(tensors.size());
  for (const auto& t : tensors) {
    // No in-place write changes an expanded tensor; non-strided layouts are left out too.
    if (!t.defined() || t.is_meta() || t.layout() != c10::kStrided ||
        at::has_internal_overlap(t) == at::MemOverlap::Yes ||
        !seen.insert(t.unsafeGetTensorImpl()).second) {
      continue;
    }
    kept.push_back(t);
  }
  // The same tensors as at the last take: the copies are reused and refreshed in place.
  bool same = kept.size() == tensors_.size();
  for (size_t i = 0; same && i < kept.size(); ++i) {
    const auto& a = kept[i];
    const auto& b = tensors_[i];
    same = a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl() && a.sizes() == copies_[i].sizes() &&
           a.scalar_type() == copies_[i].scalar_type() && a.device() == copies_[i].device();
  }
  if (!same) {
    // Not inference tensors: later forwards outside inference mode refresh them in place.
    const c10::InferenceMode normal_tensors(false);
    tensors_ = std::move(kept);
    copies_.clear();
    groups_.clear();
    std::vector<std::pair<c10::Device, c10::ScalarType>> keys;
    for (const auto& t : tensors_) {
      copies_.push_back(at::empty(t.sizes(), t.options()));
      const auto key = std::make_pair(t.device(), t.scalar_type());
      const auto g = static_cast<size_t>(std::find(keys.begin(), keys.end(), key) - keys.begin());
      if (g == keys.size()) {
        keys.push_back(key);
        groups_.emplace_back();
      }
      groups_[g].sources.push_back(t);
      groups_[g].copies.push_back(copies_.back());
    }
  }
  {
    auto& registry = BufferUses::instance();
    std::lock_guard<std::mutex> lock(registry.mutex);
    take_id_ = ++registry.takes;
    const uint64_t parent = enclosing_take;
    registry.active_takes[take_id_] = parent;
    for (const auto& t : tensors_) {
      auto& use = registry.uses[t.unsafeGetTensorImpl()];
      overlapped_ = overlapped_ || (use.active > 0 && !registry.within(parent, use.last_take));
      ++use.active;
      use.last_take = take_id_;
    }
  }
  for (auto& group : groups_) {
    at::_foreach_copy_(group.copies, group.sources);
  }
}

size_t BufferSnapshot::restore() {
  if (take_id_ != 0) {
    bool shared = overlapped_;
    {
      auto& registry = BufferUses::instance();
      std::lock_guard<std::mutex> lock(registry.mutex);
      for (size_t i = 0; !shared && i < tensors_.size(); ++i) {
        const auto it = registry.uses.find(tensors_[i].unsafeGetTensorImpl());
        shared = it == registry.uses.end() || it->second.last_take != take_id_;
      }
    }
    if (shared) {
      TORCH_WARN_ONCE(
          "torchdp: a forward failed while another forward of the same module (or of "
          "a module sharing its buffers) ran in another thread; their in-place buffer "
          "updates cannot be told apart, so the buffers were not rolled back (see "
          "Note [Buffers of failed forwards]). Run forwards of one module from one "
          "thread at a time to keep the rollback.");
      return 0;
    }
  }
  at::NoGradGuard no_grad;
  for (auto& group : groups_) {
    bool resized = false;
    for (const auto i : c10::irange(group.sources.size())) {
      resized = resized || group.sources[i].sizes() != group.copies[i].sizes();
    }
    if (!resized) {
      at::_foreach_copy_(group.sources, group.copies);
      continue;
    }
    // A tensor resized in place since the copy: its size comes back too.
    for (const auto i : c10::irange(group.sources.size())) {
      auto& t = group.sources[i];
      if (t.sizes() != group.copies[i].sizes()) {
        t.resize_(group.copies[i].sizes());
      }
      t.copy_(group.copies[i]);
    }
  }
  return tensors_.size();
}

namespace detail {

std::vector<std::vector<at::Tensor>> broadcast_from(const std::vector<at::Tensor>& tensors,
                                                    c10::Device source,
                                                    const std::vector<c10::Device>& devices,
                                                    bool detach, size_t* offset) {
  std::vector<c10::Device> targets = devices;
  *offset = 0;
  if (source != devices.front()) {
    targets.insert(targets.begin(), source);
    *offset = 1;
  }
  return detach ? comm::broadcast_coalesced(tensors, targets)
                : autograd::broadcast_coalesced(tensors, targets);
}

} // namespace detail

} // namespace torchdp
