#pragma once

// What torchdp's autograd nodes share (nodes.cpp, buckets.cpp, graphed_steps.cpp). Internal.
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
// Each node's forward runs the detached comm operation, then makes the node its outputs' grad_fn.
// Every output is registered as a node input, also those whose input needs no grad, so gradient
// slot numbers stay fixed (j * num_inputs + k for broadcast); such slots get no gradient edge and
// always receive an undefined gradient.

// PyTorch quirk: nodes are held by std::shared_ptr in older releases, c10::intrusive_ptr in newer.
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

inline at::Tensor grad_or_zeros(const Node& node, const variable_list& grads, size_t i) {
  return grads[i].defined() ? grads[i] : node.input_metadata(i).zeros_like();
}

} // namespace torchdp::autograd::internal
