#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

// Note [Uneven shares]
// A share list gives each device its part of the batch, as weights ({1, 2, 2, 2}) or as row
// counts. share_rows() resolves it against a batch of B rows: each device's quota B * s / sum(s)
// rounded down, then the rows left over one each to the largest remainders (the earlier device
// on a tie). So the counts add up to B, integer shares that add up to B give exactly themselves,
// and a share of 0 gives no rows. Every tensor of B rows along dim is split by those counts, a
// tensor of exactly one row per device (Note [Per-replica rows]) by one row each. Devices that
// get no rows do not run, wherever they are in the list. The gathered output is the batch in
// order, and parallel_loss weights each replica's mean by its rows, so results equal one device.

// Note [Lists of samples]
// Detection models take a list of images of different sizes and a list of target dicts: items,
// not rows of one batch. Split along dim as a batch, each image is cut along its channels
// (nn.DataParallel's silent wrong result). With samples on, such a list is split by item: device
// k gets its share_rows() count of the N items, consecutive (equal shares unless shares are
// given), each tensor moved whole to it; the other tensors are split along dim by the same counts
// (they must have N rows, or one per device), and devices without items do not run. A replica's
// list output (one detection dict per image) joins the others into one list in order on the
// output device; other outputs gather as usual. Without samples, check_batch_lists() refuses a
// list of tensors that cannot be one batch: sizes along dim that differ, or shapes that differ in
// another dim with fewer rows than devices (the images of a detection model in eval). A list of
// tensors of one shape cannot be told from a batch and is split as one.

namespace torchdp {

/// Splits `samples` by item over `devices` (Note [Lists of samples]): device k gets its
/// share_rows() count of consecutive samples (equal shares by default), each moved to it
/// (differentiable); a device without a share gets an empty list.
///
///   auto parts = torchdp::scatter_samples(images, {cuda0, cuda1});  // 3 and 2 of 5 images
std::vector<std::vector<at::Tensor>> scatter_samples(
    const std::vector<at::Tensor>& samples, const std::vector<c10::Device>& devices,
    const std::optional<std::vector<double>>& shares = std::nullopt);

/// The replicas' per-sample outputs (scatter_samples()'s order) joined into one list on
/// `destination` (differentiable).
std::vector<at::Tensor> gather_samples(const std::vector<std::vector<at::Tensor>>& outputs,
                                       c10::Device destination);

/// The rows of a batch of `rows` rows that each of `devices` devices gets for `shares` (Note
/// [Uneven shares]): one non-negative, finite share per device, not all zero, else a
/// c10::ValueError naming `api`, the shares and the fix.
///
///   torchdp::share_rows({1, 2, 2, 2}, 14, 4);   // {2, 4, 4, 4}
std::vector<int64_t> share_rows(const std::vector<double>& shares, int64_t rows, size_t devices,
                                const char* api = "torchdp::share_rows");

namespace detail {

/// Refuses a share list that does not fit `devices` devices (share_rows()'s checks).
void check_shares(const std::vector<double>& shares, size_t devices, const char* api);

/// Inputs split by shares: replica i runs on devices[index[i]] with parts[i].
struct SharedSplit {
  std::vector<size_t> index;
  std::vector<std::vector<at::Tensor>> parts;
};

/// Splits each of `tensors` along `dim` by the rows share_rows() gives the batch (the size along
/// `dim` of the first tensor without one row per device), differentiably; a tensor of any other
/// size is refused (c10::ValueError naming it as `name(k)`). Only devices with rows get a part;
/// an empty batch runs on the first device with a share.
SharedSplit scatter_shares(const std::vector<at::Tensor>& tensors,
                           const std::vector<c10::Device>& devices,
                           const std::vector<double>& shares, int64_t dim, const char* api,
                           const std::function<std::string(size_t)>& name,
                           const char* dim_note = "");

/// Inputs split by item: replica i runs on devices[index[i]] with items [begin[i], begin[i] +
/// count[i]) of the lists of samples and parts[i], one tensor per input: a tensor of the batch
/// split along dim by the counts, its own items' tensors moved to it, undefined for the others'.
struct ItemSplit {
  std::vector<size_t> index;
  std::vector<int64_t> begin;
  std::vector<int64_t> count;
  std::vector<std::vector<at::Tensor>> parts;
};

/// Splits by item (Note [Lists of samples]): inputs[k] is item item_of[k] of the lists of
/// `items` samples, or a tensor of the batch where item_of[k] < 0, split along `dim` by the
/// items' counts (c10::ValueError naming it as `name(k)` unless it has `items` rows or one per
/// device).
ItemSplit scatter_items(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& item_of,
                        int64_t items, const std::vector<c10::Device>& devices,
                        const std::optional<std::vector<double>>& shares, int64_t dim,
                        const char* api, const std::function<std::string(size_t)>& name);

/// A list of tensors among a forward's arguments: its name, and its tensors' shapes.
struct BatchList {
  std::string name;
  std::vector<std::vector<int64_t>> shapes;
};

/// Refuses a list whose tensors cannot be one batch (Note [Lists of samples]) for `devices`
/// devices: c10::ValueError naming `api`, the list, its sizes and `option`, the way to split it by
/// item.
void check_batch_lists(const std::vector<BatchList>& lists, size_t devices, int64_t dim,
                       const char* api, const char* option);

} // namespace detail
} // namespace torchdp
