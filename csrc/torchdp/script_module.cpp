// Replicas of scripted modules and their data-parallel forward (Note [Replicating TorchScript
// modules] in script_module.h).
#include <torchdp/devices.h>
#include <torchdp/errors.h>
#include <torchdp/parallel_apply.h>
#include <torchdp/profiling.h>
#include <torchdp/replica_sets.h>
#include <torchdp/script_module.h>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace torchdp {
namespace {

constexpr const char* kReplicateApi = "torchdp::replicate";
constexpr const char* kApi = "torchdp::ScriptDataParallel";

using ObjectPtr = c10::intrusive_ptr<c10::ivalue::Object>;

enum class SlotKind : uint8_t { Other, Module, Parameter, Tensor };

// One module object of the original, in pre-order; shared submodules appear once.
struct Position {
  ObjectPtr object;
  std::string path;
  std::vector<SlotKind> kinds;
  // Per slot: the child's position (Module slots), or the index in Walk::tensor_slots (Parameter
  // and Tensor slots; a child's tensors may come between a parent's in that list).
  std::vector<size_t> index;
};

// One walk over the original's object tree. `signature` keys the cached replica objects.
struct Walk {
  std::vector<Position> positions;
  std::vector<std::pair<size_t, size_t>> tensor_slots; // (position, slot) of Parameter / Tensor
  std::vector<uintptr_t> signature;
};

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

size_t walk(const ObjectPtr& object, const std::string& path, Walk& w,
            std::unordered_map<const c10::ivalue::Object*, size_t>& seen) {
  if (const auto it = seen.find(object.get()); it != seen.end()) {
    return it->second;
  }
  const size_t pos = w.positions.size();
  seen.emplace(object.get(), pos);
  w.positions.push_back(Position{object, path, {}, {}});
  const auto type = object->type();
  const size_t slots = object->slots().size();
  // The type too: another object at a freed object's address must not get its replica.
  w.signature.push_back(reinterpret_cast<uintptr_t>(object.get()));
  w.signature.push_back(reinterpret_cast<uintptr_t>(type.get()));
  w.signature.push_back(slots);
  std::vector<SlotKind> kinds(slots, SlotKind::Other);
  std::vector<size_t> index(slots, 0);
  for (const auto i : c10::irange(slots)) {
    const auto& v = object->getSlot(i);
    if (v.isObject() && v.toObjectRef().type()->is_module()) {
      kinds[i] = SlotKind::Module;
      index[i] = walk(v.toObject(), join(path, type->getAttributeName(i)), w, seen);
    } else if (v.isTensor() && v.toTensor().defined()) {
      kinds[i] = type->is_parameter(i) ? SlotKind::Parameter : SlotKind::Tensor;
      index[i] = w.tensor_slots.size();
      w.tensor_slots.emplace_back(pos, i);
    }
    w.signature.push_back(static_cast<uintptr_t>(kinds[i]) | (index[i] << 2));
  }
  w.positions[pos].kinds = std::move(kinds);
  w.positions[pos].index = std::move(index);
  return pos;
}

Walk walk_module(const torch::jit::Module& module) {
  Walk w;
  std::unordered_map<const c10::ivalue::Object*, size_t> seen;
  walk(module._ivalue(), "", w, seen);
  return w;
}

std::string slot_name(const Walk& w, size_t pos, size_t slot) {
  return join(w.positions[pos].path, w.positions[pos].object->type()->getAttributeName(slot));
}

// The replica objects of one device list: [replica][position].
struct ReplicaSet {
  std::vector<c10::Device> devices;
  std::vector<uintptr_t> signature;
  std::vector<std::vector<ObjectPtr>> objects;
};

ReplicaSet build(const Walk& w, const std::vector<c10::Device>& devices) {
  ReplicaSet set;
  set.devices = devices;
  set.signature = w.signature;
  set.objects.resize(devices.size());
  for (auto& objects : set.objects) {
    objects.reserve(w.positions.size());
    for (const auto& p : w.positions) {
      objects.push_back(p.object->copy()); // same class type, hence the same methods
    }
  }
  return set;
}

} // namespace

struct ScriptReplicator::State {
  torch::jit::Module module;
  std::mutex mutex;
  std::vector<ReplicaSet> sets; // most recently used last
  int64_t builds = 0;
};

ScriptReplicator::ScriptReplicator(torch::jit::Module module) : state_(std::make_unique<State>()) {
  TORCH_CHECK(module._ivalue() != nullptr, kReplicateApi, ": the module is empty");
  state_->module = std::move(module);
}

ScriptReplicator::~ScriptReplicator() = default;

void ScriptReplicator::invalidate() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->sets.clear();
}

int64_t ScriptReplicator::skeleton_builds() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->builds;
}

const torch::jit::Module& ScriptReplicator::module() const {
  return state_->module;
}

std::vector<torch::jit::Module> ScriptReplicator::replicate(
    const std::vector<c10::Device>& devices_in, bool detach) {
  const auto devices = normalize_devices(devices_in, kReplicateApi);
  std::lock_guard<std::mutex> lock(state_->mutex);
  const detail::ProfilerRange range("torchdp.replicate");
  const Walk w = walk_module(state_->module);

  // The distinct tensors, all on one device (the source of the broadcast).
  std::vector<at::Tensor> unique;
  std::vector<size_t> unique_of(w.tensor_slots.size());
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  std::optional<c10::Device> source;
  size_t source_slot = 0;
  for (const auto s : c10::irange(w.tensor_slots.size())) {
    const auto [pos, slot] = w.tensor_slots[s];
    const auto& t = w.positions[pos].object->getSlot(slot).toTensor();
    const auto d = detail::canonical(t.device());
    if (!source) {
      source = d;
      source_slot = s;
    } else if (d != *source) {
      const auto [a_pos, a_slot] = w.tensor_slots[source_slot];
      TORCH_CHECK(false, kReplicateApi, ": the module's tensors must all be on one device, but '",
                  slot_name(w, a_pos, a_slot), "' is on ", *source, " and '",
                  slot_name(w, pos, slot), "' is on ", t.device(),
                  ". Move the whole module first, e.g. module.to(", devices[0], ")");
    }
    TORCH_CHECK(t.layout() == c10::kStrided, kReplicateApi, ": '", slot_name(w, pos, slot),
                "' has layout ", t.layout(), "; only strided (dense) tensors can be replicated");
    const auto [it, inserted] = index_of.emplace(t.unsafeGetTensorImpl(), unique.size());
    if (inserted) {
      unique.push_back(t);
    }
    unique_of[s] = it->second;
  }

  bool built = false;
  ReplicaSet* set = &detail::cached_replica_set(
      state_->sets, devices, w.signature,
      [&] {
        return build(w, devices);
      },
      &built);
  if (built) {
    ++state_->builds;
  }

  size_t offset = 0;
  const auto copies = unique.empty()
                          ? std::vector<std::vector<at::Tensor>>{}
                          : detail::broadcast_from(unique, *source, devices, detach, &offset);

  // Every slot of every replica object: submodules, tensor copies, the original's other values.
  std::vector<torch::jit::Module> replicas;
  replicas.reserve(devices.size());
  for (const auto j : c10::irange(devices.size())) {
    auto& objects = set->objects[j];
    for (const auto p : c10::irange(w.positions.size())) {
      const auto& position = w.positions[p];
      auto& replica = objects[p];
      for (const auto i : c10::irange(position.kinds.size())) {
        switch (position.kinds[i]) {
          case SlotKind::Module:
            replica->setSlot(i, c10::IValue(objects[position.index[i]]));
            break;
          case SlotKind::Parameter:
          case SlotKind::Tensor:
            replica->setSlot(i, copies[j + offset][unique_of[position.index[i]]]);
            break;
          case SlotKind::Other:
            replica->setSlot(i, position.object->getSlot(i));
            break;
        }
      }
    }
    replicas.emplace_back(objects[0]);
  }
  return replicas;
}

std::vector<torch::jit::Module> replicate(const torch::jit::Module& module,
                                          const std::vector<c10::Device>& devices, bool detach) {
  ScriptReplicator replicator(module);
  return replicator.replicate(devices, detach);
}

namespace {

// Positional arguments of a replica's forward: a tuple's members, else the value itself.
std::vector<c10::IValue> arguments_of(const c10::IValue& input) {
  if (input.isTuple()) {
    const auto& elements = input.toTupleRef().elements();
    return std::vector<c10::IValue>(elements.begin(), elements.end());
  }
  return {input};
}

} // namespace

std::vector<c10::IValue> parallel_apply(std::vector<torch::jit::Module>& modules,
                                        const std::vector<c10::IValue>& inputs,
                                        const std::optional<std::vector<c10::Device>>& devices) {
  constexpr const char* api = "torchdp::parallel_apply";
  TORCH_CHECK(modules.size() == inputs.size(), api, ": got ", modules.size(), " modules but ",
              inputs.size(), " inputs; pass one input per module");
  if (devices) {
    TORCH_CHECK(modules.size() == devices->size(), api, ": got ", modules.size(), " modules but ",
                devices->size(), " devices; pass one device per module");
  }
  std::vector<c10::Device> where;
  where.reserve(inputs.size());
  for (const auto i : c10::irange(inputs.size())) {
    if (devices) {
      where.push_back(normalize_device((*devices)[i], api));
      continue;
    }
    const auto tensors = detail::tensors_of(inputs[i]);
    TORCH_CHECK(!tensors.empty(), api, ": input ", i,
                " holds no tensor to take the replica's device from; pass the devices");
    where.push_back(detail::canonical(tensors.front().device()));
  }
  std::vector<c10::IValue> outputs(modules.size());
  const detail::ValueNames names{"the output", false};
  parallel_run(modules.size(), where, [&](size_t i) {
    outputs[i] =
        detail::to_device(modules[i].forward(arguments_of(inputs[i])), where[i], api, names);
  });
  return outputs;
}

} // namespace torchdp
