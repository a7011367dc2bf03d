// torchdp::ScriptDataParallel: DataParallel's forward for scripted modules, over the structure
// engine (Note [Nested scatter and gather]) and the ScriptReplicator.
#include <torchdp/devices.h>
#include <torchdp/script_module.h>
#include <torchdp/shares.h>
#include <torchdp/structure.h>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace torchdp {
namespace {

constexpr const char* kApi = "torchdp::ScriptDataParallel";

const detail::ValueNames kArgumentNames{"forward argument", true};
const detail::ValueNames kKeywordNames{"keyword argument", true};

c10::IValue keywords_value(const torch::jit::Kwargs& kwargs) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [key, value] : kwargs) {
    dict.insert(key, value);
  }
  return dict;
}

torch::jit::Kwargs keywords_of(const c10::IValue& value) {
  torch::jit::Kwargs kwargs;
  for (const auto& entry : value.toGenericDict()) {
    kwargs.emplace(entry.key().toStringRef(), entry.value());
  }
  return kwargs;
}

} // namespace

ScriptDataParallel::ScriptDataParallel(torch::jit::Module module, DataParallelOptions options)
    : module_(std::move(module)), options_(std::move(options)) {
  TORCH_CHECK(module_._ivalue() != nullptr, kApi, ": the module is empty");
  TORCH_CHECK(module_.find_method("forward").has_value(), kApi,
              ": the scripted module has no forward method; script a module that defines "
              "forward, or call its method through torchdp::parallel_apply");
  TORCH_CHECK_VALUE(!options_.cuda_graphs(), kApi,
                    ": cuda_graphs is not supported for scripted modules; turn it off");
#if TORCHDP_WITH_C10D
  TORCH_CHECK_VALUE(!options_.process_group(), kApi,
                    ": process_group is not supported for scripted modules; wrap the module in "
                    "torch::nn::Module code and use torchdp::DataParallel, or reduce the "
                    "gradients yourself after the backward pass");
#endif
  replicator_ = std::make_unique<ScriptReplicator>(module_);
  auto devices = detail::resolve_devices(options_.device_ids(), options_.output_device(),
                                         options_.bucket_cap_mb(), /*cuda_graphs=*/false, kApi);
  device_ids_ = std::move(devices.device_ids);
  output_device_ = devices.output_device;
  if (options_.shares() && !device_ids_.empty()) {
    detail::check_shares(*options_.shares(), device_ids_.size(), kApi);
  }
}

std::vector<at::Tensor> ScriptDataParallel::parameters() const {
  std::vector<at::Tensor> all;
  for (const auto& p : module_.parameters()) {
    all.push_back(p);
  }
  return detail::distinct(all);
}

void ScriptDataParallel::ensure_placement() {
  const auto target = device_ids_.front();
  const auto off = [&target](const at::Tensor& t) {
    return t.defined() && detail::canonical(t.device()) != target;
  };
  bool misplaced = false;
  for (const auto& p : module_.parameters()) {
    misplaced = misplaced || off(p);
  }
  for (const auto& b : module_.buffers()) {
    misplaced = misplaced || off(b);
  }
  if (!misplaced) {
    return;
  }
  if (options_.place_module()) {
    module_.to(target);
    return;
  }
  const auto check = [&](const char* kind, const std::string& name, const at::Tensor& t) {
    TORCH_CHECK(!off(t), kApi, ": ",
                detail::misplaced_module_message(
                    target, kind, name, t.device(),
                    c10::str("Move the module there before the forward, e.g. module.to(",
                             "torch::Device(\"", target,
                             "\")), or pass DataParallelOptions().place_module(true) to let "
                             "ScriptDataParallel move it")));
  };
  for (const auto& p : module_.named_parameters()) {
    check("parameter", p.name, p.value);
  }
  for (const auto& b : module_.named_buffers()) {
    check("buffer", b.name, b.value);
  }
}

std::vector<c10::IValue> ScriptDataParallel::run(std::vector<c10::IValue> inputs,
                                                 const torch::jit::Kwargs& kwargs,
                                                 std::shared_ptr<BufferSnapshot>* buffers) {
  if (device_ids_.empty()) {
    return {module_.forward(std::move(inputs), kwargs)};
  }
  ensure_placement();
  if (device_ids_.size() == 1) {
    const auto d = device_ids_.front();
    auto args =
        detail::to_device(c10::ivalue::Tuple::create(std::move(inputs)), d, kApi, kArgumentNames);
    auto keywords =
        kwargs.empty()
            ? kwargs
            : keywords_of(detail::to_device(keywords_value(kwargs), d, kApi, kKeywordNames));
    const auto& elements = args.toTupleRef().elements();
    return {module_.forward(std::vector<c10::IValue>(elements.begin(), elements.end()), keywords)};
  }
  // Note [The step engine]: the positional arguments' tensors, then the keywords'.
  const auto args_value = c10::IValue(c10::ivalue::Tuple::create(std::move(inputs)));
  const auto keywords = keywords_value(kwargs);
  auto tensors = detail::tensors_of(args_value);
  const size_t positional = tensors.size();
  const auto keyword_tensors = detail::tensors_of(keywords);
  tensors.insert(tensors.end(), keyword_tensors.begin(), keyword_tensors.end());
  const auto split = step_.split(
      tensors, device_ids_, options_.dim(),
      [&](size_t k) {
        return k < positional ? detail::tensor_name(args_value, kArgumentNames, k)
                              : detail::tensor_name(keywords, kKeywordNames, k - positional);
      },
      options_.shares());
  // Note [Buffers of failed forwards]: every tensor attribute that is not a parameter.
  std::vector<at::Tensor> originals;
  for (const auto& b : module_.buffers()) {
    originals.push_back(b);
  }
  std::vector<torch::jit::Module> replicas;
  std::vector<c10::IValue> outputs(split.used.size());
  step_.run(
      split.used, originals, options_.bucket_cap_mb(), buffers,
      [&] {
        replicas = replicator_->replicate(split.used, /*detach=*/!c10::GradMode::is_enabled());
      },
      [&](size_t i) {
        const auto& part = split.parts[i];
        const auto args = detail::map_tensors(
            args_value,
            [&part](size_t k, const at::Tensor&) {
              return part[k];
            },
            /*keep_unchanged=*/false);
        const auto keyword_part = detail::map_tensors(
            keywords,
            [&part, positional](size_t k, const at::Tensor&) {
              return part[positional + k];
            },
            /*keep_unchanged=*/false);
        const auto& elements = args.toTupleRef().elements();
        outputs[i] = replicas[i].forward(std::vector<c10::IValue>(elements.begin(), elements.end()),
                                         keywords_of(keyword_part));
      });
  return outputs;
}

std::vector<c10::IValue> ScriptDataParallel::forward_replicas(std::vector<c10::IValue> inputs,
                                                              const torch::jit::Kwargs& kwargs) {
  return run(std::move(inputs), kwargs, nullptr);
}

c10::IValue ScriptDataParallel::forward(std::vector<c10::IValue> inputs,
                                        const torch::jit::Kwargs& kwargs) {
  std::shared_ptr<BufferSnapshot> buffers; // Note [Buffers of failed forwards]
  auto outputs = run(std::move(inputs), kwargs, &buffers);
  return step_.join(std::move(outputs), device_ids_.size(), output_device_, options_.dim(),
                    buffers);
}

} // namespace torchdp
