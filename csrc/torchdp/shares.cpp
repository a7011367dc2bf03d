// Uneven shares of the batch (Note [Uneven shares] in shares.h).
#include <torchdp/autograd.h>
#include <torchdp/devices.h>
#include <torchdp/errors.h>
#include <torchdp/shares.h>

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

namespace torchdp {
namespace detail {

void check_shares(const std::vector<double>& shares, size_t devices, const char* api) {
  const c10::ArrayRef<double> shown(shares);
  TORCH_CHECK_VALUE(shares.size() == devices, api, ": shares ", shown, " has ", shares.size(),
                    " entries but there are ", devices,
                    " devices; give one share per device, in the order of the devices");
  double total = 0;
  for (const auto i : c10::irange(shares.size())) {
    TORCH_CHECK_VALUE(std::isfinite(shares[i]) && shares[i] >= 0, api, ": shares ", shown, " has ",
                      shares[i], " for device ", i,
                      "; every share must be a finite number >= 0 (a weight or a row count)");
    total += shares[i];
  }
  TORCH_CHECK_VALUE(total > 0 && std::isfinite(total), api, ": shares ", shown,
                    total > 0 ? " add up to more than a double holds"
                              : " are all zero, so no device would get any rows",
                    "; give at least one device a positive share, e.g. [1, 2, 2, 2]");
}

} // namespace detail

std::vector<int64_t> share_rows(const std::vector<double>& shares, int64_t rows, size_t devices,
                                const char* api) {
  detail::check_shares(shares, devices, api);
  TORCH_CHECK_VALUE(rows >= 0, api, ": the batch has ", rows, " rows; it must have 0 or more");
  const double total = std::accumulate(shares.begin(), shares.end(), 0.0);
  std::vector<int64_t> counts(shares.size());
  const bool exact =
      total == static_cast<double>(rows) && std::all_of(shares.begin(), shares.end(), [](double s) {
        return std::floor(s) == s;
      });
  if (exact) { // row counts: taken as they are
    std::transform(shares.begin(), shares.end(), counts.begin(), [](double s) {
      return static_cast<int64_t>(s);
    });
    return counts;
  }
  std::vector<double> remainder(shares.size());
  int64_t given = 0;
  for (const auto i : c10::irange(shares.size())) {
    const double quota = static_cast<double>(rows) * (shares[i] / total);
    counts[i] = std::min(static_cast<int64_t>(std::floor(quota)), rows - given);
    remainder[i] = quota - static_cast<double>(counts[i]);
    given += counts[i];
  }
  std::vector<size_t> order;
  for (const auto i : c10::irange(shares.size())) {
    if (shares[i] > 0) {
      order.push_back(i);
    }
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return remainder[a] > remainder[b];
  });
  for (size_t k = 0; given < rows; k = (k + 1) % order.size()) {
    ++counts[order[k]];
    ++given;
  }
  return counts;
}

namespace detail {

SharedSplit scatter_shares(const std::vector<at::Tensor>& tensors,
                           const std::vector<c10::Device>& devices,
                           const std::vector<double>& shares, int64_t dim, const char* api,
                           const std::function<std::string(size_t)>& name, const char* dim_note) {
  const auto n = static_cast<int64_t>(devices.size());
  std::vector<int64_t> sizes(tensors.size());
  std::optional<size_t> batch; // the tensor whose rows are the batch
  for (const auto k : c10::irange(tensors.size())) {
    const auto& t = tensors[k];
    TORCH_CHECK(t.defined(), api, ": ", name(k), " is an undefined tensor");
    TORCH_CHECK(t.dim() > 0, api, ": ", name(k),
                " is a 0-dim tensor, which cannot be split along dim ", dim,
                "; give it a batch dimension");
    TORCH_CHECK_INDEX(dim >= -t.dim() && dim < t.dim(), api, ": dim ", dim, dim_note,
                      " is out of range for ", name(k), " of shape ", t.sizes(),
                      "; it must be in [", -t.dim(), ", ", t.dim() - 1,
                      "], the dimension the batch is split along");
    sizes[k] = t.size(dim);
    if (!batch && sizes[k] != n) {
      batch = k;
    }
  }
  const int64_t rows = batch ? sizes[*batch] : n;
  const auto counts = share_rows(shares, rows, devices.size(), api);
  SharedSplit out;
  std::vector<c10::Device> used;
  std::vector<int64_t> used_counts;
  for (const auto i : c10::irange(counts.size())) {
    if (counts[i] > 0) {
      out.index.push_back(i);
      used.push_back(devices[i]);
      used_counts.push_back(counts[i]);
    }
  }
  if (out.index.empty()) { // an empty batch: one replica runs it, as without shares
    const auto first = static_cast<size_t>(std::find_if(shares.begin(), shares.end(),
                                                        [](double s) {
                                                          return s > 0;
                                                        }) -
                                           shares.begin());
    out.index.push_back(first);
    used.push_back(devices[first]);
    used_counts.push_back(0);
  }
  out.parts.resize(out.index.size());
  for (const auto k : c10::irange(tensors.size())) {
    TORCH_CHECK_VALUE(sizes[k] == rows || sizes[k] == n, api, ": with shares ",
                      c10::ArrayRef<double>(shares), ", every tensor is split by the rows of the ",
                      "batch along dim ", dim, dim_note, ": ", name(*batch), " has ", rows,
                      " rows but ", name(k), " has ", sizes[k],
                      "; give every tensor the batch size along that dim (or exactly one row per "
                      "device, ",
                      n, ", for a value per replica)");
    std::vector<at::Tensor> chunks;
    try {
      if (sizes[k] == rows) {
        chunks = autograd::scatter(tensors[k], used, used_counts, dim);
      } else { // a value per replica: each running replica takes its device's row
        const auto all = autograd::scatter(tensors[k], devices, std::nullopt, dim);
        for (const auto i : out.index) {
          chunks.push_back(all[i]);
        }
      }
    } catch (...) {
      rethrow_with_prefix(c10::str(api, ": cannot split ", name(k), ": "));
    }
    for (const auto i : c10::irange(chunks.size())) {
      out.parts[i].push_back(std::move(chunks[i]));
    }
  }
  return out;
}

} // namespace detail
} // namespace torchdp
