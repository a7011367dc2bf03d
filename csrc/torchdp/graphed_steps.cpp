// GraphedSteps: the CUDA-graph engine of cuda_graphs=True (Note [Graphed replicas]).

#include <torchdp/config.h>
#include <torchdp/graphed_replicas.h>

#include <c10/util/Exception.h>

#if TORCHDP_WITH_CUDA
#include <torchdp/autograd/nodes.h>
#include <torchdp/devices.h>

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

#include <map>
#include <mutex>
#include <sstream>
#include <utility>
#endif

namespace torchdp::detail {

#if TORCHDP_WITH_CUDA

namespace {

constexpr int kWarmUp = 3;

using namespace autograd::internal;
using Flat = std::map<at::ScalarType, at::Tensor>;

// One flat tensor per dtype on `device` holding `tensors` back to back; `views[i]`: tensors[i]'s.
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

// Makes `stream` wait for the work queued so far on `on`.
void wait_for(const c10::cuda::CUDAStream& stream, const c10::cuda::CUDAStream& on) {
  if (stream == on) {
    return;
  }
  at::cuda::CUDAEvent event;
  event.record(on);
  event.block(stream);
}

// Thread-local: in the global mode any thread's unsafe CUDA call (a data loader pinning memory)
// breaks the capture. The autograd engine's threads still queue onto the capturing stream.
constexpr cudaStreamCaptureMode kCaptureMode = cudaStreamCaptureModeThreadLocal;

// Ends a capture whose recording threw, so that stream and allocator leave capture mode (its
// own error, from an invalidated capture, is dropped).
void end_failed_capture(at::cuda::CUDAGraph& graph) {
  try {
    graph.capture_end();
  } catch (...) {
  }
}

// Drops autograd's AccumulateGrad stream warning: the warm-up needs that synchronisation anyway.
class QuietAccumulateGrad : public c10::WarningHandler {
 public:
  QuietAccumulateGrad() : previous_(c10::WarningUtils::get_warning_handler()) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("AccumulateGrad node's stream") == std::string::npos) {
      previous_->process(warning);
    }
  }

 private:
  c10::WarningHandler* previous_;
};

struct Replica {
  std::vector<at::Tensor> grad_leaves; // the leaves whose gradients the backward graph packs
  Flat params, buffers;                // replicas j >= 1: the flat copies refreshed per forward
};

struct Capture {
  bool grad = false;
  std::vector<std::vector<at::Tensor>> static_in; // per replica, its inputs
  std::vector<std::unique_ptr<at::cuda::CUDAGraph>> forward, backward;
  std::vector<std::vector<at::Tensor>> static_out;      // per replica
  std::vector<std::vector<at::Tensor>> static_grad_out; // undefined where no gradient flows
  std::vector<Flat> flat_grads;                         // per replica
  std::vector<std::vector<at::Tensor>> static_grad_in;  // per replica, per input (or undefined)
  int64_t generation = 0;
  std::weak_ptr<bool> pending; // alive while the last forward's node waits for its backward
  // Kept for the backward even across a rebuild.
  std::vector<Replica> replicas;
  std::vector<at::Tensor> grad_params;
};

} // namespace

struct GraphedSteps::State {
  std::vector<c10::Device> devices;
  size_t max_signatures = 0;
  std::string api;
  std::vector<at::Tensor> params, grad_params, buffers; // the module's distinct tensors
  std::vector<Replica> replicas;
  Flat packed_params, packed_buffers;
  std::vector<at::Tensor> packed_param_views, packed_buffer_views;
  std::map<std::string, std::shared_ptr<Capture>> captures;
  int64_t captures_made = 0;
  bool warned = false;

  void refresh(size_t n);
  std::shared_ptr<Capture> capture(const std::vector<std::vector<at::Tensor>>& inputs,
                                   const Forward& forward, bool grad);
  void warm_up(Capture& capture, const Forward& forward, size_t n);
  void record(Capture& capture, const Forward& forward, size_t n);
  std::vector<at::Tensor> call(const Forward& forward, size_t j, const Capture& capture) const;
  std::vector<std::vector<at::Tensor>> replay(Capture& capture,
                                              const std::vector<std::vector<at::Tensor>>& inputs);
};

namespace {

// Replays the backward graphs: the inputs' gradients, then each parameter's slice of the sum.
struct GraphedBackward : Node {
  std::shared_ptr<GraphedSteps::State> state;
  std::shared_ptr<Capture> capture;
  int64_t generation = 0;
  std::shared_ptr<bool> pending;
  bool consumed = false;
  size_t n = 0;

  std::string name() const override {
    return "torchdp::GraphedReplicasBackward";
  }

  variable_list apply(variable_list&& grads) override {
    const auto& api = state->api;
    TORCH_CHECK(capture->generation == generation, api,
                ": this backward pass goes through a forward whose CUDA graphs have been replayed "
                "by a later forward since, which overwrote its saved activations; run the backward "
                "before the next forward of the same input shapes, or turn cuda_graphs off");
    TORCH_CHECK(!consumed, api,
                ": a second backward pass through the same graphed forward is not supported (the "
                "captured backward does not keep the saved activations); run the forward again, "
                "or turn cuda_graphs off for retain_graph=True");
    consumed = true;
    const auto& devices = state->devices;
    const auto first = devices[0];
    const auto node_stream = c10::cuda::getCurrentCUDAStream(first.index());
    size_t k = 0;
    for (const auto j : c10::irange(n)) {
      const auto stream = c10::cuda::getCurrentCUDAStream(devices[j].index());
      wait_for(stream, node_stream);
      c10::cuda::CUDAGuard guard(devices[j]);
      for (auto& target : capture->static_grad_out[j]) {
        const auto& g = grads[k++];
        if (target.defined()) {
          if (g.defined()) {
            target.copy_(g);
          } else {
            target.zero_();
          }
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
    // Consumers are ordered after this node's stream only: it waits for the other devices'.
    for (const auto j : c10::irange(size_t{1}, n)) {
      wait_for(node_stream, c10::cuda::getCurrentCUDAStream(devices[j].index()));
    }
    return out;
  }
};

// Replica j's parameter leaves, then its inputs that require grad (positions in `index`).
variable_list wrt_of(const Replica& replica, const std::vector<at::Tensor>& inputs,
                     std::vector<size_t>* index = nullptr) {
  variable_list wrt = replica.grad_leaves;
  for (const auto i : c10::irange(inputs.size())) {
    if (inputs[i].requires_grad()) {
      wrt.push_back(inputs[i]);
      if (index != nullptr) {
        index->push_back(i);
      }
    }
  }
  return wrt;
}

variable_list needing_grad(const std::vector<at::Tensor>& outputs) {
  variable_list out;
  for (const auto& o : outputs) {
    if (o.requires_grad()) {
      out.push_back(o);
    }
  }
  return out;
}

} // namespace

void GraphedSteps::State::refresh(size_t n) {
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

std::vector<at::Tensor> GraphedSteps::State::call(const Forward& forward, size_t j,
                                                  const Capture& capture) const {
  auto outputs = forward(j, capture.static_in[j]);
  for (const auto& o : outputs) {
    // A capture would hold a copy between devices, made on a stream it does not capture.
    TORCH_CHECK(o.defined() && canonical(o.device()) == devices[j], api,
                ": the forward of replica ", j, " on ", devices[j], " returned a tensor on ",
                o.defined() ? canonical(o.device()).str() : std::string("(undefined)"),
                "; in this mode each replica's outputs must stay on its device (the gather moves "
                "them). Return it on the replica's device, or turn cuda_graphs off");
  }
  return outputs;
}

void GraphedSteps::State::warm_up(Capture& capture, const Forward& forward, size_t n) {
  QuietAccumulateGrad quiet;
  c10::WarningUtils::WarningHandlerGuard quiet_guard(&quiet);
  for (const auto step : c10::irange(kWarmUp)) {
    (void)step;
    for (const auto j : c10::irange(n)) {
      c10::cuda::CUDAGuard guard(devices[j]);
      const auto current = c10::cuda::getCurrentCUDAStream(devices[j].index());
      const auto side = c10::cuda::getStreamFromPool(false, devices[j].index());
      wait_for(side, current);
      try {
        c10::cuda::CUDAStreamGuard stream_guard(side);
        const auto outs = needing_grad(call(forward, j, capture));
        const auto wrt = wrt_of(replicas[j], capture.static_in[j]);
        if (capture.grad && !outs.empty() && !wrt.empty()) {
          variable_list ones;
          for (const auto& o : outs) {
            ones.push_back(at::ones_like(o));
          }
          torch::autograd::grad(outs, wrt, ones, std::nullopt, false, true);
        }
      } catch (...) {
        // The caller restores the buffers on the current stream, after the failed step's work.
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

void GraphedSteps::State::record(Capture& capture, const Forward& forward, size_t n) {
  for (const auto j : c10::irange(n)) {
    c10::cuda::CUDAGuard guard(devices[j]);
    c10::cuda::device_synchronize();
    const auto stream = c10::cuda::getStreamFromPool(false, devices[j].index());
    c10::cuda::CUDAStreamGuard stream_guard(stream);
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    graph->capture_begin(at::cuda::graph_pool_handle(), kCaptureMode);
    std::vector<at::Tensor> outs;
    try {
      outs = call(forward, j, capture);
    } catch (...) {
      end_failed_capture(*graph);
      throw;
    }
    graph->capture_end();
    std::vector<at::Tensor> grad_out(outs.size());
    Flat flat_grads;
    std::vector<at::Tensor> grad_in(capture.static_in[j].size());
    std::unique_ptr<at::cuda::CUDAGraph> backward;
    if (capture.grad) {
      const auto& params = replicas[j].grad_leaves;
      std::vector<size_t> input_index;
      const auto wrt = wrt_of(replicas[j], capture.static_in[j], &input_index);
      variable_list needed, needed_grads;
      for (const auto i : c10::irange(outs.size())) {
        if (outs[i].requires_grad()) {
          grad_out[i] = at::empty_like(outs[i]);
          needed.push_back(outs[i]);
          needed_grads.push_back(grad_out[i]);
        }
      }
      backward = std::make_unique<at::cuda::CUDAGraph>();
      backward->capture_begin(graph->pool(), kCaptureMode);
      try {
        variable_list grads(wrt.size());
        if (!needed.empty() && !wrt.empty()) {
          grads = torch::autograd::grad(needed, wrt, needed_grads, false, false, true);
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
    // Detached, freeing the capture's autograd graph (and its AccumulateGrad nodes).
    for (auto& o : outs) {
      o = o.detach();
    }
    capture.forward.push_back(std::move(graph));
    capture.backward.push_back(std::move(backward));
    capture.static_out.push_back(std::move(outs));
    capture.static_grad_out.push_back(std::move(grad_out));
    capture.flat_grads.push_back(std::move(flat_grads));
    capture.static_grad_in.push_back(std::move(grad_in));
  }
}

std::shared_ptr<Capture> GraphedSteps::State::capture(
    const std::vector<std::vector<at::Tensor>>& inputs, const Forward& forward, bool grad) {
  const size_t n = inputs.size();
  auto capture = std::make_shared<Capture>();
  capture->grad = grad;
  capture->replicas.assign(replicas.begin(), replicas.begin() + static_cast<int64_t>(n));
  capture->grad_params = grad_params;
  for (const auto j : c10::irange(n)) {
    std::vector<at::Tensor> args;
    for (const auto& c : inputs[j]) {
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
  refresh(n);

  // Warm-up, undone for buffers and RNGs; no autocast cache (it keeps graph-pool tensors alive).
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
    warm_up(*capture, forward, n);
  } catch (...) {
    restore();
    at::autocast::set_autocast_cache_enabled(cache);
    throw;
  }
  restore();
  refresh(n);
  try {
    record(*capture, forward, n);
  } catch (const std::exception& e) {
    at::autocast::set_autocast_cache_enabled(cache);
    // A failed capture leaves the default generators in capture mode: fresh ones, as before it.
    for (const auto& [index, state] : rng) {
      auto fresh = at::cuda::detail::createCUDAGenerator(index);
      fresh.set_state(state);
      auto gen = at::cuda::detail::getDefaultCUDAGenerator(index);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.graphsafe_set_state(fresh);
    }
    TORCH_CHECK(false, api,
                ": capturing the replicas' forward and backward as CUDA graphs failed: ", e.what(),
                "\nThe forward must be capturable: no synchronisation with the CPU (.item(), "
                "printing tensors, data-dependent shapes such as nonzero()), no new CUDA streams; "
                "turn cuda_graphs off for this model");
  }
  at::autocast::set_autocast_cache_enabled(cache);
  ++captures_made;
  return capture;
}

std::vector<std::vector<at::Tensor>> GraphedSteps::State::replay(
    Capture& capture, const std::vector<std::vector<at::Tensor>>& inputs) {
  c10::NoGradGuard no_grad;
  const size_t n = inputs.size();
  for (const auto j : c10::irange(n)) {
    for (const auto i : c10::irange(inputs[j].size())) {
      auto& s = capture.static_in[j][i];
      if (s.data_ptr() != inputs[j][i].data_ptr()) {
        s.detach().copy_(inputs[j][i]);
      }
    }
  }
  for (const auto j : c10::irange(n)) {
    capture.forward[j]->replay();
  }
  ++capture.generation;
  std::vector<std::vector<at::Tensor>> outputs(n);
  for (const auto j : c10::irange(n)) {
    for (const auto& o : capture.static_out[j]) {
      outputs[j].push_back(o.clone());
    }
  }
  return outputs;
}

GraphedSteps::GraphedSteps(std::vector<c10::Device> devices, size_t max_signatures, std::string api)
    : state_(std::make_shared<State>()) {
  state_->devices = std::move(devices);
  state_->max_signatures = max_signatures;
  state_->api = std::move(api);
  for (auto& d : state_->devices) {
    TORCH_CHECK(d.is_cuda(), state_->api, ": CUDA graphs need CUDA devices, got ", d);
    d = canonical(d);
  }
}

std::vector<GraphedSteps::Storage> GraphedSteps::rebuild(std::vector<at::Tensor> params,
                                                         std::vector<at::Tensor> buffers,
                                                         size_t n) {
  auto& s = *state_;
  TORCH_CHECK(n >= 1 && n <= s.devices.size(), s.api, ": ", n, " replicas for ", s.devices.size(),
              " devices");
  s.captures.clear();
  s.replicas.clear();
  s.grad_params.clear();
  for (const auto* group : {&params, &buffers}) {
    for (const auto& t : *group) {
      TORCH_CHECK(canonical(t.device()) == s.devices[0], s.api,
                  ": every parameter and buffer must be on ", s.devices[0], ", found one on ",
                  t.device());
    }
  }
  for (const auto& p : params) {
    if (p.requires_grad()) {
      s.grad_params.push_back(p);
    }
  }
  s.params = std::move(params);
  s.buffers = std::move(buffers);
  s.packed_params = make_flat(s.params, s.devices[0], s.packed_param_views);
  s.packed_buffers = make_flat(s.buffers, s.devices[0], s.packed_buffer_views);
  std::vector<Storage> storage(n);
  for (const auto j : c10::irange(n)) {
    Replica replica;
    if (j == 0) {
      for (const auto& p : s.params) {
        storage[j].params.push_back(p.detach());
      }
      storage[j].buffers = s.buffers; // the module's own buffers: running statistics persist
    } else {
      replica.params = make_flat(s.params, s.devices[j], storage[j].params);
      replica.buffers = make_flat(s.buffers, s.devices[j], storage[j].buffers);
    }
    s.replicas.push_back(std::move(replica));
  }
  return storage;
}

void GraphedSteps::bind(size_t j, std::vector<at::Tensor> grad_leaves) {
  auto& s = *state_;
  TORCH_CHECK(j < s.replicas.size(), s.api, ": replica ", j, " was not laid out");
  TORCH_CHECK(grad_leaves.size() == s.grad_params.size(), s.api, ": replica ", j, " has ",
              grad_leaves.size(), " parameters that require grad where the module has ",
              s.grad_params.size());
  s.replicas[j].grad_leaves = std::move(grad_leaves);
}

size_t GraphedSteps::replicas() const {
  return state_->replicas.size();
}

std::string GraphedSteps::signature(const std::string& key,
                                    const std::vector<std::vector<at::Tensor>>& inputs) const {
  std::ostringstream out;
  out << inputs.size() << (c10::GradMode::is_enabled() ? "g" : "n")
      << at::autocast::is_autocast_enabled(c10::kCUDA)
      << at::autocast::get_autocast_dtype(c10::kCUDA) << "|" << key;
  for (const auto& args : inputs) {
    out << "|";
    for (const auto& t : args) {
      out << t.sizes() << t.strides() << t.scalar_type() << t.device() << t.requires_grad() << ";";
    }
  }
  return out.str();
}

std::optional<std::vector<std::vector<at::Tensor>>> GraphedSteps::run(
    const std::string& signature, const std::vector<std::vector<at::Tensor>>& inputs,
    const Forward& forward) {
  auto& s = *state_;
  const size_t n = inputs.size();
  if (c10::InferenceMode::is_enabled()) {
    // Inference tensors could not be refreshed in place by later training forwards.
    return std::nullopt;
  }
  TORCH_CHECK(n >= 1 && n <= s.replicas.size(), s.api, ": got ", n, " input lists for ",
              s.replicas.size(), " replicas");
  const bool grad = c10::GradMode::is_enabled();
  const auto it = s.captures.find(signature);
  std::shared_ptr<Capture> capture;
  if (it == s.captures.end()) {
    if (s.captures.size() >= s.max_signatures) {
      if (!s.warned) {
        s.warned = true;
        TORCH_WARN(s.api, ": ", s.captures.size(),
                   " input signatures are captured already (max_signatures); forwards with other "
                   "shapes run eagerly (pad inputs to a few fixed shapes)");
      }
      return std::nullopt;
    }
    capture = s.capture(inputs, forward, grad);
    s.captures[signature] = capture;
  } else {
    capture = it->second;
    if (!capture->pending.expired()) {
      return std::nullopt; // the previous forward's activations are still needed by its backward
    }
  }
  s.refresh(n);
  auto outputs = s.replay(*capture, inputs);
  if (!grad) {
    return outputs;
  }
  variable_list sources; // the node's next edges: the inputs, then the parameters
  for (const auto& args : inputs) {
    sources.insert(sources.end(), args.begin(), args.end());
  }
  sources.insert(sources.end(), capture->grad_params.begin(), capture->grad_params.end());
  if (!any_requires_grad(sources)) {
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
  node->set_next_edges(edges_of(sources));
  for (const auto j : c10::irange(n)) {
    for (const auto i : c10::irange(outputs[j].size())) {
      attach(node, outputs[j][i], capture->static_grad_out[j][i].defined());
    }
  }
  return outputs;
}

int64_t GraphedSteps::captures_made() const {
  return state_->captures_made;
}

bool cuda_graphs_available() {
  return true;
}

#else // TORCHDP_WITH_CUDA

struct GraphedSteps::State {};

GraphedSteps::GraphedSteps(std::vector<c10::Device> /*devices*/, size_t /*max_signatures*/,
                           std::string api) {
  TORCH_CHECK(false, api,
              ": cuda_graphs needs torchdp built with its CUDA fast paths (TORCHDP_WITH_CUDA); "
              "this build has none. Turn cuda_graphs off");
}

std::vector<GraphedSteps::Storage> GraphedSteps::rebuild(std::vector<at::Tensor> /*params*/,
                                                         std::vector<at::Tensor> /*buffers*/,
                                                         size_t /*n*/) {
  return {};
}

void GraphedSteps::bind(size_t /*j*/, std::vector<at::Tensor> /*grad_leaves*/) {}

size_t GraphedSteps::replicas() const {
  return 0;
}

std::string GraphedSteps::signature(const std::string& key,
                                    const std::vector<std::vector<at::Tensor>>& /*inputs*/) const {
  return key;
}

std::optional<std::vector<std::vector<at::Tensor>>> GraphedSteps::run(
    const std::string& /*signature*/, const std::vector<std::vector<at::Tensor>>& /*inputs*/,
    const Forward& /*forward*/) {
  return std::nullopt;
}

int64_t GraphedSteps::captures_made() const {
  return 0;
}

bool cuda_graphs_available() {
  return false;
}

#endif // TORCHDP_WITH_CUDA

GraphedSteps::~GraphedSteps() = default;

} // namespace torchdp::detail
