#pragma once

// What the autograd nodes of nodes.cpp (scatter, gather, reduce-add) and buckets.cpp
// (the broadcast's gradient buckets) share. Internal: not part of the public API.
#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace torchdp::autograd::internal {

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

inline bool any_requires_grad(at::TensorList tensors) {
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

inline void attach(const NodePtr& node, at::Tensor& output, bool differentiable) {
  const auto nr = node->add_input_metadata(output);
  if (differentiable) {
    torch::autograd::impl::set_gradient_edge(output, Edge(node, nr));
  }
}

inline torch::autograd::edge_list edges_of(at::TensorList tensors) {
  torch::autograd::edge_list edges;
  edges.reserve(tensors.size());
  for (const auto& t : tensors) {
    edges.push_back(t.defined() && t.requires_grad() ? torch::autograd::impl::gradient_edge(t)
                                                     : Edge());
  }
  return edges;
}

// A gradient slot that received nothing counts as zeros.
inline at::Tensor grad_or_zeros(const Node& node, const variable_list& grads, size_t i) {
  return grads[i].defined() ? grads[i] : node.input_metadata(i).zeros_like();
}

} // namespace torchdp::autograd::internal
