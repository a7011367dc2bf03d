// DataParallel's structured forward: arguments and outputs beyond tensors (Note [Arguments of
// the structured forward] in data_parallel.h), over the structure engine of structure.h.
#include <torchdp/data_parallel.h>
#include <torchdp/structure.h>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <c10/util/irange.h>

#include <algorithm>

namespace torchdp {
namespace {

constexpr const char* kApi = "torchdp::DataParallel";

const detail::ValueNames kArgumentNames{"forward argument", true};
const detail::ValueNames kOutputNames{"the output", false};

std::string type_name(const std::type_info& type) {
  return c10::demangle(type.name());
}

std::string type_list(const std::vector<const std::type_info*>& types) {
  std::string out;
  for (const auto* t : types) {
    out += (out.empty() ? "" : ", ") + type_name(*t);
  }
  return "(" + out + ")";
}

} // namespace

void DataParallelImpl::check_call(const std::type_info& output,
                                  const std::vector<const std::type_info*>& arguments) const {
  if (signature_.output == nullptr) {
    return;
  }
  const auto& params = signature_.arguments;
  TORCH_CHECK_TYPE(arguments.size() <= params.size(), kApi, ": forward got ", arguments.size(),
                   " arguments ", type_list(arguments), " but the module's forward takes ",
                   params.size(), " ", type_list(params), "; pass its arguments");
  for (const auto k : c10::irange(arguments.size())) {
    TORCH_CHECK_TYPE(*arguments[k] == *params[k], kApi, ": forward argument ", k, " is a ",
                     type_name(*arguments[k]), " but the module's forward takes a ",
                     type_name(*params[k]),
                     " there; pass that type (each replica's module gets the argument through "
                     "torch::nn::AnyModule, which matches types exactly)");
  }
  TORCH_CHECK_TYPE(output == *signature_.output, kApi, ": the module's forward returns ",
                   type_name(*signature_.output), " but forward<", type_name(output),
                   "> was called; call forward<", type_name(*signature_.output),
                   ">(...) to get the gathered output in that type");
}

std::vector<c10::IValue> DataParallelImpl::run_structured(
    c10::IValue inputs, const StructuredCall& call, std::shared_ptr<BufferSnapshot>* buffers) {
  detail::for_each_tensor(inputs, kArgumentNames, [](const at::Tensor& t, const auto& name) {
    TORCH_CHECK(t.defined(), kApi, ": ", name(), " is an undefined tensor");
  });
  TORCH_CHECK_VALUE(!options.cuda_graphs(), kApi,
                    ": cuda_graphs replays forwards of tensor arguments that return one tensor; "
                    "this forward takes or returns other types. Turn cuda_graphs off, or give the "
                    "module a forward over tensors");
  std::vector<c10::IValue> outputs;
  run_step([&](const std::vector<at::Tensor>& originals) {
    if (device_ids_.empty()) {
      outputs = {call(any_, inputs)};
    } else if (device_ids_.size() == 1) {
      outputs = {call(any_, detail::to_device(inputs, device_ids_.front(), kApi, kArgumentNames))};
    } else {
      detail::check_forward_context(kApi);
      const auto dim = options.dim();
      auto parts = detail::scatter_value(inputs, device_ids_, dim, kApi, kArgumentNames);
      const size_t n = parts.size();
      if (n < device_ids_.size()) { // a small batch, or a short tensor that would drop rows
        std::vector<std::pair<std::string, int64_t>> sizes;
        detail::for_each_tensor(inputs, kArgumentNames,
                                [&sizes, dim](const at::Tensor& t, const auto& name) {
                                  sizes.emplace_back(name(), t.size(dim));
                                });
        detail::check_chunks(sizes, n, device_ids_.size(), dim, kApi);
      }
      const std::vector<c10::Device> used(device_ids_.begin(), device_ids_.begin() + n);
      outputs.assign(n, c10::IValue());
      apply_replicas(
          used,
          [&](size_t i, torch::nn::AnyModule& replica) {
            outputs[i] = call(replica, parts[i]);
          },
          originals, buffers);
    }
    std::vector<at::Tensor> tensors; // what a process group watches
    for (const auto& o : outputs) {
      auto t = detail::tensors_of(o);
      tensors.insert(tensors.end(), t.begin(), t.end());
    }
    return tensors;
  });
  return outputs;
}

c10::IValue DataParallelImpl::join_structured(
    std::vector<c10::IValue> outputs, const std::shared_ptr<BufferSnapshot>& buffers) const {
  if (device_ids_.empty()) { // passthrough: where the module put it
    return std::move(outputs.front());
  }
  if (device_ids_.size() == 1) {
    return detail::to_device(outputs.front(), *output_device_, kApi, kOutputNames);
  }
  return detail::gather_and_release(buffers, [&] {
    return detail::gather_value(outputs, *output_device_, options.dim(), kApi, kOutputNames);
  });
}

} // namespace torchdp
