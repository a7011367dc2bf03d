#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <vector>

/// Scatter and gather over nested inputs and outputs, held as c10::IValue: tensors inside tuples,
/// lists and dicts are split (scatter) or concatenated (gather) through the differentiable autograd
/// layer; everything else (None, numbers, strings, empty containers, custom objects) is handed to
/// every replica as it is, as torch.nn.parallel.scatter does.
namespace torchdp {

/// Splits `inputs` into one structure per chunk. Tensors are scattered with
/// autograd::scatter(tensor, devices, nullopt, dim); containers are rebuilt per chunk with the same
/// keys and element types. The number of chunks is the smallest over all tensor leaves (a batch of
/// 3 on 4 devices gives 3); with no tensor leaf it is devices.size().
std::vector<c10::IValue> scatter(const c10::IValue& inputs, const std::vector<c10::Device>& devices,
                                 int64_t dim = 0);

/// Joins per-replica outputs of the same structure on `destination`: tensors with
/// autograd::gather(..., destination, dim), tuples, lists and dicts element by element (dicts must
/// have the same keys), None stays None. Other values raise an error naming their type.
c10::IValue gather(const std::vector<c10::IValue>& outputs, c10::Device destination,
                   int64_t dim = 0);

} // namespace torchdp
