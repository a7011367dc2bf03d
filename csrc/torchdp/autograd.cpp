#include <torchdp/autograd.h>
#include <torchdp/devices.h>
#include <torchdp/profiling.h>

#include <ATen/Functions.h>
#include <ATen/SparseCsrTensorUtils.h>
#include <ATen/WrapDimUtils.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/input_buffer.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

namespace torchdp::autograd {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// Note [History of comm outputs]
// The forward of every node below runs the detached comm operation, then gives each output the
// node as grad_fn. Every output is registered as an input of the node (add_input_metadata), also
// the ones whose input does not require grad, so that gradient slot numbers are fixed
// (j * num_inputs + k for broadcast); those outputs simply get no gradient edge and their slot
// always receives an undefined gradient. Next edges are collected over all inputs; inputs that do
// not require grad give invalid edges, which the engine skips.

// Note [Scatter chunks of inputs that require grad]
// comm::scatter leaves the chunks that stay on the input's device as views of it (no copy). When
// the input requires grad those chunks would carry ScatterBackward's history while sharing the
// input's storage and version counter, a view autograd does not know about: an in-place op in a
// replica's forward (x.sub_(m), nn.ReLU(inplace=True) first) would overwrite the caller's tensor
// unseen, even a leaf that requires grad, and bump the counter the other chunks' saved tensors
// check, so that backward fails with a version error the plain module does not give. Such chunks
// are therefore copied (one device-local copy of 1/n of the input, only when the input requires
// grad; PyTorch's Scatter makes the same in-place op an error instead). Inputs that do not require
// grad keep view chunks, as in PyTorch.

// Autograd nodes are held by std::shared_ptr in older torch releases and by c10::intrusive_ptr in
// newer ones; Edge::function tells which.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

bool any_requires_grad(at::TensorList tensors) {
  if (!c10::GradMode::is_enabled()) {
    return false;
  }
  for (const auto& t : tensors) {
    if (t.defined() && t.requires_grad()) {
      return true;
    }
  }
  return false;
}

void attach(const NodePtr& node, at::Tensor& output, bool differentiable) {
  const auto nr = node->add_input_metadata(output);
  if (differentiable) {
    torch::autograd::impl::set_gradient_edge(output, Edge(node, nr));
  }
}

torch::autograd::edge_list edges_of(at::TensorList tensors) {
  torch::autograd::edge_list edges;
  edges.reserve(tensors.size());
  for (const auto& t : tensors) {
    edges.push_back(t.defined() && t.requires_grad() ? torch::autograd::impl::gradient_edge(t)
                                                     : Edge());
  }
  return edges;
}

// A gradient slot that received nothing counts as zeros.
at::Tensor grad_or_zeros(const Node& node, const variable_list& grads, size_t i) {
  return grads[i].defined() ? grads[i] : node.input_metadata(i).zeros_like();
}

// Note [Gradient buckets and reduction streams]
// A differentiable broadcast gives its outputs not one BroadcastBackward node but one per gradient
// bucket: consecutive tensors taken from the *end* of the list (parameters are registered in
// forward order, so the last ones get their gradients first in backward), about
// grad_bucket_size() bytes each, the first bucket smaller so that reduction starts early. The
// autograd engine runs a bucket's node as soon as every replica's gradient of that bucket exists,
// so the reduce-add of early buckets overlaps the rest of the backward pass instead of waiting
// for the whole of it. "As soon as" needs the node's priority: each device's ready queue runs the
// node with the highest sequence number first, and a bucket node, made by replicate before the
// forward, would otherwise lose to every replica op still waiting on its device and run only when
// that device's part of the backward is over (a two-GPU transformer trace showed all bucket nodes
// run one after another after the last backward kernel). Bucket and join nodes take the highest
// sequence number, as AccumulateGrad does (kRunWhenReady).
//
// Every bucket's sums go to one BroadcastJoin node, which passes them to the original tensors'
// gradient edges and fills with zeros what no bucket delivered (a bucket none of whose copies was
// used in the forward never runs), so unused tensors get zero gradients exactly as with a single
// reduction.
//
// When every device is a CUDA device the reduction runs on a side stream per device (one pool
// stream each, kept for the process), so that the backward pass goes on on the streams the forward
// ran on. The node's input slots are registered on those forward streams, where the gradients are
// produced: the engine then needs no event per gradient of the source device (a slot on another
// stream costs an event record, a wait and a record_stream for every gradient), and the node's own
// stream (the engine's name for the stream of its first slot) is the source device's forward
// stream, which the engine makes wait for every gradient produced elsewhere (other devices, other
// streams) before running the node. The engine synchronises nothing else, so inside the node:
//   * an event recorded on the node's stream -- after the engine's waits, so it covers every
//     gradient -- is waited for by every device's side stream. Releases whose engine does not
//     wait across devices (no InputBuffer::ready_events) assume a node syncs with the producing
//     device itself: there the side streams of the other devices also wait for their device's
//     current stream, which covers more of that device's backward pass than the bucket needs;
//   * the incoming gradients are recorded on the side streams (the caching allocator must not
//     recycle them while a side stream still reads them), the reduction runs with the side
//     streams current, and the sums are recorded on the source device's forward stream;
//   * the sums go to the BroadcastJoin node, which the engine believes were produced on the
//     forward stream: before passing them on, the join makes that stream wait for the source
//     device's side stream (every bucket node ran before the join, so this covers them all). The
//     forward streams never wait for a reduction before the join: the reductions overlap the rest
//     of the backward pass.
// CPU and meta devices use their only stream: the buckets still split the work, in order.

// The sequence number that makes the engine run a node before any other ready node of its device.
constexpr uint64_t kRunWhenReady = std::numeric_limits<uint64_t>::max();

thread_local std::optional<size_t> bucket_size_override;

// Bytes of `mib` MiB; sizes beyond any device's memory (they mean "one bucket after the first
// 1 MiB") are clamped to 2^62 instead of overflowing the conversion.
size_t mib_to_bytes(double mib) {
  constexpr double kMaxBytes = static_cast<double>(uint64_t{1} << 62);
  return static_cast<size_t>(std::min(mib * 1024 * 1024, kMaxBytes));
}

// The reduction stream of a CUDA device (null for other devices, and when overlap is off).
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

// Keeps `t`'s memory from reuse until the work queued so far on `stream` is done (the caching
// allocator knows only the stream a block was allocated on). Sparse tensors have no storage of
// their own: their indices and values are recorded.
void record_on(const at::Tensor& t, const c10::Stream& stream) {
  if (!t.defined() || !t.device().is_cuda()) {
    return;
  }
  if (t.layout() == c10::kSparse) {
    record_on(t._indices(), stream);
    record_on(t._values(), stream);
    return;
  }
  if (at::sparse_csr::is_sparse_compressed(t)) { // CSR, CSC, BSR, BSC
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

// Whether the engine itself orders a node after every gradient it receives, whatever the device
// that produced it: newer releases record a ready event per input (InputBuffer::ready_events) on
// the producer's stream and make the node's stream wait for each before running the node. Older
// ones made no wait across devices and left it to the node (Note [Gradient buckets and reduction
// streams]).
template <typename T, typename = void>
struct WaitsForEveryInput : std::false_type {};
template <typename T>
struct WaitsForEveryInput<T, std::void_t<decltype(std::declval<T&>().ready_events)>>
    : std::true_type {};
constexpr bool kEngineWaitsAcrossDevices = WaitsForEveryInput<torch::autograd::InputBuffer>::value;

// Makes `waiter` wait for the work queued on `done` so far (nothing when they are one stream).
void stream_waits_for(const c10::Stream& waiter, const c10::Stream& done) {
  if (waiter != done) {
    c10::Event event(done.device_type());
    event.record(done);
    waiter.wait(event);
  }
}

// The current stream of `device` on this thread.
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

// Where the buckets' sums meet: one slot per broadcast tensor, one edge to each tensor's own
// gradient edge. A bucket whose copies took no part in the forward never runs, so its slots stay
// empty and get zeros here, as a single reduction would give them (a parameter that needs a
// gradient gets zeros when unused, as with torch.nn.DataParallel's Broadcast).
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
                    size_t buffer_size, std::vector<std::optional<c10::Stream>> side_streams)
      : Node(kRunWhenReady),
        source_(source),
        devices_(std::move(devices)),
        num_inputs_(num_inputs),
        buffer_size_(buffer_size),
        side_streams_(std::move(side_streams)) {}

  std::string name() const override {
    return "torchdp::BroadcastBackward";
  }

  variable_list apply(variable_list&& grads) override {
    // Like a Python autograd.Function with materialized gradients: a slot that received nothing
    // counts as zeros, so every input that needs a gradient gets one (zeros when unused).
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
    // Every device's reduction stream current, after waiting for the gradients of its device
    // (Note [Gradient buckets and reduction streams]). The node's own stream, current on the
    // source device now, is the forward stream where the sums will be consumed.
    std::optional<c10::Stream> node_stream;
    if (side_streams_[0]) {
      node_stream = current_stream(source_);
      order_side_streams(*node_stream);
    } else {
      order_current_streams();
    }
    // Each stream once: a device listed twice (two replicas on one GPU) would make the guard
    // restore that device's stream to the side stream itself.
    std::vector<c10::Stream> side;
    for (const auto& stream : side_streams_) {
      if (stream && std::find(side.begin(), side.end(), *stream) == side.end()) {
        side.push_back(*stream);
      }
    }
    c10::MultiStreamGuard on_side_streams(side);
    std::vector<std::vector<at::Tensor>> per_device(n);
    for (const auto j : c10::irange(n)) {
      per_device[j].reserve(wanted.size());
      for (auto k : wanted) {
        per_device[j].push_back(grad_or_zeros(*this, grads, j * num_inputs_ + k));
        if (side_streams_[j]) {
          record_on(per_device[j].back(), *side_streams_[j]);
        }
      }
    }
    auto sums = reduce_add_coalesced(per_device, source_, buffer_size_);
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

  // Without side streams (one bucket, or a device list that is not all CUDA) the reduction runs
  // on each device's current stream of this thread, the default stream for the other devices;
  // the engine made only the node's stream wait for the gradients, which the replicas may have
  // produced on other streams (a caller's stream of their device): the other CUDA devices'
  // current streams wait for the node's stream, which covers them.
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

  // Makes every side stream wait for the gradients of the bucket: the engine only made the
  // node's stream wait for them.
  void order_side_streams(const c10::Stream& node_stream) const {
    c10::Event all_ready(source_.type());
    all_ready.record(node_stream);
    for (const auto& stream : side_streams_) {
      stream->wait(all_ready);
      if (kEngineWaitsAcrossDevices || stream->device() == source_) {
        continue;
      }
      // An engine that leaves cross-device order to the node: wait for everything the other
      // device has queued so far, which includes its gradients of this bucket (and possibly
      // more of its backward pass, so the reduction may start later than it could).
      stream_waits_for(*stream, current_stream(stream->device()));
    }
  }

  c10::Device source_;
  std::vector<c10::Device> devices_;
  size_t num_inputs_;
  size_t buffer_size_;
  // Per device; all set (every device is a CUDA device) or all empty (the current streams).
  std::vector<std::optional<c10::Stream>> side_streams_;
};

struct ReduceAddBackward : Node {
  ReduceAddBackward(c10::Device destination, std::vector<c10::Device> devices, size_t num_inputs,
                    size_t buffer_size)
      : destination_(destination),
        devices_(std::move(devices)),
        num_inputs_(num_inputs),
        buffer_size_(buffer_size) {}

  std::string name() const override {
    return "torchdp::ReduceAddBackward";
  }

  variable_list apply(variable_list&& grads) override {
    const size_t n = devices_.size();
    variable_list result(n * num_inputs_);
    std::vector<size_t> wanted;
    std::vector<at::Tensor> defined;
    for (const auto k : c10::irange(num_inputs_)) {
      bool needed = false;
      for (size_t j = 0; j < n && !needed; ++j) {
        needed = should_compute_output(j * num_inputs_ + k);
      }
      if (needed) {
        wanted.push_back(k);
        defined.push_back(grad_or_zeros(*this, grads, k));
      }
    }
    if (wanted.empty()) {
      return result;
    }
    // The gradient lives on the destination, which need not be one of the devices: broadcast from
    // it to [destination, devices...] and drop its own copy.
    std::vector<c10::Device> targets;
    targets.reserve(n + 1);
    targets.push_back(destination_);
    targets.insert(targets.end(), devices_.begin(), devices_.end());
    auto copies = broadcast_coalesced(defined, targets, buffer_size_);
    for (const auto j : c10::irange(n)) {
      for (const auto i : c10::irange(wanted.size())) {
        result[j * num_inputs_ + wanted[i]] = std::move(copies[j + 1][i]);
      }
    }
    return result;
  }

  c10::Device destination_;
  std::vector<c10::Device> devices_;
  size_t num_inputs_;
  size_t buffer_size_;
};

struct ScatterBackward : Node {
  ScatterBackward(c10::Device input_device, int64_t dim) : input_device_(input_device), dim_(dim) {}

  std::string name() const override {
    return "torchdp::ScatterBackward";
  }

  variable_list apply(variable_list&& grads) override {
    std::vector<at::Tensor> parts;
    parts.reserve(grads.size());
    for (const auto i : c10::irange(grads.size())) {
      parts.push_back(grad_or_zeros(*this, grads, i));
    }
    return {gather(parts, input_device_, dim_)};
  }

  c10::Device input_device_;
  int64_t dim_;
};

struct GatherBackward : Node {
  GatherBackward(std::vector<c10::Device> input_devices, std::vector<int64_t> sizes, int64_t dim,
                 bool unsqueezed)
      : input_devices_(std::move(input_devices)),
        sizes_(std::move(sizes)),
        dim_(dim),
        unsqueezed_(unsqueezed) {}

  std::string name() const override {
    return "torchdp::GatherBackward";
  }

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) {
      return variable_list(input_devices_.size());
    }
    auto parts = scatter(grads[0], input_devices_, sizes_, dim_);
    if (unsqueezed_) {
      for (auto& p : parts) {
        p = p.reshape({});
      }
    }
    return parts;
  }

  std::vector<c10::Device> input_devices_;
  std::vector<int64_t> sizes_;
  int64_t dim_;
  bool unsqueezed_;
};

} // namespace

std::vector<std::vector<at::Tensor>> broadcast_coalesced(at::TensorList tensors,
                                                         const std::vector<c10::Device>& devices_in,
                                                         size_t buffer_size) {
  const auto devices = normalize_devices(devices_in, "torchdp::autograd::broadcast_coalesced");
  auto outputs = comm::broadcast_coalesced(tensors, devices, buffer_size);
  const detail::ProfilerRange range("torchdp.broadcast.autograd");
  // Outputs for devices[0] are the inputs themselves: give each a tensor of its own that shares
  // storage and version counter, so it can carry this node's history.
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
  // Side streams only when every device is a CUDA device: a list that mixes device types (cpu and
  // cuda) reduces on the current streams, in order.
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
  // A bucket reduces in one piece: split into buffer_size chunks (10 MiB by default, less than a
  // 25 MiB bucket), every chunk would cost its own packing copies and reduction launch on the
  // device thread that runs the node, which also launches that device's backward kernels.
  const size_t reduce_buffer_size =
      bucket_size > 0 ? std::max(buffer_size, bucket_size) : buffer_size;
  for (const auto& bucket : buckets) {
    auto node =
        make_node<BroadcastBackward>(source, devices, bucket.size(), reduce_buffer_size, side);
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

std::vector<at::Tensor> reduce_add_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                             c10::Device destination_in, size_t buffer_size) {
  const auto destination =
      normalize_device(destination_in, "torchdp::autograd::reduce_add_coalesced");
  auto outputs = comm::reduce_add_coalesced(per_device, destination, buffer_size);
  std::vector<at::Tensor> flat;
  std::vector<c10::Device> devices;
  for (const auto& list : per_device) {
    flat.insert(flat.end(), list.begin(), list.end());
    devices.push_back(list.empty() ? destination : detail::canonical(list[0].device()));
  }
  if (!any_requires_grad(flat)) {
    return outputs;
  }
  const size_t count = outputs.size();
  auto node = make_node<ReduceAddBackward>(destination, devices, count, buffer_size);
  node->set_next_edges(edges_of(flat));
  for (const auto k : c10::irange(count)) {
    bool differentiable = false;
    for (const auto& list : per_device) {
      differentiable = differentiable || list[k].requires_grad();
    }
    attach(node, outputs[k], differentiable);
  }
  return outputs;
}

std::vector<at::Tensor> scatter(const at::Tensor& input, const std::vector<c10::Device>& devices,
                                const std::optional<std::vector<int64_t>>& chunk_sizes,
                                int64_t dim) {
  auto chunks = comm::scatter(input, devices, chunk_sizes, dim);
  if (!any_requires_grad({input})) {
    return chunks;
  }
  const int64_t wrapped = c10::maybe_wrap_dim(dim, input.dim());
  auto node = make_node<ScatterBackward>(detail::canonical(input.device()), wrapped);
  node->set_next_edges(edges_of({input}));
  for (auto& chunk : chunks) {
    // Chunks that stayed on the input's device are views of it that autograd would not know as
    // views (they carry this node's history): an in-place op in a replica's forward would then
    // write into the caller's tensor unseen (a leaf that requires grad included) and bump the
    // version counter the other chunks share. They get storage of their own instead, as the
    // chunks copied to other devices have (Note [Scatter chunks of inputs that require grad]).
    if (chunk.is_alias_of(input)) {
      at::NoGradGuard no_grad;
      chunk = chunk.clone();
    }
    attach(node, chunk, true);
  }
  return chunks;
}

at::Tensor gather(at::TensorList inputs_in, c10::Device destination, int64_t dim) {
  constexpr const char* api = "torchdp::autograd::gather";
  TORCH_CHECK(!inputs_in.empty(), api, ": expected at least one tensor to gather from, got none");
  bool all_scalars = true;
  for (const auto& t : inputs_in) {
    TORCH_CHECK(t.defined(), api, ": got an undefined tensor");
    all_scalars = all_scalars && t.dim() == 0;
  }
  std::vector<at::Tensor> inputs(inputs_in.begin(), inputs_in.end());
  bool unsqueezed = false;
  if (all_scalars) {
    TORCH_CHECK(dim == 0, api,
                ": all inputs are 0-dim tensors, which can only be gathered along "
                "dim 0 (into a vector), but dim=",
                dim, " was asked for");
    TORCH_WARN(
        "Was asked to gather along dimension 0, but all input tensors were scalars; will "
        "instead unsqueeze and return a vector.");
    at::NoGradGuard no_grad;
    for (auto& t : inputs) {
      t = t.view({1});
    }
    unsqueezed = true;
  }
  auto output = comm::gather(inputs, destination, dim);
  if (!any_requires_grad(inputs_in)) {
    return output;
  }
  const int64_t wrapped = c10::maybe_wrap_dim(dim, inputs[0].dim());
  std::vector<c10::Device> devices;
  std::vector<int64_t> sizes;
  for (const auto& t : inputs) {
    devices.push_back(detail::canonical(t.device()));
    sizes.push_back(t.size(wrapped));
  }
  auto node = make_node<GatherBackward>(devices, sizes, wrapped, unsqueezed);
  node->set_next_edges(edges_of(inputs_in));
  attach(node, output, true);
  return output;
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
  return mib_to_bytes(mib);
}

} // namespace torchdp::autograd
