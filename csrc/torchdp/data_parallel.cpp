#include <torchdp/data_parallel.h>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <numeric>

namespace torchdp {
namespace {

constexpr const char* kApi = "torchdp::DataParallel";

const detail::ValueNames kArgumentNames{"forward argument", true};

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

namespace detail {

void check_group_and_graphs(bool process_group, bool cuda_graphs, const char* api) {
  TORCH_CHECK_VALUE(!process_group || !cuda_graphs, api,
                    ": process_group cannot be combined with cuda_graphs (graphed replicas "
                    "deliver their gradients outside the hooks that average them); drop one of "
                    "the two");
}

std::string misplaced_module_message(c10::Device target, const std::string& kind,
                                     const std::string& name, c10::Device found,
                                     const std::string& fix) {
  // PyTorch's message first (code and tests match it), then the tensor and the fix.
  return c10::str("module must have its parameters and buffers on device ", target,
                  " (device_ids[0]) but found one of them on device: ", found, " (", kind, " '",
                  name, "'). ", fix);
}

} // namespace detail

void DataParallelImpl::init(std::shared_ptr<torch::nn::Module> module, Wrap wrap) {
  TORCH_CHECK(module != nullptr, kApi, ": the module to wrap is null");
  module_ = module;
  wrap_ = std::move(wrap);
  any_ = wrap_(module_);
  register_module("module", module_);
  replicator_ = std::make_unique<Replicator>(module_);
  auto devices = detail::resolve_devices(options.device_ids(), options.output_device(),
                                         options.bucket_cap_mb(), options.cuda_graphs(), kApi);
  device_ids_ = std::move(devices.device_ids);
  output_device_ = devices.output_device;
  check_shares();
  constructed_ = options;
}

void DataParallelImpl::check_shares() const {
  if (!options.shares() || device_ids_.empty()) {
    return;
  }
  detail::check_shares(*options.shares(), device_ids_.size(), kApi);
  TORCH_CHECK_VALUE(!options.cuda_graphs(), kApi,
                    ": options.shares and options.cuda_graphs cannot be combined (a graph is "
                    "captured for one split of the batch); turn cuda_graphs off or leave shares "
                    "unset");
}

void DataParallelImpl::check_fixed_options() const {
  auto fail = [](const char* name, const std::string& then, const std::string& now) {
    TORCH_CHECK(false, kApi, ": options.", name, " was changed after construction (", then, " -> ",
                now,
                "); it is read only when the DataParallel is made. Make a new "
                "torchdp::DataParallel with the new options (dim, place_module and bucket_cap_mb "
                "may change between forwards)");
  };
  auto devices_text = [](const std::optional<std::vector<c10::Device>>& d) {
    return d ? devices_to_string(*d) : std::string("unset");
  };
  auto device_text = [](const std::optional<c10::Device>& d) {
    return d ? d->str() : std::string("unset");
  };
  if (options.device_ids() != constructed_.device_ids()) {
    fail("device_ids", devices_text(constructed_.device_ids()), devices_text(options.device_ids()));
  }
  if (options.output_device() != constructed_.output_device()) {
    fail("output_device", device_text(constructed_.output_device()),
         device_text(options.output_device()));
  }
  if (options.cuda_graphs() != constructed_.cuda_graphs()) {
    fail("cuda_graphs", constructed_.cuda_graphs() ? "true" : "false",
         options.cuda_graphs() ? "true" : "false");
  }
}

std::vector<at::Tensor> DataParallelImpl::ensure_placement() {
  const auto target = device_ids_.front();
  const auto off = [&target](const at::Tensor& t) {
    return t.defined() && detail::canonical(t.device()) != target;
  };
  const auto params = module_->parameters();
  auto buffers = module_->buffers();
  if (std::none_of(params.begin(), params.end(), off) &&
      std::none_of(buffers.begin(), buffers.end(), off)) {
    return buffers;
  }
  if (options.place_module()) {
    // Refused before the move: meta keeps no values, and clone() cannot copy from it.
    TORCH_CHECK(!target.is_meta() || device_ids_.size() == 1, kApi,
                ": place_module(true) would move the module to meta (device_ids[0]), which keeps "
                "no values, and LibTorch's Cloneable::clone() cannot build replicas from a module "
                "on meta. List a device with data first (device_ids {cpu, meta}), or call "
                "torchdp::data_parallel, which copies a CPU module to meta devices");
    detail::move_module(*module_, target);
    return module_->buffers();
  }
  const auto bad = detail::find_misplaced(*module_, target);
  TORCH_CHECK(!bad, kApi, ": ",
              detail::misplaced_module_message(
                  target, bad->kind, bad->name, bad->device,
                  c10::str("Move the module there before the forward, e.g. "
                           "module->to(torch::Device(\"",
                           target,
                           "\")), or construct DataParallel with "
                           "DataParallelOptions().place_module(true) to let it move the module "
                           "itself")));
  return buffers; // not reached: find_misplaced sees what the checks above saw
}

NoSync::NoSync(DataParallelImpl& dp) : dp_(dp), previous_(dp.require_backward_grad_sync_) {
  dp_.require_backward_grad_sync_ = false;
}

NoSync::~NoSync() {
  dp_.require_backward_grad_sync_ = previous_;
}

std::vector<at::Tensor> DataParallelImpl::run(std::vector<at::Tensor> inputs, const Call& call,
                                              std::shared_ptr<BufferSnapshot>* buffers) {
  const Names names = [](size_t k) {
    return c10::str("forward argument ", k);
  };
  step_.check_defined(inputs, names);
  auto outputs = run_flat(
      std::move(inputs), names,
      [&call](torch::nn::AnyModule& m, std::vector<at::Tensor>& args, bool) {
        return c10::IValue(call(m, args));
      },
      options.cuda_graphs() ? &call : nullptr, buffers);
  std::vector<at::Tensor> tensors;
  tensors.reserve(outputs.size());
  for (auto& o : outputs) {
    tensors.push_back(std::move(o).toTensor());
  }
  return tensors;
}

std::vector<c10::IValue> DataParallelImpl::run_flat(std::vector<at::Tensor> inputs,
                                                    const Names& names, const FlatCall& call,
                                                    const Call* graph_call,
                                                    std::shared_ptr<BufferSnapshot>* buffers,
                                                    const detail::Items* items) {
  check_fixed_options();
#if TORCHDP_WITH_C10D
  const auto& group = options.process_group();
  // A conflict of options is reported before anything about the module (its placement).
  detail::check_group_and_graphs(static_cast<bool>(group), options.cuda_graphs(), kApi);
#endif
  // The module's buffers, once it is on device_ids[0] (none when passing through).
  const auto originals = device_ids_.empty() ? std::vector<at::Tensor>() : ensure_placement();
#if TORCHDP_WITH_C10D
  bool grad_sync = false;
  size_t bucket_bytes = autograd::kDefaultGradBucketSize;
  if (!group) {
    sync_.reset();
  } else {
    if (!sync_ || sync_->group() != group) {
      sync_ = std::make_shared<detail::ProcessGroupSync>(group, kApi);
    }
    // The module is on its device by now: the state is synchronised where it will run.
    grad_sync = c10::GradMode::is_enabled() && require_backward_grad_sync_;
    if (grad_sync && options.bucket_cap_mb()) { // checked before the module runs
      bucket_bytes = autograd::bucket_bytes_from_mib(*options.bucket_cap_mb(), kApi);
    }
    sync_->before_forward(*module_, grad_sync && options.broadcast_buffers());
  }
#endif
  auto outputs = run_here(std::move(inputs), names, call, graph_call, originals, buffers, items);
#if TORCHDP_WITH_C10D
  if (grad_sync) {
    std::vector<at::Tensor> watched;
    for (const auto& o : outputs) {
      const auto tensors = detail::tensors_of(o);
      watched.insert(watched.end(), tensors.begin(), tensors.end());
    }
    sync_->watch(watched, bucket_bytes);
  }
#endif
  return outputs;
}

std::vector<c10::IValue> DataParallelImpl::run_here(std::vector<at::Tensor> inputs,
                                                    const Names& names, const FlatCall& call,
                                                    const Call* graph_call,
                                                    const std::vector<at::Tensor>& originals,
                                                    std::shared_ptr<BufferSnapshot>* buffers,
                                                    const detail::Items* items) {
  if (device_ids_.empty()) {
    return {call(any_, inputs, false)};
  }
  detail::Split split;
  if (device_ids_.size() == 1) {
    for (auto& x : inputs) {
      x = x.to(device_ids_.front());
    }
    split = {device_ids_, {std::move(inputs)}};
  } else if (items != nullptr) {
    check_shares();
    split = step_.split_items(inputs, *items, device_ids_, options.dim(), names, options.shares());
  } else {
    check_shares();
    split = step_.split(inputs, device_ids_, options.dim(), names, options.shares());
  }
  if (graph_call != nullptr) {
    auto outputs = run_graphed(split.parts, *graph_call);
    if (!outputs.empty()) {
      return std::vector<c10::IValue>(std::make_move_iterator(outputs.begin()),
                                      std::make_move_iterator(outputs.end()));
    }
  }
  if (device_ids_.size() == 1) {
    return {call(any_, split.parts.front(), false)};
  }
  std::vector<c10::IValue> outputs(split.used.size());
  std::vector<std::shared_ptr<torch::nn::Module>> replicas;
  step_.run(
      split.used, originals, options.bucket_cap_mb(), buffers,
      [&] {
        replicas = replicator_->replicate(split.used, /*detach=*/!c10::GradMode::is_enabled());
      },
      [&](size_t i) {
        auto replica = wrap_(replicas[i]);
        outputs[i] = call(replica, split.parts[i], true);
      });
  return outputs;
}

std::vector<at::Tensor> DataParallelImpl::run_graphed(
    const std::vector<std::vector<at::Tensor>>& chunks, const Call& call) {
  if (!graphed_ || graphed_->module() != module_) {
    graphed_ = std::make_shared<detail::GraphedReplicas>(module_, device_ids_, 8);
  }
  return graphed_->run(chunks, [this, &call](const std::shared_ptr<torch::nn::Module>& replica,
                                             std::vector<at::Tensor>& args) {
    auto any = wrap_(replica);
    return call(any, args);
  });
}

int64_t DataParallelImpl::graph_captures() const {
  return graphed_ ? graphed_->captures_made() : 0;
}

at::Tensor DataParallelImpl::join(std::vector<at::Tensor> outputs,
                                  const std::shared_ptr<BufferSnapshot>& buffers) const {
  if (device_ids_.empty()) { // passthrough: where the module put it
    return std::move(outputs.front());
  }
  if (device_ids_.size() == 1) { // one device: no gather, only the move to output_device
    return outputs.front().to(*output_device_);
  }
  return detail::Step::gather(buffers, [&] {
    return autograd::gather(outputs, *output_device_, options.dim());
  });
}

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
  // Note [Lists of samples]: the std::vector<at::Tensor> arguments are lists of samples, split
  // by item with samples on; otherwise checked to be batches where there is a split.
  const auto& arguments = inputs.toTupleRef().elements();
  detail::Items flat{{}, -1};
  if (options.samples()) {
    for (const auto a : c10::irange(arguments.size())) {
      if (!arguments[a].isTensorList()) {
        flat.item_of.insert(flat.item_of.end(), detail::tensors_of(arguments[a]).size(), -1);
        continue;
      }
      const auto length = static_cast<int64_t>(arguments[a].toTensorList().size());
      TORCH_CHECK_VALUE(flat.items < 0 || flat.items == length, kApi,
                        ": the lists of samples have different lengths: ", flat.items,
                        " samples in an earlier argument but forward argument ", a, " has ", length,
                        "; give every list one entry per sample");
      flat.items = length;
      for (const auto k : c10::irange(length)) {
        flat.item_of.push_back(k);
      }
    }
  } else if (device_ids_.size() > 1) {
    std::vector<detail::BatchList> lists;
    for (const auto a : c10::irange(arguments.size())) {
      if (arguments[a].isTensorList()) {
        detail::BatchList described{c10::str("forward argument ", a), {}};
        for (const auto& t : arguments[a].toTensorVector()) {
          described.shapes.push_back(t.sizes().vec());
        }
        lists.push_back(std::move(described));
      }
    }
    detail::check_batch_lists(lists, device_ids_.size(), options.dim(), kApi,
                              "DataParallelOptions().samples(true)");
  }
  const bool by_item = flat.items >= 0;
  return run_flat(
      std::move(tensors), names,
      [&](torch::nn::AnyModule& m, std::vector<at::Tensor>& args, bool split) {
        // Split arguments get containers of their own; otherwise unmoved ones stay the caller's.
        auto mine = detail::map_tensors(
            inputs,
            [&args](size_t k, const at::Tensor&) {
              return args[k];
            },
            /*keep_unchanged=*/!split);
        if (by_item && split) { // each list keeps this replica's samples only
          auto parts = mine.toTupleRef().elements().vec();
          for (auto& part : parts) {
            if (part.isTensorList()) {
              std::vector<at::Tensor> own;
              for (auto& t : part.toTensorVector()) {
                if (t.defined()) {
                  own.push_back(std::move(t));
                }
              }
              part = c10::IValue(std::move(own));
            }
          }
          mine = c10::ivalue::Tuple::create(std::move(parts));
        }
        return call(m, mine);
      },
      nullptr, buffers, by_item ? &flat : nullptr);
}

at::Tensor parallel_loss(
    const std::vector<at::Tensor>& outputs, const at::Tensor& target,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss_fn,
    LossReduction reduction, int64_t dim, std::optional<c10::Device> output_device) {
  constexpr const char* api = "torchdp::parallel_loss";
  TORCH_CHECK(!outputs.empty(), api,
              ": got no outputs; pass the per-replica outputs of "
              "DataParallel::forward_replicas");
  TORCH_CHECK(static_cast<bool>(loss_fn), api, ": loss_fn is empty");
  TORCH_CHECK(target.defined(), api, ": the target is an undefined tensor");
  TORCH_CHECK(target.dim() > 0, api,
              ": the target is a 0-dim tensor, which cannot be split along dim ", dim,
              "; give it a batch dimension");
  std::vector<c10::Device> devices;
  for (const auto i : c10::irange(outputs.size())) {
    TORCH_CHECK(outputs[i].defined(), api, ": output ", i, " is an undefined tensor");
    devices.push_back(detail::canonical(outputs[i].device()));
  }
  // Outputs of uneven shares (Note [Uneven shares]): the target split by their rows.
  std::optional<std::vector<int64_t>> rows;
  if (dim >= -target.dim() && dim < target.dim()) {
    std::vector<int64_t> sizes;
    for (const auto& out : outputs) {
      if (dim < -out.dim() || dim >= out.dim()) {
        break;
      }
      sizes.push_back(out.size(dim));
    }
    if (sizes.size() == outputs.size() &&
        std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) == target.size(dim)) {
      const auto even =
          at::empty({target.size(dim)}, at::kMeta).chunk(static_cast<int64_t>(outputs.size()));
      bool same = even.size() == sizes.size();
      for (size_t i = 0; same && i < even.size(); ++i) {
        same = even[i].size(0) == sizes[i];
      }
      if (!same) {
        rows = std::move(sizes);
      }
    }
  }
  auto chunks = autograd::scatter(target, devices, rows, dim);
  TORCH_CHECK(chunks.size() == outputs.size(), api, ": the target splits into ", chunks.size(),
              " chunks along dim ", dim, " (size ", target.size(dim), ") but there are ",
              outputs.size(), " outputs; pass a target with the same batch size as the inputs");
  const auto destination = output_device ? normalize_device(*output_device, api) : devices.front();
  std::vector<at::Tensor> losses;
  std::vector<int64_t> counts;
  for (const auto i : c10::irange(outputs.size())) {
    auto loss = loss_fn(outputs[i], chunks[i]);
    TORCH_CHECK(
        loss.defined() && (loss.dim() == 0 || reduction == LossReduction::None), api,
        ": loss_fn must return a 0-dim tensor, but for replica ", i, " it returned ",
        loss.defined() ? c10::str("sizes ", loss.sizes()) : std::string("an undefined tensor"));
    losses.push_back(std::move(loss));
    counts.push_back(chunks[i].size(dim));
  }
  return detail::combine_losses(std::move(losses), counts, target.size(dim), reduction, dim,
                                destination);
}

void DataParallelImpl::pretty_print(std::ostream& stream) const {
  stream << "torchdp::DataParallel(device_ids=" << devices_to_string(device_ids_);
  if (output_device_) {
    stream << ", output_device=" << *output_device_;
  }
  stream << ", dim=" << options.dim();
  if (options.cuda_graphs()) {
    stream << ", cuda_graphs=true";
  }
  stream << ")";
}

} // namespace torchdp
