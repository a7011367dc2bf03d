// Uneven shares of the batch (Note [Uneven shares] in shares.h).
#include <torchdp/autograd.h>
#include <torchdp/devices.h>
#include <torchdp/errors.h>
#include <torchdp/shares.h>
#include <torchdp/structure.h>

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
    check_splittable(t, name(k), dim, api, dim_note);
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

ItemSplit scatter_items(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& item_of,
                        int64_t items, const std::vector<c10::Device>& devices,
                        const std::optional<std::vector<double>>& shares, int64_t dim,
                        const char* api, const std::function<std::string(size_t)>& name) {
  TORCH_CHECK(inputs.size() == item_of.size(), api, ": ", inputs.size(), " inputs but ",
              item_of.size(), " item indices");
  const auto weights = shares ? *shares : std::vector<double>(devices.size(), 1.0);
  const auto counts = share_rows(weights, items, devices.size(), api);
  ItemSplit out;
  int64_t begin = 0;
  for (const auto i : c10::irange(counts.size())) {
    if (counts[i] > 0) {
      out.index.push_back(i);
      out.begin.push_back(begin);
      out.count.push_back(counts[i]);
    }
    begin += counts[i];
  }
  std::vector<at::Tensor> batch;
  std::vector<size_t> batch_at;
  for (const auto k : c10::irange(inputs.size())) {
    TORCH_CHECK(inputs[k].defined(), api, ": ", name(k), " is an undefined tensor");
    if (item_of[k] < 0) {
      batch.push_back(inputs[k]);
      batch_at.push_back(k);
    } else {
      TORCH_CHECK(item_of[k] < items, api, ": ", name(k), " is item ", item_of[k], " of ", items);
    }
  }
  std::vector<std::vector<at::Tensor>> batch_parts;
  for (const auto j : c10::irange(batch.size())) {
    const auto& t = batch[j];
    const auto rows = t.dim() > 0 && dim >= -t.dim() && dim < t.dim() ? t.size(dim) : -1;
    TORCH_CHECK_VALUE(rows == items, api, ": ", name(batch_at[j]), " of shape ", t.sizes(),
                      " is split beside lists of ", items,
                      " samples, so it needs one row per sample along dim ", dim,
                      "; give it those rows, or pass it inside the lists of samples");
  }
  if (!batch.empty() && items > 0) {
    const std::vector<double> exact(counts.begin(), counts.end());
    batch_parts = scatter_shares(
                      batch, devices, exact, dim, api,
                      [&](size_t j) {
                        return name(batch_at[j]);
                      },
                      "")
                      .parts;
  }
  if (out.index.empty()) { // no items: the first device with a share runs the empty lists
    out.index.push_back(static_cast<size_t>(std::find_if(weights.begin(), weights.end(),
                                                         [](double w) {
                                                           return w > 0;
                                                         }) -
                                            weights.begin()));
  }
  out.begin.resize(out.index.size(), 0);
  out.count.resize(out.index.size(), 0);
  out.parts.resize(out.index.size());
  for (const auto i : c10::irange(out.index.size())) {
    const auto device = devices[out.index[i]];
    auto& part = out.parts[i];
    part.resize(inputs.size());
    for (const auto j : c10::irange(batch_at.size())) {
      part[batch_at[j]] = items > 0 ? std::move(batch_parts[i][j]) : batch[j].to(device);
    }
    for (const auto k : c10::irange(inputs.size())) {
      const auto item = item_of[k];
      if (item >= out.begin[i] && item < out.begin[i] + out.count[i]) {
        part[k] = inputs[k].to(device);
      }
    }
  }
  return out;
}

void check_batch_lists(const std::vector<BatchList>& lists, size_t devices, int64_t dim,
                       const char* api, const char* option) {
  const auto n = static_cast<int64_t>(devices);
  for (const auto& list : lists) {
    std::vector<int64_t> sizes;
    bool same_shape = true;
    for (const auto& shape : list.shapes) {
      const auto rank = static_cast<int64_t>(shape.size());
      if (rank == 0 || dim < -rank || dim >= rank) {
        break; // not split along dim: scatter's own errors name it
      }
      sizes.push_back(shape[static_cast<size_t>(dim < 0 ? dim + rank : dim)]);
      same_shape = same_shape && shape == list.shapes.front();
    }
    if (sizes.size() != list.shapes.size() || sizes.empty()) {
      continue;
    }
    const auto [low, high] = std::minmax_element(sizes.begin(), sizes.end());
    const auto fix = c10::str(
        "; a list of samples (images of different sizes, target dicts) is "
        "split by item with ",
        option, ", each replica getting whole samples");
    TORCH_CHECK_VALUE(*low == *high, api, ": ", list.name, " holds tensors of different sizes ",
                      c10::ArrayRef<int64_t>(sizes), " along dim ", dim,
                      ", which cannot be one batch: splitting each along that dim would mix up "
                      "their rows",
                      fix);
    TORCH_CHECK_VALUE(same_shape || *low >= n, api, ": ", list.name,
                      " holds tensors of different shapes with only ", *low, " rows along dim ",
                      dim, " for ", n,
                      " devices: split along that dim each would be cut across (an image along "
                      "its channels)",
                      fix);
  }
}

} // namespace detail

std::vector<std::vector<at::Tensor>> scatter_samples(
    const std::vector<at::Tensor>& samples, const std::vector<c10::Device>& devices,
    const std::optional<std::vector<double>>& shares) {
  constexpr const char* api = "torchdp::scatter_samples";
  TORCH_CHECK(!devices.empty(), api, ": no devices given; pass the devices to split over");
  std::vector<int64_t> item_of(samples.size());
  std::iota(item_of.begin(), item_of.end(), 0);
  auto split = detail::scatter_items(samples, item_of, static_cast<int64_t>(samples.size()),
                                     devices, shares, 0, api, [](size_t k) {
                                       return c10::str("sample ", k);
                                     });
  std::vector<std::vector<at::Tensor>> out(devices.size());
  for (const auto i : c10::irange(split.index.size())) {
    auto& mine = out[split.index[i]];
    for (const auto k : c10::irange(split.count[i])) {
      mine.push_back(std::move(split.parts[i][static_cast<size_t>(split.begin[i] + k)]));
    }
  }
  return out;
}

std::vector<at::Tensor> gather_samples(const std::vector<std::vector<at::Tensor>>& outputs,
                                       c10::Device destination) {
  std::vector<at::Tensor> out;
  for (const auto& replica : outputs) {
    for (const auto& t : replica) {
      out.push_back(t.defined() ? t.to(destination) : t);
    }
  }
  return out;
}

} // namespace torchdp
