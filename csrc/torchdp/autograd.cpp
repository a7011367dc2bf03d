#include <torchdp/autograd.h>
#include <torchdp/devices.h>

#include <ATen/Functions.h>
#include <ATen/WrapDimUtils.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

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

struct BroadcastBackward : Node {
  BroadcastBackward(c10::Device source, std::vector<c10::Device> devices, size_t num_inputs,
                    size_t buffer_size)
      : source_(source),
        devices_(std::move(devices)),
        num_inputs_(num_inputs),
        buffer_size_(buffer_size) {}

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
    std::vector<std::vector<at::Tensor>> per_device(n);
    for (const auto j : c10::irange(n)) {
      per_device[j].reserve(wanted.size());
      for (auto k : wanted) {
        per_device[j].push_back(grad_or_zeros(*this, grads, j * num_inputs_ + k));
      }
    }
    auto sums = reduce_add_coalesced(per_device, source_, buffer_size_);
    for (const auto i : c10::irange(wanted.size())) {
      result[wanted[i]] = std::move(sums[i]);
    }
    return result;
  }

  c10::Device source_;
  std::vector<c10::Device> devices_;
  size_t num_inputs_;
  size_t buffer_size_;
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
  auto node = make_node<BroadcastBackward>(detail::canonical(tensors[0].device()), devices,
                                           tensors.size(), buffer_size);
  node->set_next_edges(edges_of(tensors));
  for (auto& per_device : outputs) {
    for (const auto k : c10::irange(tensors.size())) {
      attach(node, per_device[k], tensors[k].requires_grad());
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
    // Chunks that stayed on the input's device are views of it; give them tensors of their own
    // (sharing storage and version counter) so they carry this node's history.
    if (chunk.is_alias_of(input)) {
      auto own = chunk.variable_data();
      torch::autograd::impl::set_version_counter(own,
                                                 torch::autograd::impl::version_counter(input));
      chunk = std::move(own);
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

} // namespace torchdp::autograd
