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
  const Names names = [&inputs](size_t k) {
    return detail::tensor_name(inputs, kArgumentNames, k);
  };
  auto tensors = detail::tensors_of(inputs);
  step_.check_defined(tensors, names);
  TORCH_CHECK_VALUE(!options.cuda_graphs(), kApi,
                    ": cuda_graphs replays forwards of tensor arguments that return one tensor; "
                    "this forward takes or returns other types. Turn cuda_graphs off, or give the "
                    "module a forward over tensors");
  return run_flat(
      std::move(tensors), names,
      [&](torch::nn::AnyModule& m, std::vector<at::Tensor>& args, bool split) {
        // Split arguments get containers of their own; otherwise unmoved ones stay the caller's.
        return call(m, detail::map_tensors(
                           inputs,
                           [&args](size_t k, const at::Tensor&) {
                             return args[k];
                           },
                           /*keep_unchanged=*/!split));
      },
      nullptr, buffers);
}

c10::IValue DataParallelImpl::join_structured(
    std::vector<c10::IValue> outputs, const std::shared_ptr<BufferSnapshot>& buffers) const {
  if (device_ids_.empty()) { // passthrough: where the module put it
    return std::move(outputs.front());
  }
  if (device_ids_.size() == 1) {
    return detail::to_device(outputs.front(), *output_device_, kApi, kOutputNames);
  }
  return detail::Step::gather(buffers, [&] {
    return detail::gather_value(outputs, *output_device_, options.dim(), kApi, kOutputNames);
  });
}

} // namespace torchdp
