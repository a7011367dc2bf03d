// The differentiable scatter, gather and reduce-add of autograd.h; the broadcast is in buckets.cpp.
#include <torchdp/autograd.h>
#include <torchdp/autograd/nodes.h>
#include <torchdp/devices.h>
#include <torchdp/reduction.h>

#include <ATen/WrapDimUtils.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <string>
#include <utility>

namespace torchdp::autograd {

using namespace internal;

namespace {

// Note [Scatter chunks of inputs that require grad]
// comm::scatter leaves chunks on the input's device as views of it. With history of their own they
// would be views autograd does not know: an in-place op in a replica's forward would write into
// the caller's tensor unseen and bump the version counter the other chunks' saved tensors check.
// Such chunks are copied when the input requires grad (PyTorch's Scatter makes that in-place op an
// error instead); otherwise they stay views, as in PyTorch.

struct ReduceAddBackward : Node {
  ReduceAddBackward(c10::Device destination, std::vector<c10::Device> devices, size_t num_inputs,
                    size_t buffer_size, GradReduction reduction)
      : destination_(destination),
        devices_(std::move(devices)),
        num_inputs_(num_inputs),
        buffer_size_(buffer_size),
        reduction_(std::move(reduction)) {}

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
        // The average's gradient: each input gets 1/n of the output's.
        defined.push_back(reduction_.scaled(grad_or_zeros(*this, grads, k), n));
      }
    }
    if (wanted.empty()) {
      return result;
    }
    // Broadcast from the destination (maybe none of the devices), then drop the destination's copy.
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
  GradReduction reduction_; // the sum or the average
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
                 bool unsqueezed, std::vector<std::vector<int64_t>> padded_shapes)
      : input_devices_(std::move(input_devices)),
        sizes_(std::move(sizes)),
        dim_(dim),
        unsqueezed_(unsqueezed),
        padded_shapes_(std::move(padded_shapes)) {}

  std::string name() const override {
    return "torchdp::GatherBackward";
  }

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) {
      return variable_list(input_devices_.size());
    }
    if (!padded_shapes_.empty()) {
      return unpadded(grads[0]);
    }
    auto parts = scatter(grads[0], input_devices_, sizes_, dim_);
    if (unsqueezed_) {
      for (auto& p : parts) {
        p = p.reshape({});
      }
    }
    return parts;
  }

  // Each input's slot of a padded gather's gradient, without the padding (Note [Padded gather]),
  // through differentiable ops so double backward works.
  variable_list unpadded(const at::Tensor& grad) const {
    variable_list parts;
    parts.reserve(padded_shapes_.size());
    int64_t offset = 0;
    for (const auto i : c10::irange(padded_shapes_.size())) {
      const auto& shape = padded_shapes_[i];
      auto part = grad.narrow(dim_, offset, shape[dim_]);
      for (const auto d : c10::irange(static_cast<int64_t>(shape.size()))) {
        if (d != dim_ && part.size(d) != shape[d]) {
          part = part.narrow(d, 0, shape[d]);
        }
      }
      parts.push_back(part.to(input_devices_[i]));
      offset += shape[dim_];
    }
    return parts;
  }

  std::vector<c10::Device> input_devices_;
  std::vector<int64_t> sizes_;
  int64_t dim_;
  bool unsqueezed_;
  std::vector<std::vector<int64_t>> padded_shapes_; // the inputs' shapes, when padding was needed
};

} // namespace

std::vector<at::Tensor> reduce_add_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                             c10::Device destination, size_t buffer_size) {
  return reduce_coalesced(per_device, destination, buffer_size, GradReduction::sum());
}

std::vector<at::Tensor> reduce_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                         c10::Device destination_in, size_t buffer_size,
                                         const GradReduction& reduction) {
  if (!reduction.is_builtin()) {
    return reduction(per_device, destination_in, buffer_size); // differentiable as the hook is
  }
  const auto destination =
      normalize_device(destination_in, "torchdp::autograd::reduce_add_coalesced");
  auto outputs = comm::reduce_coalesced(per_device, destination, buffer_size, reduction);
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
  auto node = make_node<ReduceAddBackward>(destination, devices, count, buffer_size, reduction);
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
    // Views of the input are copied (Note [Scatter chunks of inputs that require grad]).
    if (chunk.is_alias_of(input)) {
      at::NoGradGuard no_grad;
      chunk = chunk.clone();
    }
    attach(node, chunk, true);
  }
  return chunks;
}

at::Tensor gather(at::TensorList inputs_in, c10::Device destination, int64_t dim,
                  const std::optional<at::Scalar>& pad_value) {
  constexpr const char* api = "torchdp::autograd::gather";
  TORCH_CHECK(!inputs_in.empty(), api, ": expected at least one tensor to gather from, got none");
  bool all_scalars = true;
  for (const auto& t : inputs_in) {
    TORCH_CHECK(t.defined(), api, ": got an undefined tensor");
    all_scalars = all_scalars && t.dim() == 0;
  }
  std::vector<at::Tensor> inputs(inputs_in.begin(), inputs_in.end());
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
  }
  auto output = comm::gather(inputs, destination, dim, pad_value);
  if (!any_requires_grad(inputs_in)) {
    return output;
  }
  const int64_t wrapped = c10::maybe_wrap_dim(dim, inputs[0].dim());
  std::vector<c10::Device> devices;
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> padded_shapes;
  bool padded = false;
  for (const auto& t : inputs) {
    devices.push_back(detail::canonical(t.device()));
    sizes.push_back(t.size(wrapped));
    for (int64_t d = 0; d < t.dim(); ++d) {
      padded = padded || (d != wrapped && t.size(d) != output.size(d));
    }
  }
  if (padded) {
    for (const auto& t : inputs) {
      padded_shapes.push_back(t.sizes().vec());
    }
  }
  auto node = make_node<GatherBackward>(devices, sizes, wrapped, /*unsqueezed=*/all_scalars,
                                        std::move(padded_shapes));
  node->set_next_edges(edges_of(inputs_in));
  attach(node, output, true);
  return output;
}

} // namespace torchdp::autograd
