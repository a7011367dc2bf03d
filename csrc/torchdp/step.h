#pragma once

#include <torchdp/replicate.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// Note [The step engine]
// Every C++ front end (DataParallelImpl's forwards, ScriptDataParallel, data_parallel<>) runs its
// eager step through detail::Step, over a flat list of tensors that the front end names for
// errors: it flattens its arguments (detail::for_each_tensor); the engine splits them (the
// forward-context check, scatter along dim, the chunk check of Note [Per-replica rows]),
// replicates the module and runs the replicas on their devices under the rollback of Note
// [Buffers of failed forwards], and gathers while it releases the buffer copy; the front end
// rebuilds each replica's arguments from the flat lists (detail::map_tensors) and keeps only what
// is its own: its module type, the process group, CUDA graphs.

namespace torchdp::detail {

/// Refuses a split that drops rows: `chunks` (fewer than `n` devices) came from the shortest of
/// the tensors, named with their sizes along `dim` in `sizes`, while a longer one needs more
/// (c10::ValueError naming both). A batch smaller than the devices passes: fewer replicas run,
/// and so does a tensor of exactly `n` rows, a value per replica (Note [Per-replica rows]).
void check_chunks(const std::vector<std::pair<std::string, int64_t>>& sizes, size_t chunks,
                  size_t n, int64_t dim, const char* api);

/// CUDA graphs need CUDA devices (c10::ValueError) and a build with the CUDA fast paths.
void check_cuda_graphs(const std::vector<c10::Device>& devices, const char* api);

/// The devices of a wrapper: `device_ids` empty when forwards call the module directly.
struct StepDevices {
  std::vector<c10::Device> device_ids;
  std::optional<c10::Device> output_device;
};

/// The constructor checks of the wrappers: `device_ids` (default: every visible CUDA device, or
/// none without CUDA), `bucket_cap_mb`, CUDA graphs when asked for, and `output_device`.
StepDevices resolve_devices(const std::optional<std::vector<c10::Device>>& device_ids,
                            const std::optional<c10::Device>& output_device,
                            const std::optional<double>& bucket_cap_mb, bool cuda_graphs,
                            const char* api);

/// A forward's inputs split over the devices: replica i runs on used[i] with parts[i].
struct Split {
  std::vector<c10::Device> used;
  std::vector<std::vector<at::Tensor>> parts;
};

/// Which inputs are samples (Note [Lists of samples]): inputs[k] is item item_of[k] of lists of
/// `items` samples, or a tensor of the batch where item_of[k] < 0.
struct Items {
  std::vector<int64_t> item_of;
  int64_t items = 0;
};

/// The engine of one front end (Note [The step engine]); it keeps the buffer copy between steps.
class Step {
 public:
  using Names = std::function<std::string(size_t)>; ///< the name of input k in errors

  /// `api` names the front end in errors; `dim_note` follows the dim in them.
  explicit Step(const char* api, const char* dim_note = "") : api_(api), dim_note_(dim_note) {}

  /// Raises when one of `inputs` is undefined.
  void check_defined(const std::vector<at::Tensor>& inputs, const Names& names) const;

  /// The forward-context check, every input split along `dim` over `devices` (two or more), and
  /// the chunk check when the batch gives fewer chunks than devices; with `shares`, split by the
  /// rows they give each device, and only devices with rows run (Note [Uneven shares]).
  Split split(const std::vector<at::Tensor>& inputs, const std::vector<c10::Device>& devices,
              int64_t dim, const Names& names,
              const std::optional<std::vector<double>>& shares = std::nullopt) const;

  /// The forward-context check and the inputs split by item over `devices` (two or more), by
  /// `shares` when given; only devices with items run. Replica i's part holds undefined tensors
  /// for the other replicas' items.
  Split split_items(const std::vector<at::Tensor>& inputs, const Items& items,
                    const std::vector<c10::Device>& devices, int64_t dim, const Names& names,
                    const std::optional<std::vector<double>>& shares) const;

  /// `replicate()`, then `run_replica(i)` for each device of `used` in parallel, with gradient
  /// buckets of `bucket_cap_mb`, as the enclosing forward (Note [Nested forwards]) of a copy of
  /// `originals` (the module's buffers) that is written back when they throw. The copy goes to
  /// `*keep` for gather() when given, else is released.
  void run(const std::vector<c10::Device>& used, const std::vector<at::Tensor>& originals,
           const std::optional<double>& bucket_cap_mb, std::shared_ptr<BufferSnapshot>* keep,
           const std::function<void()>& replicate, const std::function<void(size_t)>& run_replica);

  /// The end of a step of c10::IValue outputs, one per replica run over `devices` devices: the
  /// module's own output without devices, moved to `output_device` on one, else gathered there;
  /// with `samples`, lists of tensors are joined item by item (Note [Lists of samples]).
  c10::IValue join(std::vector<c10::IValue> outputs, size_t devices,
                   std::optional<c10::Device> output_device, int64_t dim,
                   const std::shared_ptr<BufferSnapshot>& kept, bool samples = false) const;

  /// The gather that ends the step: returns `gather()` and releases `kept` (run()'s `keep`),
  /// writing the buffers back first when `gather` throws.
  template <typename Gather>
  static auto gather(const std::shared_ptr<BufferSnapshot>& kept, Gather&& gather) {
    try {
      auto gathered = gather();
      if (kept) {
        kept->release();
      }
      return gathered;
    } catch (...) {
      if (kept) {
        kept->restore();
        kept->release();
      }
      throw;
    }
  }

 private:
  const char* api_;
  const char* dim_note_;
  std::shared_ptr<BufferSnapshot> snapshot_; // refreshed in place by each step
};

} // namespace torchdp::detail
