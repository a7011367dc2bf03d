#pragma once

// The scripted model of the C++ benchmark (bench_cpp.cpp): cpp_mlp200's layers as a
// torch::jit::Module, and its training steps under ScriptDataParallel.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torchdp_bench {

/// A scripted MLP with the given Linear layers (weight, bias, weight, bias, ...; each followed by
/// a ReLU), as TorchScript runs a model saved from Python. The tensors are copied.
torch::jit::Module script_mlp(const std::vector<at::Tensor>& parameters);

/// One training step of `module` (zero_grad, forward, loss = out.pow(2).mean(), backward, SGD
/// step with lr 1e-3), returning the loss, in `mode`: "single" (the module on devices[0]),
/// "torchdp" (torchdp::ScriptDataParallel over `devices`), "torchdp_new_replicas" (the same with
/// its replicas rebuilt at every step). The step owns everything it uses.
std::function<at::Tensor()> script_train_step(torch::jit::Module module, const at::Tensor& input,
                                              const std::vector<c10::Device>& devices,
                                              const std::string& mode);

/// The L2 norm of the gradients of `module`'s parameters.
double script_grad_norm(const torch::jit::Module& module);

/// One call of torchdp::ScriptReplicator::replicate onto `devices` (differentiable), with the
/// replicas kept between calls (`cached`) or rebuilt at each.
std::function<void()> script_replicate(torch::jit::Module module,
                                       const std::vector<c10::Device>& devices, bool cached);

} // namespace torchdp_bench
