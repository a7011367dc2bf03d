#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
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

namespace torchdp {

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

} // namespace detail
} // namespace torchdp
