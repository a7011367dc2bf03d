// The step engine of the C++ front ends (Note [The step engine] in step.h).
#include <torchdp/autograd.h>
#include <torchdp/devices.h>
#include <torchdp/enclosing_forward.h>
#include <torchdp/graphed_replicas.h>
#include <torchdp/parallel_apply.h>
#include <torchdp/shares.h>
#include <torchdp/step.h>
#include <torchdp/structure.h>

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>

namespace torchdp::detail {
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

StepDevices resolve_devices(const std::optional<std::vector<c10::Device>>& device_ids,
                            const std::optional<c10::Device>& output_device,
                            const std::optional<double>& bucket_cap_mb, bool cuda_graphs,
                            const char* api) {
  StepDevices out;
  if (device_ids) {
    TORCH_CHECK(!device_ids->empty(), api,
                ": device_ids is an empty list; pass the devices to use, or leave device_ids unset "
                "to use every visible CUDA device");
    out.device_ids = normalize_devices(*device_ids, api);
  } else if (cuda_device_count() > 0) {
    out.device_ids = default_devices(api);
  }
  if (bucket_cap_mb) {
    autograd::bucket_bytes_from_mib(*bucket_cap_mb, api); // checked at construction
  }
  if (cuda_graphs) {
    check_cuda_graphs(out.device_ids, api);
  }
  if (output_device) {
    TORCH_CHECK(!out.device_ids.empty(), api, ": output_device ", *output_device,
                " was given but no device is in use (no CUDA device is visible and device_ids is "
                "unset); pass device_ids too");
    out.output_device = normalize_device(*output_device, api);
    check_output_device(out.device_ids, *out.output_device, api);
  } else if (!out.device_ids.empty()) {
    out.output_device = out.device_ids.front();
  }
  return out;
}

void Step::check_defined(const std::vector<at::Tensor>& inputs, const Names& names) const {
  for (const auto k : c10::irange(inputs.size())) {
    TORCH_CHECK(inputs[k].defined(), api_, ": ", names(k), " is an undefined tensor");
  }
}

Split Step::split(const std::vector<at::Tensor>& inputs, const std::vector<c10::Device>& devices,
                  int64_t dim, const Names& names,
                  const std::optional<std::vector<double>>& shares) const {
  check_forward_context(api_);
  if (shares) {
    auto shared = scatter_shares(inputs, devices, *shares, dim, api_, names, dim_note_);
    Split out;
    for (const auto i : shared.index) {
      out.used.push_back(devices[i]);
    }
    out.parts = std::move(shared.parts);
    return out;
  }
  const auto chunks = scatter_tensors(inputs, devices, dim, api_, names, dim_note_);
  size_t n = devices.size();
  for (const auto& c : chunks) {
    n = std::min(n, c.size());
  }
  if (n < devices.size()) { // a small batch, or a short tensor that would drop rows
    std::vector<std::pair<std::string, int64_t>> sizes;
    for (const auto k : c10::irange(inputs.size())) {
      sizes.emplace_back(names(k), inputs[k].size(dim));
    }
    check_chunks(sizes, n, devices.size(), dim, api_);
  }
  Split out{{devices.begin(), devices.begin() + static_cast<std::ptrdiff_t>(n)},
            std::vector<std::vector<at::Tensor>>(n)};
  for (const auto i : c10::irange(n)) {
    for (const auto& c : chunks) {
      out.parts[i].push_back(c[i]);
    }
  }
  return out;
}

Split Step::split_items(const std::vector<at::Tensor>& inputs, const Items& items,
                        const std::vector<c10::Device>& devices, int64_t dim, const Names& names,
                        const std::optional<std::vector<double>>& shares) const {
  check_forward_context(api_);
  auto split = scatter_items(inputs, items.item_of, items.items, devices, shares, dim, api_, names);
  Split out;
  for (const auto i : split.index) {
    out.used.push_back(devices[i]);
  }
  out.parts = std::move(split.parts);
  return out;
}

void Step::run(const std::vector<c10::Device>& used, const std::vector<at::Tensor>& originals,
               const std::optional<double>& bucket_cap_mb, std::shared_ptr<BufferSnapshot>* keep,
               const std::function<void()>& replicate,
               const std::function<void(size_t)>& run_replica) {
  std::optional<autograd::GradBucketSizeGuard> bucket_size;
  if (bucket_cap_mb) {
    bucket_size.emplace(autograd::bucket_bytes_from_mib(*bucket_cap_mb, api_));
  }
  if (!snapshot_ || snapshot_.use_count() > 1) { // a kept copy is still someone else's
    snapshot_ = std::make_shared<BufferSnapshot>();
  }
  snapshot_->take(originals);
  const auto snapshot = snapshot_;
  if (keep != nullptr) {
    *keep = snapshot;
  }
  try {
    const EnclosingForwardGuard enclosing(snapshot->take_id());
    replicate();
    parallel_run(used.size(), used, run_replica);
  } catch (...) {
    snapshot->restore();
    snapshot->release();
    throw;
  }
  if (keep == nullptr) {
    snapshot->release(); // no gather follows: the step is over
  }
}

c10::IValue Step::join(std::vector<c10::IValue> outputs, size_t devices,
                       std::optional<c10::Device> output_device, int64_t dim,
                       const std::shared_ptr<BufferSnapshot>& kept, bool samples) const {
  const ValueNames names{"the output", false};
  if (devices == 0) { // passthrough: where the module put it
    return std::move(outputs.front());
  }
  if (devices == 1) {
    return to_device(outputs.front(), *output_device, api_, names);
  }
  if (samples && outputs.front().isTensorList()) { // one list of the replicas' samples
    return gather(kept, [&] {
      std::vector<std::vector<at::Tensor>> lists;
      for (const auto& o : outputs) {
        lists.push_back(o.toTensorVector());
      }
      return c10::IValue(gather_samples(lists, *output_device));
    });
  }
  return gather(kept, [&] {
    return gather_value(outputs, *output_device, dim, api_, names);
  });
}

} // namespace torchdp::detail
