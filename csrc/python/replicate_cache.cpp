// Replicas kept between the forwards of one DataParallel (csrc/python/replication.h).
#include "replication.h"

#include <torchdp/profiling.h>
#include <torchdp/replicate.h>

#include <c10/util/irange.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

namespace torchdp::python::replication {
namespace {

// Note [Kept replicas]
// New replicas make five dicts per module, device and forward for the GC to scan. park keeps the
// lent replicas only when nothing else refers to any (refcounts as when lent) and class and
// __dict__ are unchanged, then empties their dicts. They are reused for the same classes in the
// same order on the same devices (plain_only, no __slots__), refilled from this call's walk exactly
// as new ones. The cache holds no reference to the network, nor the copies' flat buffers.
// Without the GIL another thread's references count apart from the owner's, so a count read here
// says nothing about references that other threads take or drop meanwhile: there replicas are never
// kept (Note [Free-threaded Python]).
#ifdef Py_GIL_DISABLED
constexpr bool kKeepReplicas = false;
#else
constexpr bool kKeepReplicas = true;
#endif

// Note [Replica cache lock]
// Concurrent calls on one cache (forwards of one DataParallel from several threads; on a GIL build
// whenever the transfer releases the GIL) each take the state out of the cache under mutex_ and
// work on their own. mutex_ guards only those moves: nothing under it runs Python code or frees a
// Python object (what leaves the cache is destroyed after the lock is released).
class ReplicaCache {
 public:
  // (copies, plain_only, reused, buffers); buffers: the network's buffers copied before this call
  // could change them (Note [Buffers of failed forwards]), refreshed in place unless still held.
  py::tuple replicate(py::handle network, const std::vector<c10::Device>& devices_in, bool detach,
                      std::optional<int64_t> grad_bucket_bytes) {
    TORCH_CHECK_VALUE(!devices_in.empty(), kApi, ": ReplicaCache.replicate needs a device");
    std::optional<detail::ProfilerRange> phase;
    phase.emplace("torchdp.replicate.walk");
    Source s;
    prepare(s, network, devices_in, detach);
    std::shared_ptr<torchdp::BufferSnapshot> buffers, replaced;
    // Out of the cache: a concurrent call (the transfer releases the GIL) builds its own.
    std::unique_ptr<State> state;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!buffers_ || buffers_.use_count() > 1) {
        replaced = std::move(buffers_);
        buffers_ = std::make_shared<torchdp::BufferSnapshot>();
      }
      buffers = buffers_; // held twice now: a concurrent call makes its own
      state = std::move(state_);
    }
    {
      std::vector<at::Tensor> originals(s.plain_buffers);
      originals.insert(originals.end(), s.rg_buffers.begin(), s.rg_buffers.end());
      buffers->take(originals);
    }
    if (state && !(state->parked && reusable(*state, s))) {
      state.reset(); // before the transfer: its copies go first
    }
    phase.reset();
    phase.emplace("torchdp.replicate.transfer");
    transfer(s, grad_bucket_bytes);
    phase.reset();
    phase.emplace("torchdp.replicate.build");
    const bool reused = static_cast<bool>(state);
    std::vector<py::list> copies;
    if (reused) {
      copies = refill(*state, s);
      ++reuses_;
    } else {
      std::vector<std::vector<ReplicaDicts>> dicts;
      copies = build(s, dicts);
      ++builds_;
      if (kKeepReplicas && s.plain_only && s.keepable) {
        state = std::make_unique<State>();
        state->devices = s.devices;
        for (const auto& e : s.net.modules) {
          state->types.push_back(Py_TYPE(e.module.ptr()));
        }
        state->replicas.resize(copies.size());
        for (const auto j : c10::irange(copies.size())) {
          for (auto replica : copies[j]) {
            state->replicas[j].push_back(py::reinterpret_borrow<py::object>(replica));
          }
        }
        state->dicts = std::move(dicts);
      }
    }
    if (state) {
      // The reference counts with only the cache, the replicas and `copies` holding them.
      state->expected.assign(copies.size(), {});
      for (const auto j : c10::irange(copies.size())) {
        for (const auto& replica : state->replicas[j]) {
          state->expected[j].push_back(Py_REFCNT(replica.ptr()) - 1);
        }
      }
      state->parked = false;
      const std::lock_guard<std::mutex> lock(mutex_);
      state_.swap(state); // a concurrent call's state, if any, is freed unlocked
    }
    py::list out;
    for (auto& list : copies) {
      out.append(std::move(list));
    }
    return py::make_tuple(out, s.plain_only, reused, buffers);
  }

  // Takes the lent replicas back (Note [Kept replicas]); true when they are kept.
  bool park() {
    // Out of the cache while checked: freeing copies may run Python code, and another call.
    std::unique_ptr<State> state;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!state_ || state_->parked) {
        return state_ != nullptr;
      }
      state = std::move(state_);
    }
    const detail::ProfilerRange range("torchdp.replicate.park");
    for (const auto j : c10::irange(state->replicas.size())) {
      for (const auto i : c10::irange(state->replicas[j].size())) {
        PyObject* replica = state->replicas[j][i].ptr();
        if (Py_REFCNT(replica) != state->expected[j][i]) {
          return false; // still in use: left to its holders
        }
        // A forward that gave the replica another __dict__ or class: refilling would miss it.
        const py::object dict = instance_dict(replica);
        if (!dict.is(state->dicts[j][i].dict) || Py_TYPE(replica) != state->types[i]) {
          return false;
        }
      }
    }
    for (auto& device_dicts : state->dicts) {
      for (auto& d : device_dicts) {
        clear(d);
      }
    }
    state->parked = true;
    const std::lock_guard<std::mutex> lock(mutex_);
    if (state_) {
      return false; // another call kept its own replicas meanwhile (`state` is freed unlocked)
    }
    state_ = std::move(state);
    return true;
  }

  void drop() {
    std::unique_ptr<State> state;
    std::shared_ptr<torchdp::BufferSnapshot> buffers;
    const std::lock_guard<std::mutex> lock(mutex_);
    state = std::move(state_);
    buffers = std::move(buffers_);
  } // the lock goes before `state` and `buffers` (declared first) are freed

  int64_t builds() const {
    return builds_.load();
  }
  int64_t reuses() const {
    return reuses_.load();
  }
  // "empty", "lent" or "parked".
  std::string state() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return !state_ ? "empty" : state_->parked ? "parked" : "lent";
  }

 private:
  struct State {
    std::vector<c10::Device> devices;
    // The class of each module, in network.modules() order (alive: the replicas hold them).
    std::vector<PyTypeObject*> types;
    std::vector<std::vector<py::object>> replicas; // [device][module]
    std::vector<std::vector<ReplicaDicts>> dicts;
    std::vector<std::vector<Py_ssize_t>> expected; // reference counts when lent (see park)
    bool parked = false;
  };
  // Note [Buffers of failed forwards]: the copy of the network's buffers, kept for the next call.
  std::shared_ptr<torchdp::BufferSnapshot> buffers_;

  // Only the classes matter: a refill takes everything else from this call's walk.
  static bool reusable(const State& state, const Source& s) {
    if (!s.plain_only || !s.keepable || state.devices != s.devices ||
        state.types.size() != s.net.modules.size()) {
      return false;
    }
    for (const auto i : c10::irange(state.types.size())) {
      if (state.types[i] != Py_TYPE(s.net.modules[i].module.ptr())) {
        return false;
      }
    }
    return true;
  }

  static void clear(ReplicaDicts& d) {
    for (const py::object* dict : {&d.dict, &d.params, &d.buffers, &d.modules}) {
      PyDict_Clear(dict->ptr());
    }
    py::object none = steal_or_throw(PyObject_CallMethodNoArgs(d.former.ptr(), refs().key_clear));
  }

  static std::vector<py::list> refill(const State& state, const Source& s) {
    const size_t n = state.replicas.size();
    const size_t count = s.net.modules.size();
    std::vector<py::list> copies(n);
    for (const auto j : c10::irange(n)) {
      copies[j] = py::list(count);
      for (const auto i : c10::irange(count)) {
        copies[j][i] = state.replicas[j][i];
        fill_plain_dicts(s.net.modules[i], state.dicts[j][i]);
      }
    }
    for (const auto i : c10::irange(count)) {
      for (const auto j : c10::irange(n)) {
        wire_plain(s.net.modules[i], j, copies, state.dicts, i, s.net, s.tensors,
                   s.detach && j == 0);
      }
    }
    return copies;
  }

  mutable std::mutex mutex_; // Note [Replica cache lock]
  std::unique_ptr<State> state_;
  std::atomic<int64_t> builds_{0};
  std::atomic<int64_t> reuses_{0};
};

} // namespace

void init_replica_cache(py::module_& m) {
  py::class_<ReplicaCache>(m, "ReplicaCache", R"doc(Replicas kept between the forwards of one
DataParallel (replicate_cache.cpp, Note [Kept replicas]).)doc")
      .def(py::init<>())
      .def("replicate",
           torch::wrap_pybind_function([](ReplicaCache& self, py::object network,
                                          const std::vector<c10::Device>& devices, bool detach,
                                          std::optional<int64_t> grad_bucket_bytes) {
             return self.replicate(network, devices, detach, grad_bucket_bytes);
           }),
           py::arg("network"), py::arg("devices"), py::arg("detach") = false,
           py::arg("grad_bucket_bytes") = py::none(),
           R"doc(As replicate(..., report=True), plus whether parked replicas were reused and a
BufferSnapshot of the network's buffers taken before the transfer: (copies, plain_only, reused,
buffers). The replicas are lent until park().)doc")
      .def("park", &ReplicaCache::park,
           R"doc(Takes the lent replicas back when nothing but the cache and the replicas refer to
them (their dictionaries are then emptied); otherwise drops them from the cache. True when kept.)doc")
      .def("drop", &ReplicaCache::drop, "Forgets the kept replicas.")
      .def_property_readonly("builds", &ReplicaCache::builds, "Replica sets built so far.")
      .def_property_readonly("reuses", &ReplicaCache::reuses, "Calls that reused parked replicas.")
      .def_property_readonly("state", &ReplicaCache::state, "'empty', 'lent' or 'parked'.");
}
} // namespace torchdp::python::replication
