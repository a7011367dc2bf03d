#include <torchdp/data_parallel.h>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>

namespace torchdp {
namespace {

constexpr const char* kApi = "torchdp::DataParallel";

} // namespace

namespace detail {

void check_group_and_graphs(bool process_group, bool cuda_graphs, const char* api) {
  TORCH_CHECK_VALUE(!process_group || !cuda_graphs, api,
                    ": process_group cannot be combined with cuda_graphs (graphed replicas "
                    "deliver their gradients outside the hooks that average them); drop one of "
                    "the two");
}

void check_cuda_graphs(const std::vector<c10::Device>& devices, const char* api) {
  // The devices first: they are what the caller can change on any build.
  for (const auto& d : devices) {
    TORCH_CHECK_VALUE(d.is_cuda(), api, ": cuda_graphs=True needs CUDA devices, got devices ",
                      devices_to_string(devices), "; turn cuda_graphs off or use CUDA devices");
  }
  TORCH_CHECK(cuda_graphs_available(), api,
              ": cuda_graphs needs torchdp built with its CUDA fast paths (TORCHDP_WITH_CUDA); "
              "this build has none. Turn cuda_graphs off");
}

namespace {
// How many chunks torch.chunk makes of `size` rows for `n` devices.
size_t chunk_count(int64_t size, size_t n) {
  if (size <= 0) {
    return 1;
  }
  const auto devices = static_cast<int64_t>(n);
  const int64_t step = (size + devices - 1) / devices;
  return static_cast<size_t>((size + step - 1) / step);
}
} // namespace

// Note [Per-replica rows]
// A tensor of exactly one row per device along dim is a value per replica (the Hugging Face
// Trainer's num_items_in_batch, expanded to (n_gpu, 1)), not rows of the batch. When the batch
// splits into fewer chunks than devices, the replicas that run take their rows and the rows of the
// replicas that do not run are left out, as nn.DataParallel's scatter does. Any other tensor that
// would lose rows is refused.
void check_chunks(const std::vector<std::pair<std::string, int64_t>>& sizes, size_t chunks,
                  size_t n, int64_t dim, const char* api) {
  if (chunks >= n || sizes.empty()) {
    return;
  }
  std::vector<std::pair<std::string, int64_t>> batch;
  for (const auto& s : sizes) {
    if (s.second != static_cast<int64_t>(n)) {
      batch.push_back(s);
    }
  }
  if (batch.empty()) {
    return;
  }
  const auto fewer = [n](const auto& a, const auto& b) {
    return chunk_count(a.second, n) < chunk_count(b.second, n);
  };
  const auto& longest = *std::max_element(batch.begin(), batch.end(), fewer);
  const auto& shortest = *std::min_element(sizes.begin(), sizes.end(), fewer);
  TORCH_CHECK_VALUE(chunk_count(longest.second, n) <= chunks, api,
                    ": the input tensors have different sizes along dim ", dim, ": ", longest.first,
                    " has ", longest.second, " but ", shortest.first, " has ", shortest.second,
                    ", which splits into only ", chunk_count(shortest.second, n), " chunk(s) for ",
                    n,
                    " devices; the extra rows of the longer tensors would be dropped. Give every "
                    "tensor the batch size along that dim (or exactly one row per device, for a "
                    "value per replica), or pass the shorter one in another form (a buffer of the "
                    "module, or a Python list)");
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
  if (options.device_ids()) {
    TORCH_CHECK(!options.device_ids()->empty(), kApi,
                ": device_ids is an empty list; pass the devices to use, or leave device_ids unset "
                "to use every visible CUDA device");
    device_ids_ = normalize_devices(*options.device_ids(), kApi);
  } else if (cuda_device_count() > 0) {
    device_ids_ = default_devices(kApi);
  }
  if (options.bucket_cap_mb()) {
    autograd::bucket_bytes_from_mib(*options.bucket_cap_mb(), kApi); // checked at construction
  }
  if (options.cuda_graphs()) {
    detail::check_cuda_graphs(device_ids_, kApi);
  }
  if (options.output_device()) {
    TORCH_CHECK(!device_ids_.empty(), kApi, ": output_device ", *options.output_device(),
                " was given but no device is in use (no CUDA device is visible and device_ids is "
                "unset); pass device_ids too");
    output_device_ = normalize_device(*options.output_device(), kApi);
    check_output_device(device_ids_, *output_device_, kApi);
  } else if (!device_ids_.empty()) {
    output_device_ = device_ids_.front();
  }
  constructed_ = options;
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
  for (const auto i : c10::irange(inputs.size())) {
    TORCH_CHECK(inputs[i].defined(), kApi, ": forward argument ", i, " is an undefined tensor");
  }
  std::vector<at::Tensor> outputs;
  run_step([&](const std::vector<at::Tensor>& originals) {
    outputs = run_here(std::move(inputs), call, originals, buffers);
    return outputs;
  });
  return outputs;
}

void DataParallelImpl::run_step(
    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& here) {
  check_fixed_options();
#if TORCHDP_WITH_C10D
  const auto& group = options.process_group();
  // A conflict of options is reported before anything about the module (its placement).
  detail::check_group_and_graphs(static_cast<bool>(group), options.cuda_graphs(), kApi);
#endif
  // The module's buffers, once it is on device_ids[0] (none when passing through).
  const auto originals = device_ids_.empty() ? std::vector<at::Tensor>() : ensure_placement();
#if TORCHDP_WITH_C10D
  if (!group) {
    sync_.reset();
    here(originals);
    return;
  }
  if (!sync_ || sync_->group() != group) {
    sync_ = std::make_shared<detail::ProcessGroupSync>(group, kApi);
  }
  // The module is on its device by now: the state is synchronised where it will run.
  const bool grad_sync = c10::GradMode::is_enabled() && require_backward_grad_sync_;
  // Checked before the module runs (a bad value leaves its buffers as they were).
  const size_t bucket_bytes = grad_sync && options.bucket_cap_mb()
                                  ? autograd::bucket_bytes_from_mib(*options.bucket_cap_mb(), kApi)
                                  : autograd::kDefaultGradBucketSize;
  sync_->before_forward(*module_, grad_sync && options.broadcast_buffers());
  const auto outputs = here(originals);
  if (grad_sync) {
    sync_->watch(outputs, bucket_bytes);
  }
#else
  here(originals);
#endif
}

std::vector<at::Tensor> DataParallelImpl::run_here(std::vector<at::Tensor> inputs, const Call& call,
                                                   const std::vector<at::Tensor>& originals,
                                                   std::shared_ptr<BufferSnapshot>* buffers) {
  if (device_ids_.empty()) {
    return {call(any_, inputs)};
  }
  const auto dim = options.dim();
  if (device_ids_.size() == 1) {
    for (auto& x : inputs) {
      x = x.to(device_ids_.front());
    }
    if (options.cuda_graphs()) {
      auto outputs = run_graphed({inputs}, call);
      if (!outputs.empty()) {
        return outputs;
      }
    }
    return {call(any_, inputs)};
  }
  detail::check_forward_context(kApi);
  std::vector<std::vector<at::Tensor>> chunks(inputs.size());
  size_t n = device_ids_.size();
  for (const auto k : c10::irange(inputs.size())) {
    TORCH_CHECK(inputs[k].dim() > 0, kApi, ": forward argument ", k,
                " is a 0-dim tensor, which cannot be split along dim ", dim,
                "; give it a batch dimension");
    TORCH_CHECK_INDEX(dim >= -inputs[k].dim() && dim < inputs[k].dim(), kApi, ": dim ", dim,
                      " (DataParallelOptions::dim) is out of range for forward argument ", k,
                      " of shape ", inputs[k].sizes(), "; it must be in [", -inputs[k].dim(), ", ",
                      inputs[k].dim() - 1, "], the dimension the batch is split along");
    chunks[k] = autograd::scatter(inputs[k], device_ids_, std::nullopt, dim);
    n = std::min(n, chunks[k].size());
  }
  if (n < device_ids_.size()) { // a small batch, or a short tensor that would drop rows
    std::vector<std::pair<std::string, int64_t>> sizes;
    for (const auto k : c10::irange(inputs.size())) {
      sizes.emplace_back(c10::str("forward argument ", k), inputs[k].size(dim));
    }
    detail::check_chunks(sizes, n, device_ids_.size(), dim, kApi);
  }
  const std::vector<c10::Device> used(device_ids_.begin(), device_ids_.begin() + n);
  std::vector<std::vector<at::Tensor>> per_replica(n); // replica i's arguments
  for (const auto i : c10::irange(n)) {
    per_replica[i].reserve(chunks.size());
    for (auto& c : chunks) {
      per_replica[i].push_back(c[i]);
    }
  }
  if (options.cuda_graphs()) {
    auto outputs = run_graphed(per_replica, call);
    if (!outputs.empty()) {
      return outputs;
    }
  }
  std::vector<at::Tensor> outputs(n);
  apply_replicas(
      used,
      [&](size_t i, torch::nn::AnyModule& replica) {
        outputs[i] = call(replica, per_replica[i]);
      },
      originals, buffers);
  return outputs;
}

void DataParallelImpl::apply_replicas(const std::vector<c10::Device>& used,
                                      const std::function<void(size_t, torch::nn::AnyModule&)>& fn,
                                      const std::vector<at::Tensor>& originals,
                                      std::shared_ptr<BufferSnapshot>* buffers) {
  std::optional<autograd::GradBucketSizeGuard> bucket_size;
  if (options.bucket_cap_mb()) {
    bucket_size.emplace(autograd::bucket_bytes_from_mib(*options.bucket_cap_mb(), kApi));
  }
  detail::run_with_rollback(buffer_snapshot_, originals, buffers, [&] {
    auto replicas = replicator_->replicate(used, /*detach=*/!c10::GradMode::is_enabled());
    parallel_run(used.size(), used, [&](size_t i) {
      auto replica = wrap_(replicas[i]);
      fn(i, replica);
    });
  });
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
  return detail::gather_and_release(buffers, [&] {
    return autograd::gather(outputs, *output_device_, options.dim());
  });
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
  auto chunks = autograd::scatter(target, devices, std::nullopt, dim);
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
