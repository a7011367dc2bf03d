#include <torchdp/config.h>
#include <torchdp/graphed_replicas.h>

#include <c10/util/Exception.h>

#if TORCHDP_WITH_CUDA
#include <torchdp/devices.h>
#include <torchdp/replicate.h>

#include <ATen/Functions.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#endif

namespace torchdp::detail {

#if TORCHDP_WITH_CUDA

namespace {

constexpr const char* kApi = "torchdp::DataParallel (cuda_graphs)";
constexpr int kWarmUp = 3;

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
using NodePtr = decltype(torch::autograd::Edge::function);

using Flat = std::map<at::ScalarType, at::Tensor>;

// Autograd nodes are held by std::shared_ptr in older torch releases and by c10::intrusive_ptr in
// newer ones (a template, so that only the matching branch is compiled).
template <typename T>
NodePtr make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

// One flat tensor per dtype on `device` holding `tensors` back to back; `views[i]` is tensors[i]'s
// place in it (contiguous, same shape).
Flat make_flat(const std::vector<at::Tensor>& tensors, c10::Device device,
               std::vector<at::Tensor>& views) {
  std::map<at::ScalarType, int64_t> totals;
  for (const auto& t : tensors) {
    totals[t.scalar_type()] += t.numel();
  }
  Flat flat;
  for (const auto& [dtype, total] : totals) {
    flat[dtype] = at::empty({total}, at::TensorOptions().dtype(dtype).device(device));
  }
  std::map<at::ScalarType, int64_t> offsets;
  views.clear();
  for (const auto& t : tensors) {
    auto& offset = offsets[t.scalar_type()];
    views.push_back(flat[t.scalar_type()].narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  return flat;
}

std::vector<at::Tensor> values(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  std::vector<at::Tensor> out;
  for (const auto& item : dict) {
    out.push_back(item.value());
  }
  return out;
}

// The distinct tensors of `all` (a tensor registered at two positions counts once), and for each
// position the index of its tensor among them.
std::vector<at::Tensor> distinct(const std::vector<at::Tensor>& all, std::vector<size_t>& index) {
  std::vector<at::Tensor> out;
  std::map<const void*, size_t> seen;
  index.clear();
  for (const auto& t : all) {
    const void* key = t.unsafeGetTensorImpl();
    auto it = seen.find(key);
    if (it == seen.end()) {
      it = seen.emplace(key, out.size()).first;
      out.push_back(t);
    }
    index.push_back(it->second);
  }
  return out;
}

// Gives the replica's tensor slots the storage `views[index[k]]`; tensors shared between positions
// in the module must be shared in the replica too (else one copy would miss its gradient).
std::vector<at::Tensor> bind_slots(const std::vector<at::Tensor>& slots,
                                   const std::vector<size_t>& index,
                                   const std::vector<at::Tensor>& views, c10::Device device) {
  std::vector<at::Tensor> bound(views.size());
  c10::NoGradGuard no_grad;
  for (const auto k : c10::irange(slots.size())) {
    auto& target = bound[index[k]];
    if (!target.defined()) {
      target = slots[k];
      target.set_data(views[index[k]]);
    } else {
      TORCH_CHECK(target.unsafeGetTensorImpl() == slots[k].unsafeGetTensorImpl(), kApi,
                  ": a tensor that the module registers at two positions is two tensors in its "
                  "replica on ",
                  device, "; turn cuda_graphs off for this module");
    }
  }
  return bound;
}

// Makes `stream` wait for the work queued so far on `on`.
void wait_for(const c10::cuda::CUDAStream& stream, const c10::cuda::CUDAStream& on) {
  if (stream == on) {
    return;
  }
  at::cuda::CUDAEvent event;
  event.record(on);
  event.block(stream);
}

// Only this thread's unsafe CUDA calls may break a capture: in the default global mode a call from
// any other thread (a data loader allocating pinned memory) invalidates it. The backward is
// captured on the autograd engine's threads, whose kernels go to the capturing stream and are
// captured whatever their thread's mode.
constexpr cudaStreamCaptureMode kCaptureMode = cudaStreamCaptureModeThreadLocal;

// Ends a capture whose recording threw, so that the stream and the allocator leave capture mode
// (the graph is discarded; ending an invalidated capture may report an error of its own).
void end_failed_capture(at::cuda::CUDAGraph& graph) {
  try {
    graph.capture_end();
  } catch (...) {
  }
}

struct Replica {
  std::shared_ptr<torch::nn::Module> module;
  std::vector<at::Tensor> grad_params; // the leaves whose gradients the backward graph packs
  Flat params, buffers;                // replicas j >= 1: the flat copies refreshed per forward
};

struct Capture {
  bool grad = false;
  std::vector<std::vector<at::Tensor>> static_in; // per replica, its arguments
  std::vector<std::unique_ptr<at::cuda::CUDAGraph>> forward, backward;
  std::vector<at::Tensor> static_out;      // per replica
  std::vector<at::Tensor> static_grad_out; // per replica (undefined when no gradient flows)
  std::vector<Flat> flat_grads;            // per replica
  std::vector<std::vector<at::Tensor>> static_grad_in; // per replica, per argument (or undefined)
  int64_t generation = 0;
  std::weak_ptr<bool> pending; // alive while the last forward's node waits for its backward
  // What the backward needs even after a rebuild: the replicas whose weights its graphs read,
  // and the parameters its gradients are sliced for.
  std::vector<Replica> replicas;
  std::vector<at::Tensor> grad_params;
};

} // namespace

struct GraphedReplicas::State {
  std::shared_ptr<torch::nn::Module> module;
  std::vector<c10::Device> devices;
  size_t max_signatures = 0;
  std::vector<int64_t> layout;
  std::vector<at::Tensor> params, grad_params, buffers; // distinct tensors of the module
  std::vector<size_t> param_index, buffer_index;        // position -> distinct tensor
  std::vector<Replica> replicas;
  Flat packed_params, packed_buffers;
  std::vector<at::Tensor> packed_param_views, packed_buffer_views;
  std::map<std::string, std::shared_ptr<Capture>> captures;
  int64_t captures_made = 0;
  bool warned = false;

  std::vector<int64_t> current_layout() const;
  void rebuild(size_t n);
  void refresh(size_t n);
  std::shared_ptr<Capture> capture(const std::vector<std::vector<at::Tensor>>& chunks,
                                   const Call& call, bool grad);
  void warm_up(Capture& capture, const Call& call, size_t n);
  void record(Capture& capture, const Call& call, size_t n);
  std::vector<at::Tensor> replay_forward(Capture& capture,
                                         const std::vector<std::vector<at::Tensor>>& chunks);
};

namespace {

// The backward of one graphed forward: replays every replica's backward graph, sums the flat
// parameter gradients on the first device and returns each parameter's slice and the chunks'
// gradients.
struct GraphedBackward : Node {
  std::shared_ptr<GraphedReplicas::State> state;
  std::shared_ptr<Capture> capture;
  int64_t generation = 0;
  std::shared_ptr<bool> pending;
  bool consumed = false;
  size_t n = 0;

  std::string name() const override {
    return "torchdp::GraphedReplicasBackward";
  }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(capture->generation == generation, kApi,
                ": this backward pass goes through a forward whose CUDA graphs have been replayed "
                "by a later forward since, which overwrote its saved activations; run the backward "
                "before the next forward of the same input shapes, or turn cuda_graphs off");
    TORCH_CHECK(!consumed, kApi,
                ": a second backward pass through the same graphed forward is not supported (the "
                "captured backward does not keep the saved activations); run the forward again, "
                "or turn cuda_graphs off for retain_graph=true");
    consumed = true;
    const auto& devices = state->devices;
    const auto first = devices[0];
    const auto node_stream = c10::cuda::getCurrentCUDAStream(first.index());
    for (const auto j : c10::irange(n)) {
      const auto stream = c10::cuda::getCurrentCUDAStream(devices[j].index());
      wait_for(stream, node_stream);
      if (capture->static_grad_out[j].defined()) {
        c10::cuda::CUDAGuard guard(devices[j]);
        if (grads[j].defined()) {
          capture->static_grad_out[j].copy_(grads[j]);
        } else {
          capture->static_grad_out[j].zero_();
        }
      }
    }
    for (const auto j : c10::irange(n)) {
      capture->backward[j]->replay();
    }
    pending.reset();

    variable_list out;
    for (const auto j : c10::irange(n)) {
      for (const auto& g : capture->static_grad_in[j]) {
        out.push_back(g.defined() ? g.clone() : at::Tensor());
      }
    }
    Flat totals;
    for (const auto& [dtype, flat] : capture->flat_grads[0]) {
      auto total = flat.clone();
      for (const auto j : c10::irange(size_t{1}, n)) {
        total.add_(capture->flat_grads[j].at(dtype).to(first, /*non_blocking=*/true));
      }
      totals[dtype] = total;
    }
    std::map<at::ScalarType, int64_t> offsets;
    for (const auto& p : capture->grad_params) {
      auto& offset = offsets[p.scalar_type()];
      out.push_back(totals.at(p.scalar_type()).narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
    // The engine orders the consumers of these gradients after this node's stream only: that
    // stream waits for the work queued on the other devices' streams (replays, clones).
    for (const auto j : c10::irange(size_t{1}, n)) {
      wait_for(node_stream, c10::cuda::getCurrentCUDAStream(devices[j].index()));
    }
    return out;
  }
};

} // namespace

std::vector<int64_t> GraphedReplicas::State::current_layout() const {
  std::vector<int64_t> key;
  const auto modules = module->modules();
  key.push_back(static_cast<int64_t>(modules.size()));
  for (const auto& m : modules) {
    key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(m.get())));
  }
  // Which tensors, where they live and in what shape (set_data, to() and a new tensor over the
  // same storage all show).
  auto add = [&key](const at::Tensor& t) {
    key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.unsafeGetTensorImpl())));
    key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())));
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(t.dim());
    for (const auto size : t.sizes()) {
      key.push_back(size);
    }
  };
  for (const auto& p : module->parameters()) {
    add(p);
    key.push_back(p.requires_grad() ? 1 : 0);
  }
  for (const auto& b : module->buffers()) {
    add(b);
  }
  return key;
}

void GraphedReplicas::State::rebuild(size_t n) {
  captures.clear();
  replicas.clear();
  params = distinct(module->parameters(), param_index);
  buffers = distinct(module->buffers(), buffer_index);
  grad_params.clear();
  for (const auto& t : params) {
    TORCH_CHECK(canonical(t.device()) == devices[0], kApi,
                ": every parameter and buffer must be on ", devices[0], ", found one on ",
                t.device());
    if (t.requires_grad()) {
      grad_params.push_back(t);
    }
  }
  packed_params = make_flat(params, devices[0], packed_param_views);
  packed_buffers = make_flat(buffers, devices[0], packed_buffer_views);

  Replicator replicator(module);
  std::vector<c10::Device> used(devices.begin(), devices.begin() + static_cast<int64_t>(n));
  std::vector<std::shared_ptr<torch::nn::Module>> copies;
  {
    c10::NoGradGuard no_grad;
    copies = replicator.replicate(used, /*detach=*/true);
  }
  for (const auto j : c10::irange(n)) {
    Replica replica;
    replica.module = copies[j];
    auto slots = values(copies[j]->named_parameters());
    auto buffer_slots = values(copies[j]->named_buffers());
    TORCH_CHECK(slots.size() == param_index.size() && buffer_slots.size() == buffer_index.size(),
                kApi, ": the replica on ", used[j], " has ", slots.size(), " parameters and ",
                buffer_slots.size(), " buffers where the module has ", param_index.size(), " and ",
                buffer_index.size(),
                " (a post-replicate hook that registers tensors); turn cuda_graphs off");
    std::vector<at::Tensor> param_views, buffer_views;
    if (j == 0) {
      for (const auto& p : params) {
        param_views.push_back(p.detach());
      }
      buffer_views = buffers; // the module's own buffers: running statistics persist
    } else {
      replica.params = make_flat(params, used[j], param_views);
      replica.buffers = make_flat(buffers, used[j], buffer_views);
    }
    auto bound = bind_slots(slots, param_index, param_views, used[j]);
    bind_slots(buffer_slots, buffer_index, buffer_views, used[j]);
    for (const auto k : c10::irange(bound.size())) {
      bound[k].requires_grad_(params[k].requires_grad());
      if (params[k].requires_grad()) {
        replica.grad_params.push_back(bound[k]);
      }
    }
    replicas.push_back(std::move(replica));
  }
}

void GraphedReplicas::State::refresh(size_t n) {
  if (n <= 1) {
    return;
  }
  c10::NoGradGuard no_grad;
  if (!params.empty()) {
    at::_foreach_copy_(packed_param_views, params);
  }
  if (!buffers.empty()) {
    at::_foreach_copy_(packed_buffer_views, buffers);
  }
  for (const auto j : c10::irange(size_t{1}, n)) {
    for (const auto& [dtype, flat] : packed_params) {
      replicas[j].params.at(dtype).copy_(flat, /*non_blocking=*/true);
    }
    for (const auto& [dtype, flat] : packed_buffers) {
      replicas[j].buffers.at(dtype).copy_(flat, /*non_blocking=*/true);
    }
  }
}

void GraphedReplicas::State::warm_up(Capture& capture, const Call& call, size_t n) {
  for (const auto step : c10::irange(kWarmUp)) {
    (void)step;
    for (const auto j : c10::irange(n)) {
      c10::cuda::CUDAGuard guard(devices[j]);
      const auto current = c10::cuda::getCurrentCUDAStream(devices[j].index());
      const auto side = c10::cuda::getStreamFromPool(false, devices[j].index());
      wait_for(side, current);
      try {
        c10::cuda::CUDAStreamGuard stream_guard(side);
        auto args = capture.static_in[j];
        auto out = call(replicas[j].module, args);
        if (capture.grad && out.requires_grad()) {
          variable_list wrt = replicas[j].grad_params;
          for (const auto& a : capture.static_in[j]) {
            if (a.requires_grad()) {
              wrt.push_back(a);
            }
          }
          if (!wrt.empty()) {
            torch::autograd::grad({out}, wrt, {at::ones_like(out)}, std::nullopt, false, true);
          }
        }
      } catch (...) {
        // The caller restores the buffers on the current stream: it must come after whatever the
        // failed step queued on the side stream (a BatchNorm's running statistics).
        wait_for(current, side);
        throw;
      }
      wait_for(current, side);
    }
  }
  for (const auto j : c10::irange(n)) {
    c10::cuda::CUDAGuard guard(devices[j]);
    c10::cuda::device_synchronize();
  }
}

void GraphedReplicas::State::record(Capture& capture, const Call& call, size_t n) {
  for (const auto j : c10::irange(n)) {
    c10::cuda::CUDAGuard guard(devices[j]);
    c10::cuda::device_synchronize();
    const auto stream = c10::cuda::getStreamFromPool(false, devices[j].index());
    c10::cuda::CUDAStreamGuard stream_guard(stream);
    auto forward = std::make_unique<at::cuda::CUDAGraph>();
    forward->capture_begin(at::cuda::graph_pool_handle(), kCaptureMode);
    at::Tensor out;
    try {
      auto args = capture.static_in[j];
      out = call(replicas[j].module, args);
    } catch (...) {
      end_failed_capture(*forward);
      throw;
    }
    forward->capture_end();
    const bool needs_grad = capture.grad && out.requires_grad();
    at::Tensor grad_out;
    Flat flat_grads;
    std::vector<at::Tensor> grad_in(capture.static_in[j].size());
    std::unique_ptr<at::cuda::CUDAGraph> backward;
    if (capture.grad) {
      backward = std::make_unique<at::cuda::CUDAGraph>();
      const auto& params = replicas[j].grad_params;
      variable_list wrt = params;
      std::vector<size_t> input_index;
      for (const auto i : c10::irange(capture.static_in[j].size())) {
        if (capture.static_in[j][i].requires_grad()) {
          wrt.push_back(capture.static_in[j][i]);
          input_index.push_back(i);
        }
      }
      if (needs_grad) {
        grad_out = at::empty_like(out);
      }
      backward->capture_begin(forward->pool(), kCaptureMode);
      try {
        variable_list grads(wrt.size());
        if (needs_grad && !wrt.empty()) {
          grads = torch::autograd::grad({out}, wrt, {grad_out}, false, false, true);
        }
        std::map<at::ScalarType, std::vector<at::Tensor>> parts;
        for (const auto k : c10::irange(params.size())) {
          auto g = grads[k].defined() ? grads[k] : at::zeros_like(params[k]);
          parts[g.scalar_type()].push_back(g.reshape({-1}));
        }
        for (auto& [dtype, list] : parts) {
          flat_grads[dtype] = at::cat(list);
        }
        for (const auto k : c10::irange(input_index.size())) {
          const auto& g = grads[params.size() + k];
          grad_in[input_index[k]] =
              g.defined() ? g : at::zeros_like(capture.static_in[j][input_index[k]]);
        }
      } catch (...) {
        end_failed_capture(*backward);
        throw;
      }
      backward->capture_end();
    }
    c10::cuda::device_synchronize();
    capture.forward.push_back(std::move(forward));
    capture.backward.push_back(std::move(backward));
    capture.static_out.push_back(out.detach()); // frees the capture's autograd graph
    capture.static_grad_out.push_back(grad_out);
    capture.flat_grads.push_back(std::move(flat_grads));
    capture.static_grad_in.push_back(std::move(grad_in));
  }
}

std::shared_ptr<Capture> GraphedReplicas::State::capture(
    const std::vector<std::vector<at::Tensor>>& chunks, const Call& call, bool grad) {
  const size_t n = chunks.size();
  auto capture = std::make_shared<Capture>();
  capture->grad = grad;
  capture->replicas.assign(replicas.begin(), replicas.begin() + static_cast<int64_t>(n));
  capture->grad_params = grad_params;
  for (const auto j : c10::irange(n)) {
    std::vector<at::Tensor> args;
    for (const auto& c : chunks[j]) {
      auto s = at::empty_strided(c.sizes(), c.strides(), c.options());
      {
        c10::NoGradGuard no_grad;
        s.copy_(c);
      }
      s.requires_grad_(grad && c.requires_grad());
      args.push_back(s);
    }
    capture->static_in.push_back(std::move(args));
  }
  // The replicas' training flags as the module's (pre-order: each module's own call comes last).
  const auto originals = module->modules();
  for (const auto j : c10::irange(n)) {
    const auto copies = replicas[j].module->modules();
    for (const auto k : c10::irange(std::min(originals.size(), copies.size()))) {
      copies[k]->train(originals[k]->is_training());
    }
  }
  refresh(n);

  // Warm-up, then undo its effects on buffers and random number generators. Autocast's cast
  // cache would keep tensors of the graphs' pools alive, so it is off while capturing.
  const bool cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  std::vector<at::Tensor> saved;
  for (const auto& b : buffers) {
    saved.push_back(b.detach().clone());
  }
  std::map<c10::DeviceIndex, at::Tensor> rng;
  for (const auto j : c10::irange(n)) {
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(devices[j].index());
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng[devices[j].index()] = gen.get_state();
  }
  auto restore = [&] {
    c10::NoGradGuard no_grad;
    for (const auto k : c10::irange(buffers.size())) {
      buffers[k].copy_(saved[k]);
    }
    for (const auto& [index, state] : rng) {
      auto gen = at::cuda::detail::getDefaultCUDAGenerator(index);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  };
  try {
    warm_up(*capture, call, n);
  } catch (...) {
    restore();
    at::autocast::set_autocast_cache_enabled(cache);
    throw;
  }
  restore();
  refresh(n);
  try {
    record(*capture, call, n);
  } catch (const std::exception& e) {
    at::autocast::set_autocast_cache_enabled(cache);
    // A capture that fails before its end leaves the default generators in capture mode (every
    // later random op would raise): each gets a fresh state, at the state before the capture.
    for (const auto& [index, state] : rng) {
      auto fresh = at::cuda::detail::createCUDAGenerator(index);
      fresh.set_state(state);
      auto gen = at::cuda::detail::getDefaultCUDAGenerator(index);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.graphsafe_set_state(fresh);
    }
    TORCH_CHECK(false, kApi,
                ": capturing the replicas' forward and backward as CUDA graphs failed: ", e.what(),
                "\nThe forward must be capturable (no synchronisation with the CPU such as "
                "item(), no data-dependent shapes); turn cuda_graphs off for this module");
  }
  at::autocast::set_autocast_cache_enabled(cache);
  ++captures_made;
  return capture;
}

std::vector<at::Tensor> GraphedReplicas::State::replay_forward(
    Capture& capture, const std::vector<std::vector<at::Tensor>>& chunks) {
  c10::NoGradGuard no_grad;
  const size_t n = chunks.size();
  for (const auto j : c10::irange(n)) {
    for (const auto i : c10::irange(chunks[j].size())) {
      auto& s = capture.static_in[j][i];
      if (s.data_ptr() != chunks[j][i].data_ptr()) {
        s.detach().copy_(chunks[j][i]);
      }
    }
  }
  for (const auto j : c10::irange(n)) {
    capture.forward[j]->replay();
  }
  ++capture.generation;
  std::vector<at::Tensor> outputs;
  for (const auto j : c10::irange(n)) {
    outputs.push_back(capture.static_out[j].clone());
  }
  return outputs;
}

GraphedReplicas::GraphedReplicas(std::shared_ptr<torch::nn::Module> module,
                                 std::vector<c10::Device> devices, size_t max_signatures)
    : state_(std::make_shared<State>()) {
  state_->module = std::move(module);
  state_->devices = std::move(devices);
  state_->max_signatures = max_signatures;
  for (const auto& d : state_->devices) {
    TORCH_CHECK(d.is_cuda(), kApi, ": CUDA graphs need CUDA devices, got ", d);
  }
}

std::vector<at::Tensor> GraphedReplicas::run(const std::vector<std::vector<at::Tensor>>& chunks,
                                             const Call& call) {
  auto& s = *state_;
  const size_t n = chunks.size();
  if (c10::InferenceMode::is_enabled()) {
    // Tensors made now would be inference tensors, which later (training) forwards could not
    // refresh in place; inference mode runs eagerly.
    return {};
  }
  TORCH_CHECK(n >= 1 && n <= s.devices.size(), kApi, ": got ", n, " chunk lists for ",
              s.devices.size(), " devices");
  auto layout = s.current_layout();
  if (layout != s.layout || s.replicas.size() < n) {
    s.rebuild(n);
    s.layout = std::move(layout);
  }
  const bool grad = c10::GradMode::is_enabled();
  std::ostringstream key;
  key << n << (grad ? "g" : "n") << at::autocast::is_autocast_enabled(c10::kCUDA)
      << at::autocast::get_autocast_dtype(c10::kCUDA) << "|";
  for (const auto& m : s.module->modules()) {
    key << (m->is_training() ? '1' : '0');
  }
  for (const auto& args : chunks) {
    key << "|";
    for (const auto& t : args) {
      key << t.sizes() << t.strides() << t.scalar_type() << t.device() << t.requires_grad() << ";";
    }
  }
  const auto signature = key.str();
  auto it = s.captures.find(signature);
  std::shared_ptr<Capture> capture;
  if (it == s.captures.end()) {
    if (s.captures.size() >= s.max_signatures) {
      if (!s.warned) {
        s.warned = true;
        TORCH_WARN(kApi, ": ", s.captures.size(),
                   " input signatures are captured already; forwards with other shapes run "
                   "eagerly (pad inputs to a few fixed shapes)");
      }
      return {};
    }
    capture = s.capture(chunks, call, grad);
    s.captures[signature] = capture;
  } else {
    capture = it->second;
    if (!capture->pending.expired()) {
      return {}; // the previous forward's activations are still needed by its backward
    }
  }
  s.refresh(n);
  auto outputs = s.replay_forward(*capture, chunks);
  if (!grad) {
    return outputs;
  }
  variable_list inputs;
  for (const auto& args : chunks) {
    inputs.insert(inputs.end(), args.begin(), args.end());
  }
  inputs.insert(inputs.end(), capture->grad_params.begin(), capture->grad_params.end());
  bool any = false;
  for (const auto& t : inputs) {
    any = any || (t.defined() && t.requires_grad());
  }
  if (!any) {
    return outputs;
  }
  NodePtr node = make_node<GraphedBackward>();
  auto* backward = static_cast<GraphedBackward*>(node.get());
  backward->state = state_;
  backward->capture = capture;
  backward->generation = capture->generation;
  backward->pending = std::make_shared<bool>(true);
  backward->n = n;
  capture->pending = backward->pending;
  torch::autograd::edge_list edges;
  for (const auto& t : inputs) {
    edges.push_back(t.requires_grad() ? torch::autograd::impl::gradient_edge(t) : Edge());
  }
  node->set_next_edges(std::move(edges));
  for (const auto j : c10::irange(n)) {
    const auto nr = node->add_input_metadata(outputs[j]);
    if (capture->static_grad_out[j].defined()) {
      torch::autograd::impl::set_gradient_edge(outputs[j], Edge(node, nr));
    }
  }
  return outputs;
}

int64_t GraphedReplicas::captures_made() const {
  return state_->captures_made;
}

bool cuda_graphs_available() {
  return true;
}

#else // TORCHDP_WITH_CUDA

struct GraphedReplicas::State {
  std::shared_ptr<torch::nn::Module> module;
};

GraphedReplicas::GraphedReplicas(std::shared_ptr<torch::nn::Module> module,
                                 std::vector<c10::Device> /*devices*/, size_t /*max_signatures*/)
    : state_(std::make_shared<State>()) {
  state_->module = std::move(module);
  TORCH_CHECK(false,
              "torchdp::DataParallel: cuda_graphs needs torchdp built with its CUDA fast paths "
              "(TORCHDP_WITH_CUDA); this build has none. Turn cuda_graphs off");
}

std::vector<at::Tensor> GraphedReplicas::run(const std::vector<std::vector<at::Tensor>>&,
                                             const Call&) {
  return {};
}

int64_t GraphedReplicas::captures_made() const {
  return 0;
}

bool cuda_graphs_available() {
  return false;
}

#endif // TORCHDP_WITH_CUDA

const std::shared_ptr<torch::nn::Module>& GraphedReplicas::module() const {
  return state_->module;
}

GraphedReplicas::~GraphedReplicas() = default;

} // namespace torchdp::detail
