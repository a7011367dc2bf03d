// The differentiable broadcast of autograd.h (Note [Gradient buckets and reduction streams]).
#include <torchdp/autograd.h>
#include <torchdp/autograd/nodes.h>
#include <torchdp/devices.h>
#include <torchdp/profiling.h>
#include <torchdp/reduction.h>

#include <ATen/SparseCsrTensorUtils.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/input_buffer.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace torchdp::autograd {

using namespace internal;

namespace {

// Note [Gradient buckets and reduction streams]
// Gradients reduce in buckets taken from the end of the list (the first at most 1 MiB), so the
// reduce-add overlaps the backward, as in DDP. Bucket and join nodes take kRunWhenReady, as
// AccumulateGrad does, or each device's ready queue would defer them. One BroadcastJoin passes the
// sums on, with zeros for buckets that never ran. On all-CUDA lists each device reduces on a side
// stream that waits for the node's stream; the join makes the source's forward stream wait for its
// side stream, so no forward stream waits on a reduction before the join.

// The sequence number that makes the engine run a node before any other ready node of its device.
constexpr uint64_t kRunWhenReady = std::numeric_limits<uint64_t>::max();

thread_local std::optional<size_t> bucket_size_override;

std::optional<c10::Stream> reduction_stream(c10::Device device) {
  if (!device.is_cuda()) {
    return std::nullopt;
  }
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device.index());
  if (it == streams.end()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    it = streams.emplace(device.index(), impl.getStreamFromGlobalPool(device, false)).first;
  }
  return it->second;
}

// Keeps `t`'s memory from reuse until `stream`'s queued work is done (the caching allocator knows
// only the allocation stream). Sparse tensors record their indices and values instead.
void record_on(const at::Tensor& t, const c10::Stream& stream) {
  if (!t.defined() || !t.device().is_cuda()) {
    return;
  }
  if (t.layout() == c10::kSparse) {
    record_on(t._indices(), stream);
    record_on(t._values(), stream);
    return;
  }
  if (at::sparse_csr::is_sparse_compressed(t)) {
    const auto [compressed, plain] = at::sparse_csr::getCompressedPlainIndices(t);
    record_on(compressed, stream);
    record_on(plain, stream);
    record_on(t.values(), stream);
    return;
  }
  if (t.has_storage() && t.storage().data_ptr().get()) {
    c10::impl::VirtualGuardImpl(t.device().type())
        .recordDataPtrOnStream(t.storage().data_ptr(), stream);
  }
}

// PyTorch quirk: older engines, without InputBuffer::ready_events, leave waits across devices to
// the node (Note [Gradient buckets and reduction streams]).
template <typename T, typename = void>
struct WaitsForEveryInput : std::false_type {};
template <typename T>
struct WaitsForEveryInput<T, std::void_t<decltype(std::declval<T&>().ready_events)>>
    : std::true_type {};
constexpr bool kEngineWaitsAcrossDevices = WaitsForEveryInput<torch::autograd::InputBuffer>::value;

void stream_waits_for(const c10::Stream& waiter, const c10::Stream& done) {
  if (waiter != done) {
    c10::Event event(done.device_type());
    event.record(done);
    waiter.wait(event);
  }
}

c10::Stream current_stream(c10::Device device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

// Bucket boundaries over tensor indices, from the end of the list (each bucket's indices ascend).
std::vector<std::vector<size_t>> gradient_buckets(at::TensorList tensors, size_t bucket_size) {
  std::vector<std::vector<size_t>> buckets;
  if (bucket_size == 0) {
    buckets.emplace_back();
    for (const auto k : c10::irange(tensors.size())) {
      buckets.back().push_back(k);
    }
    return buckets;
  }
  constexpr size_t kFirstBucket = 1024 * 1024; // as DistributedDataParallel: start early
  size_t limit = std::min(kFirstBucket, bucket_size);
  size_t bytes = 0;
  std::vector<size_t> current;
  for (size_t k = tensors.size(); k-- > 0;) {
    const size_t size = static_cast<size_t>(tensors[k].numel()) * tensors[k].element_size();
    if (!current.empty() && bytes + size > limit) {
      buckets.emplace_back(current.rbegin(), current.rend());
      current.clear();
      bytes = 0;
      limit = bucket_size;
    }
    current.push_back(k);
    bytes += size;
  }
  if (!current.empty()) {
    buckets.emplace_back(current.rbegin(), current.rend());
  }
  return buckets;
}

// Where the buckets' sums meet, one slot per tensor. Buckets that never ran leave their slots empty
// and get zeros, as with torch.nn.DataParallel's single reduction.
struct BroadcastJoin : Node {
  BroadcastJoin(c10::Device source, std::optional<c10::Stream> source_side_stream)
      : Node(kRunWhenReady), source_(source), source_side_stream_(source_side_stream) {}

  std::string name() const override {
    return "torchdp::BroadcastBackwardJoin";
  }

  variable_list apply(variable_list&& grads) override {
    if (source_side_stream_) {
      // The sums were made on the side stream (Note [Gradient buckets and reduction streams]).
      stream_waits_for(current_stream(source_), *source_side_stream_);
    }
    variable_list result(grads.size());
    for (const auto k : c10::irange(grads.size())) {
      if (should_compute_output(k)) {
        result[k] = grad_or_zeros(*this, grads, k);
      }
    }
    return result;
  }

  c10::Device source_;
  std::optional<c10::Stream> source_side_stream_;
};

// The reduce-add of one gradient bucket: slots j * num_inputs + k for tensor k of the bucket on
// device j, outputs to the bucket's slots of the BroadcastJoin.
struct BroadcastBackward : Node {
  BroadcastBackward(c10::Device source, std::vector<c10::Device> devices, size_t num_inputs,
                    size_t buffer_size, std::vector<std::optional<c10::Stream>> side_streams,
                    GradReduction reduction)
      : Node(kRunWhenReady),
        source_(source),
        devices_(std::move(devices)),
        num_inputs_(num_inputs),
        buffer_size_(buffer_size),
        side_streams_(std::move(side_streams)),
        reduction_(std::move(reduction)) {}

  std::string name() const override {
    return "torchdp::BroadcastBackward";
  }

  variable_list apply(variable_list&& grads) override {
    // As in an autograd.Function with materialized gradients, an empty slot counts as zeros.
    const size_t n = devices_.size();
    std::vector<size_t> wanted;
    for (const auto k : c10::irange(num_inputs_)) {
      if (should_compute_output(k)) {
        wanted.push_back(k);
      }
    }
    variable_list result(num_inputs_);
    if (wanted.empty()) {
      return result;
    }
    // The node's stream is the source's forward stream, where the sums are consumed; the reduction
    // streams wait for it (Note [Gradient buckets and reduction streams]).
    std::optional<c10::Stream> node_stream;
    if (side_streams_[0]) {
      node_stream = current_stream(source_);
      order_side_streams(*node_stream);
    } else {
      order_current_streams();
    }
    // Each stream once: a device listed twice would make the guard restore it to the side stream.
    std::vector<c10::Stream> side;
    for (const auto& stream : side_streams_) {
      if (stream && std::find(side.begin(), side.end(), *stream) == side.end()) {
        side.push_back(*stream);
      }
    }
    c10::MultiStreamGuard on_side_streams(side);
    // A replica that did not use a tensor gave no gradient; where another gave a sparse one (an
    // embedding used by some replicas), its zeros are sparse too, so the sum stays sparse.
    std::vector<bool> sparse(num_inputs_, false);
    for (const auto i : c10::irange(grads.size())) {
      if (grads[i].defined() && grads[i].layout() == c10::kSparse) {
        sparse[i % num_inputs_] = true;
      }
    }
    std::vector<std::vector<at::Tensor>> per_device(n);
    for (const auto j : c10::irange(n)) {
      per_device[j].reserve(wanted.size());
      for (auto k : wanted) {
        const size_t slot = j * num_inputs_ + k;
        if (!grads[slot].defined() && sparse[k]) {
          const auto& meta = input_metadata(slot);
          per_device[j].push_back(
              at::zeros_symint(meta.shape_as_dim_vector(), meta.options().layout(c10::kSparse)));
        } else {
          per_device[j].push_back(grad_or_zeros(*this, grads, slot));
        }
        if (side_streams_[j]) {
          record_on(per_device[j].back(), *side_streams_[j]);
        }
      }
    }
    auto sums = reduce_coalesced(per_device, source_, buffer_size_, reduction_);
    const void* recorded = nullptr; // consecutive sums are views of one flat buffer
    for (const auto i : c10::irange(wanted.size())) {
      if (node_stream && !sums[i].has_storage()) {
        record_on(sums[i], *node_stream); // sparse: its indices and values
      } else if (node_stream && sums[i].storage().data() != recorded) {
        record_on(sums[i], *node_stream);
        recorded = sums[i].storage().data();
      }
      result[wanted[i]] = std::move(sums[i]);
    }
    return result;
  }

  // Without side streams the reduction runs on each device's current stream. The engine made only
  // the node's stream wait for the gradients, so the other CUDA devices' streams wait for it.
  void order_current_streams() const {
    if (!source_.is_cuda()) {
      return;
    }
    c10::Event all_ready(source_.type());
    bool recorded = false;
    for (const auto& device : devices_) {
      if (!device.is_cuda() || device == source_) {
        continue;
      }
      if (!recorded) {
        all_ready.record(current_stream(source_));
        recorded = true;
      }
      current_stream(device).wait(all_ready);
    }
  }

  // Side streams wait for the node's stream, the only one the engine made wait for the gradients.
  void order_side_streams(const c10::Stream& node_stream) const {
    c10::Event all_ready(source_.type());
    all_ready.record(node_stream);
    for (const auto& stream : side_streams_) {
      stream->wait(all_ready);
      if (kEngineWaitsAcrossDevices || stream->device() == source_) {
        continue;
      }
      // An older engine: wait for all the other device has queued, its gradients included.
      stream_waits_for(*stream, current_stream(stream->device()));
    }
  }

  c10::Device source_;
  std::vector<c10::Device> devices_;
  size_t num_inputs_;
  size_t buffer_size_;
  // Per device; all set (every device is a CUDA device) or all empty (the current streams).
  std::vector<std::optional<c10::Stream>> side_streams_;
  GradReduction reduction_; // the forward thread's grad_reduction() (Note [Reduction seam])
};

} // namespace

std::vector<std::vector<at::Tensor>> broadcast_coalesced(at::TensorList tensors,
                                                         const std::vector<c10::Device>& devices_in,
                                                         size_t buffer_size) {
  const auto devices = normalize_devices(devices_in, "torchdp::autograd::broadcast_coalesced");
  auto outputs = comm::broadcast_coalesced(tensors, devices, buffer_size);
  const detail::ProfilerRange range("torchdp.broadcast.autograd");
  // devices[0]'s outputs: new tensors sharing the inputs' storage and version counter, for history.
  for (const auto k : c10::irange(tensors.size())) {
    auto alias = tensors[k].variable_data();
    torch::autograd::impl::set_version_counter(alias,
                                               torch::autograd::impl::version_counter(tensors[k]));
    outputs[0][k] = std::move(alias);
  }
  if (!any_requires_grad(tensors)) {
    return outputs;
  }
  // One node per gradient bucket (Note [Gradient buckets and reduction streams]).
  const size_t bucket_size = grad_bucket_size();
  const auto source = detail::canonical(tensors[0].device());
  std::vector<std::optional<c10::Stream>> side(devices.size());
  // Side streams only when every device is CUDA; mixed lists reduce on the current streams.
  const bool all_cuda = std::all_of(devices.begin(), devices.end(), [](const c10::Device& d) {
    return d.is_cuda();
  });
  if (bucket_size > 0 && all_cuda) {
    for (const auto j : c10::irange(devices.size())) {
      side[j] = reduction_stream(devices[j]);
    }
  }
  const auto buckets = gradient_buckets(tensors, bucket_size);
  auto join = make_node<BroadcastJoin>(source, side[0]);
  join->set_next_edges(edges_of(tensors));
  for (const auto& t : tensors) {
    join->add_input_metadata(t); // on the forward's current stream, where gradients are consumed
  }
  // A bucket reduces in one piece: each buffer_size chunk would cost packing copies and a launch on
  // the device thread that also launches that device's backward kernels.
  const size_t reduce_buffer_size =
      bucket_size > 0 ? std::max(buffer_size, bucket_size) : buffer_size;
  const auto& reduction = grad_reduction();
  for (const auto& bucket : buckets) {
    auto node = make_node<BroadcastBackward>(source, devices, bucket.size(), reduce_buffer_size,
                                             side, reduction);
    torch::autograd::edge_list next;
    next.reserve(bucket.size());
    for (auto k : bucket) {
      if (tensors[k].requires_grad()) {
        next.emplace_back(join, static_cast<uint32_t>(k));
      } else {
        next.emplace_back();
      }
    }
    node->set_next_edges(std::move(next));
    for (const auto j : c10::irange(devices.size())) {
      // On the forward's current streams, where the gradients are produced.
      for (auto k : bucket) {
        attach(node, outputs[j][k], tensors[k].requires_grad());
      }
    }
  }
  return outputs;
}

size_t grad_bucket_size() {
  return bucket_size_override.value_or(kDefaultGradBucketSize);
}

GradBucketSizeGuard::GradBucketSizeGuard(size_t bytes) : previous_(bucket_size_override) {
  bucket_size_override = bytes;
}

GradBucketSizeGuard::~GradBucketSizeGuard() {
  bucket_size_override = previous_;
}

size_t bucket_bytes_from_mib(double mib, const char* api) {
  TORCH_CHECK_VALUE(std::isfinite(mib) && mib >= 0, api,
                    ": bucket_cap_mb must be a non-negative number of MiB (0: one bucket, reduced "
                    "after the whole backward pass), got ",
                    mib);
  // Clamped to 2^62 bytes so that huge sizes do not overflow the conversion.
  constexpr double kMaxBytes = static_cast<double>(uint64_t{1} << 62);
  return static_cast<size_t>(std::min(mib * 1024 * 1024, kMaxBytes));
}

} // namespace torchdp::autograd
