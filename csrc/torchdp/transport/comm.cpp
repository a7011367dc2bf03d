#include <torchdp/comm.h>
#include <torchdp/config.h>
#include <torchdp/devices.h>
#include <torchdp/profiling.h>
#include <torchdp/reduction.h>
#if TORCHDP_WITH_NCCL
#include <torchdp/transport/nccl_comm.h>
#endif

#include <ATen/Functions.h>
#include <ATen/WrapDimUtils.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

namespace torchdp::comm {
namespace {

// Note [Coalesced buckets]
// Dense tensors are packed, in order, into flat buckets of one dtype and at most `buffer_size`
// bytes, so a bucket moves with one copy (or NCCL call) per device. Each output is a view into
// the flat copy with its own version counter, as in torch.cuda.comm
// (NOTE [Version Counter in comm.*_coalesced] there).
struct Bucket {
  std::vector<size_t> indices;
  size_t bytes = 0;
  int64_t numel = 0;
};

std::vector<Bucket> make_buckets(const std::vector<at::Tensor>& tensors, size_t buffer_size,
                                 std::vector<size_t>& singles) {
  std::vector<Bucket> done;
  std::map<at::ScalarType, Bucket> open;
  for (const auto i : c10::irange(tensors.size())) {
    const auto& t = tensors[i];
    if (t.layout() != c10::kStrided) {
      singles.push_back(i);
      continue;
    }
    const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    auto& bucket = open[t.scalar_type()];
    if (!bucket.indices.empty() && bucket.bytes + bytes > buffer_size) {
      done.push_back(std::move(bucket));
      bucket = Bucket{};
    }
    bucket.indices.push_back(i);
    bucket.bytes += bytes;
    bucket.numel += t.numel();
  }
  for (auto& entry : open) {
    if (!entry.second.indices.empty()) {
      done.push_back(std::move(entry.second));
    }
  }
  return done;
}

// A contiguous view of `sizes` at `offset` in `flat`'s storage with its own version counter and no
// history, like variable_data(), built without dispatcher calls since buckets hold many views.
at::Tensor view_into(const at::Tensor& flat, int64_t offset, c10::IntArrayRef sizes) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(flat.storage()), flat.key_set(),
                                                   flat.dtype());
  impl->set_sizes_contiguous(sizes);
  impl->set_storage_offset(flat.storage_offset() + offset);
  return at::Tensor(std::move(impl));
}

// `t` with lazy conj/neg bits materialised, since byte transports (NCCL) must not send a view's
// raw bytes. The bit checks skip the dispatcher for the common case.
at::Tensor resolved(const at::Tensor& t) {
  if (!t.is_conj() && !t.is_neg()) {
    return t;
  }
  return t.resolve_conj().resolve_neg();
}

// One flat contiguous copy of a bucket; `fresh` is false when it views the only input (read-only).
at::Tensor flatten(const std::vector<at::Tensor>& tensors, const Bucket& bucket, bool& fresh) {
  if (bucket.indices.size() == 1) {
    const auto& t = tensors[bucket.indices[0]];
    auto flat = resolved(t).contiguous().view({-1});
    fresh = !flat.is_alias_of(t);
    return flat;
  }
  const auto& first = tensors[bucket.indices[0]];
  auto flat =
      at::empty({bucket.numel}, first.options().memory_format(c10::MemoryFormat::Contiguous));
  std::vector<at::Tensor> destinations, sources;
  destinations.reserve(bucket.indices.size());
  sources.reserve(bucket.indices.size());
  int64_t offset = 0;
  for (auto i : bucket.indices) {
    destinations.push_back(view_into(flat, offset, tensors[i].sizes()));
    sources.push_back(tensors[i]);
    offset += tensors[i].numel();
  }
  at::_foreach_copy_(destinations, sources, /*non_blocking=*/false);
  fresh = true;
  return flat;
}

void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& like,
                    const Bucket& bucket, std::vector<at::Tensor>& out) {
  int64_t offset = 0;
  for (auto i : bucket.indices) {
    out[i] = view_into(flat, offset, like[i].sizes());
    offset += like[i].numel();
  }
}

#if TORCHDP_WITH_NCCL
// Note [Direct NCCL broadcast]
// Over NCCL, every tensor is sent from where it lives, in one NCCL group, into views of one fresh
// buffer per bucket and target device; staging flat buckets on the source would cost an extra copy
// of every tensor and a group per bucket.
void broadcast_direct(const std::vector<at::Tensor>& inputs, const std::vector<Bucket>& buckets,
                      const std::vector<c10::Device>& devices,
                      std::vector<std::vector<at::Tensor>>& outputs) {
  std::vector<at::Tensor> sources;
  std::vector<std::vector<at::Tensor>> destinations(devices.size());
  for (const auto& bucket : buckets) {
    for (size_t j = 1; j < devices.size(); ++j) {
      const auto flat =
          at::empty({bucket.numel}, inputs[bucket.indices[0]].options().device(devices[j]));
      unflatten_into(flat, inputs, bucket, outputs[j]);
    }
    for (auto i : bucket.indices) {
      sources.push_back(resolved(inputs[i]).contiguous());
      for (size_t j = 1; j < devices.size(); ++j) {
        destinations[j].push_back(outputs[j][i]);
      }
    }
  }
  nccl::broadcast_each(sources, destinations, devices);
}
#endif

// CUDA copies queue on the destination's current stream; host copies block, as the CPU reads them.
bool non_blocking_to(c10::Device device) {
  return device.is_cuda();
}

at::Tensor copy_to(const at::Tensor& t, c10::Device device) {
  return t.to(t.options().device(device), non_blocking_to(device), /*copy=*/true);
}

at::Tensor move_to(const at::Tensor& t, c10::Device device) {
  return t.to(device, non_blocking_to(device));
}

// Quantized tensors keep their quantizer outside the storage, which byte copies would lose.
void check_not_quantized(const at::Tensor& t, const char* api, const char* what, size_t i) {
  TORCH_CHECK(!t.is_quantized(), api, ": ", what, " ", i, " is a quantized tensor (",
              t.scalar_type(),
              "), which torchdp cannot copy between devices; dequantize it first, or keep "
              "quantized modules out of the replicated network");
}

void check_same_device(at::TensorList tensors, c10::Device expected, const char* api,
                       const char* what) {
  for (const auto i : c10::irange(tensors.size())) {
    TORCH_CHECK(tensors[i].defined(), api, ": ", what, " ", i, " is an undefined tensor");
    check_not_quantized(tensors[i], api, what, i);
    TORCH_CHECK(detail::canonical(tensors[i].device()) == expected, api, ": ", what, " ", i,
                " is on ", tensors[i].device(), " but all tensors must be on ", expected,
                " (devices[0]); move them there first");
  }
}

// Note [Padded gather]
// Replicas that generate sequences stop at different lengths, so their outputs differ along a
// dimension other than the gather dimension. With a pad value, the output takes the largest size
// in every such dimension, starts filled with the pad value, and each input is copied into the
// start of its slot (padding goes at the end, as generate's own padding of finished rows). The
// backward hands each input the gradient of its slot only: padded positions get none.

// Integer limits of `dtype`, or nullopt for a floating or complex dtype (any real value fits).
std::optional<std::pair<double, double>> integer_range(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBool:
      return std::make_pair(0.0, 1.0);
    case at::kByte:
      return std::make_pair(0.0, 255.0);
    case at::kChar:
      return std::make_pair(-128.0, 127.0);
    case at::kShort:
      return std::make_pair(-32768.0, 32767.0);
    case at::kInt:
      return std::make_pair(-2147483648.0, 2147483647.0);
    case at::kLong:
      return std::make_pair(-9223372036854775808.0, 9223372036854775807.0);
    default:
      return std::nullopt;
  }
}

// A pad value must be storable as it is: 0.5 would silently become 0 in a tensor of token ids,
// -1 wrap around in a uint8 one.
void check_pad_value(const at::Scalar& pad, at::ScalarType dtype, const char* api) {
  const auto range = integer_range(dtype);
  bool fits = !pad.isComplex() || c10::isComplexType(dtype);
  if (fits && range) {
    const double v = pad.toDouble();
    fits = std::trunc(v) == v && v >= range->first && v <= range->second;
  }
  TORCH_CHECK(fits, api, ": the pad value ", pad, " cannot be stored in the gathered tensors' ",
              "dtype ", dtype, " as it is; give a pad value of that dtype (for token ids, e.g. ",
              "the tokenizer's pad_token_id)");
}

} // namespace

std::vector<std::vector<at::Tensor>> broadcast_coalesced(at::TensorList tensors,
                                                         const std::vector<c10::Device>& devices_in,
                                                         size_t buffer_size) {
  constexpr const char* api = "torchdp::comm::broadcast_coalesced";
  const detail::ProfilerRange range("torchdp.broadcast");
  const auto devices = normalize_devices(devices_in, api);
  TORCH_CHECK(buffer_size > 0, api, ": buffer_size must be positive, got ", buffer_size);
  check_same_device(tensors, devices[0], api, "tensor");
  at::NoGradGuard no_grad;

  const std::vector<at::Tensor> inputs(tensors.begin(), tensors.end());
  std::vector<std::vector<at::Tensor>> outputs(devices.size(),
                                               std::vector<at::Tensor>(inputs.size()));
  outputs[0] = inputs;
  if (devices.size() == 1) {
    return outputs;
  }

  std::vector<size_t> singles;
  auto buckets = make_buckets(inputs, buffer_size, singles);
#if TORCHDP_WITH_NCCL
  if (nccl::usable(devices)) {
    broadcast_direct(inputs, buckets, devices, outputs);
    buckets.clear();
  }
#endif
  for (const auto& bucket : buckets) {
    bool fresh = false;
    const auto flat = flatten(inputs, bucket, fresh);
    // One target on the source's own device takes the fresh flat copy itself instead of a copy.
    bool flat_given = !fresh;
    for (size_t j = 1; j < devices.size(); ++j) {
      const bool take = !flat_given && devices[j] == detail::canonical(flat.device());
      flat_given = flat_given || take;
      unflatten_into(take ? flat : copy_to(flat, devices[j]), inputs, bucket, outputs[j]);
    }
  }
  for (auto i : singles) {
    for (size_t j = 1; j < devices.size(); ++j) {
      outputs[j][i] = copy_to(inputs[i], devices[j]);
    }
  }
  return outputs;
}

std::vector<at::Tensor> reduce_add_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                             c10::Device destination, size_t buffer_size) {
  return reduce_coalesced(per_device, destination, buffer_size, GradReduction::sum());
}

// Note [Reduction seam] (reduction.cpp): each flat bucket's sum is scaled once, in place.
std::vector<at::Tensor> reduce_coalesced(const std::vector<std::vector<at::Tensor>>& per_device,
                                         c10::Device destination_in, size_t buffer_size,
                                         const GradReduction& reduction) {
  constexpr const char* api = "torchdp::comm::reduce_add_coalesced";
  TORCH_CHECK(!per_device.empty(), api, ": expected at least one list of tensors, got none");
  TORCH_CHECK(buffer_size > 0, api, ": buffer_size must be positive, got ", buffer_size);
  const auto destination = normalize_device(destination_in, api);
  const auto& first = per_device[0];
  const size_t count = first.size();
  std::vector<c10::Device> devices;
  devices.reserve(per_device.size());
  for (const auto j : c10::irange(per_device.size())) {
    const auto& list = per_device[j];
    TORCH_CHECK(list.size() == count, api,
                ": every device must hold the same number of tensors, "
                "but list 0 has ",
                count, " and list ", j, " has ", list.size());
    const auto device = count ? detail::canonical(list[0].device()) : c10::Device(c10::kCPU);
    for (const auto k : c10::irange(count)) {
      TORCH_CHECK(list[k].defined(), api, ": tensor ", k, " of list ", j, " is undefined");
      check_not_quantized(list[k], api, "tensor", k);
      TORCH_CHECK(list[k].sizes() == first[k].sizes(), api, ": input ", k, " of list ", j,
                  " has invalid size: got ", list[k].sizes(), ", but expected ", first[k].sizes());
      TORCH_CHECK(list[k].scalar_type() == first[k].scalar_type(), api, ": input ", k, " of list ",
                  j, " has dtype ", list[k].scalar_type(), ", but expected ",
                  first[k].scalar_type());
      TORCH_CHECK(detail::canonical(list[k].device()) == device, api, ": list ", j,
                  " mixes devices (", device, " and ", list[k].device(),
                  "); each list must live on one device");
    }
    devices.push_back(device);
  }
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> result(count);

  // A tensor that is sparse on any device is summed alone (a sparse and a dense one: densely).
  std::vector<at::Tensor> layouts(first);
  for (const auto& list : per_device) {
    for (const auto k : c10::irange(count)) {
      if (list[k].layout() != c10::kStrided) {
        layouts[k] = list[k];
      }
    }
  }
  std::vector<size_t> singles;
  const auto buckets = make_buckets(layouts, buffer_size, singles);
#if TORCHDP_WITH_NCCL
  const auto root =
      static_cast<size_t>(std::find(devices.begin(), devices.end(), destination) - devices.begin());
  const bool nccl_devices = root < devices.size() && nccl::usable(devices);
#endif
  for (const auto& bucket : buckets) {
    std::vector<at::Tensor> flats;
    flats.reserve(per_device.size());
    bool first_fresh = false;
    for (const auto j : c10::irange(per_device.size())) {
      bool fresh = false;
      flats.push_back(flatten(per_device[j], bucket, fresh));
      if (j == 0) {
        first_fresh = fresh;
      }
    }
    at::Tensor sum;
#if TORCHDP_WITH_NCCL
    if (nccl_devices && nccl::reduce_supports(flats[0].scalar_type())) {
      sum = at::empty_like(flats[root]);
      nccl::reduce(flats, sum, root, devices);
      reduction.scale_(sum, flats.size());
      unflatten_into(sum, first, bucket, result);
      continue;
    }
#endif
    sum = first_fresh && devices[0] == destination ? flats[0] : copy_to(flats[0], destination);
    for (size_t j = 1; j < flats.size(); ++j) {
      sum.add_(move_to(flats[j], destination));
    }
    reduction.scale_(sum, flats.size());
    unflatten_into(sum, first, bucket, result);
  }
  for (auto k : singles) {
    // Start from a dense one if there is one: dense + sparse is dense, sparse + dense is refused.
    size_t base = 0;
    while (base < per_device.size() && per_device[base][k].layout() != c10::kStrided) {
      ++base;
    }
    base = base < per_device.size() ? base : 0;
    at::Tensor sum = copy_to(per_device[base][k], destination);
    for (const auto j : c10::irange(per_device.size())) {
      if (j != base) {
        sum = sum.add(move_to(per_device[j][k], destination));
      }
    }
    result[k] = reduction.scaled(sum, per_device.size());
  }
  return result;
}

std::vector<at::Tensor> scatter(const at::Tensor& tensor,
                                const std::vector<c10::Device>& devices_in,
                                const std::optional<std::vector<int64_t>>& chunk_sizes,
                                int64_t dim) {
  constexpr const char* api = "torchdp::comm::scatter";
  TORCH_CHECK(!devices_in.empty(), api,
              ": expected at least one device to scatter to, got an empty device list");
  const auto devices = normalize_devices(devices_in, api);
  TORCH_CHECK(tensor.defined(), api, ": the input tensor is undefined");
  check_not_quantized(tensor, api, "input", 0);
  TORCH_CHECK(tensor.layout() == c10::kStrided, api, ": the input has layout ", tensor.layout(),
              ", which cannot be split into chunks; pass it dense (to_dense()), or keep it out of "
              "the scattered arguments");
  TORCH_CHECK(tensor.dim() > 0, api,
              ": cannot scatter a 0-dim tensor (a scalar has no dimension to split); give it a "
              "batch dimension, e.g. tensor.unsqueeze(0)");
  TORCH_CHECK_INDEX(dim >= -tensor.dim() && dim < tensor.dim(), api, ": dim ", dim,
                    " is out of range for an input of shape ", tensor.sizes(), "; it must be in [",
                    -tensor.dim(), ", ", tensor.dim() - 1, "], the dimension to split along");
  if (tensor.is_meta()) {
    for (const auto& d : devices) {
      TORCH_CHECK(d.is_meta(), api, ": the input is on the meta device, which holds no data, and ",
                  "cannot be copied to ", d, "; put it on a device with data, or scatter it to ",
                  "meta devices only");
    }
  }
  const int64_t wrapped = c10::maybe_wrap_dim(dim, tensor.dim());
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> chunks;
  if (chunk_sizes) {
    TORCH_CHECK(chunk_sizes->size() == devices.size(), api,
                ": expected devices and chunk_sizes to be of same length, but got ", devices.size(),
                " devices and ", chunk_sizes->size(), " chunk sizes");
    int64_t total = 0;
    for (const auto i : c10::irange(chunk_sizes->size())) {
      TORCH_CHECK((*chunk_sizes)[i] >= 0, api, ": chunk size ", i, " is negative (",
                  (*chunk_sizes)[i], ")");
      total += (*chunk_sizes)[i];
    }
    TORCH_CHECK(total == tensor.size(wrapped), api, ": chunk sizes ",
                c10::IntArrayRef(*chunk_sizes), " add up to ", total, " but dimension ", wrapped,
                " of the input has size ", tensor.size(wrapped));
    chunks = tensor.split_with_sizes(*chunk_sizes, wrapped);
  } else {
    chunks = tensor.chunk(static_cast<int64_t>(devices.size()), wrapped);
  }
  for (const auto i : c10::irange(chunks.size())) {
    if (detail::canonical(chunks[i].device()) != devices[i]) {
      chunks[i] = move_to(chunks[i], devices[i]);
    }
  }
  return chunks;
}

at::Tensor gather(at::TensorList tensors, c10::Device destination_in, int64_t dim,
                  const std::optional<at::Scalar>& pad_value) {
  constexpr const char* api = "torchdp::comm::gather";
  TORCH_CHECK(!tensors.empty(), api, ": expected at least one tensor to gather from, got none");
  const auto destination = normalize_device(destination_in, api);
  const auto& first = tensors[0];
  TORCH_CHECK(first.defined(), api, ": tensor 0 is undefined");
  TORCH_CHECK(first.dim() > 0, api, ": cannot gather 0-dim tensors along dimension ", dim,
              "; give them a dimension first (autograd gather does this for dim 0)");
  TORCH_CHECK_INDEX(dim >= -first.dim() && dim < first.dim(), api, ": dim ", dim,
                    " is out of range for tensors of shape ", first.sizes(), "; it must be in [",
                    -first.dim(), ", ", first.dim() - 1, "], the dimension to concatenate along");
  const int64_t wrapped = c10::maybe_wrap_dim(dim, first.dim());
  if (pad_value) {
    check_pad_value(*pad_value, first.scalar_type(), api);
  }
  auto sizes = first.sizes().vec();
  int64_t total = 0;
  bool same_format = true;
  bool padded = false;
  const auto format = first.suggest_memory_format();
  for (const auto i : c10::irange(tensors.size())) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.defined(), api, ": tensor ", i, " is undefined");
    check_not_quantized(t, api, "tensor", i);
    TORCH_CHECK(t.layout() == c10::kStrided, api, ": tensor ", i, " has layout ", t.layout(),
                ", which cannot be concatenated; return dense tensors (to_dense())");
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), api, ": tensor ", i, " has dtype ",
                t.scalar_type(), " but tensor 0 has ", first.scalar_type());
    bool ok = t.dim() == first.dim();
    for (int64_t d = 0; ok && d < first.dim(); ++d) {
      if (d != wrapped && t.size(d) != first.size(d)) {
        ok = pad_value.has_value();
        padded = true;
        sizes[d] = std::max(sizes[d], t.size(d));
      }
    }
    if (!ok) {
      auto expected = first.sizes().vec();
      if (t.dim() == first.dim()) {
        expected[wrapped] = t.size(wrapped);
      }
      TORCH_CHECK(false, api, ": input tensor at index ", i, " has invalid shape ", t.sizes(),
                  ", but expected ", c10::IntArrayRef(expected),
                  " (all dimensions but dim=", wrapped, " must match",
                  t.dim() != first.dim() ? ""
                                         : "; to pad tensors that differ in other dimensions to "
                                           "the largest size, give a pad value (pad_value)",
                  ")");
    }
    total += t.size(wrapped);
    same_format = same_format && t.suggest_memory_format() == format;
  }
  sizes[wrapped] = total;
  at::NoGradGuard no_grad;
  const auto options = first.options().device(destination);
  at::Tensor out;
  if (padded) {
    // Note [Padded gather].
    out = at::full(sizes, *pad_value, options);
  } else {
    out = at::empty(sizes, options, same_format ? format : c10::MemoryFormat::Contiguous);
  }
  int64_t offset = 0;
  for (const auto& t : tensors) {
    auto slot = out.narrow(wrapped, offset, t.size(wrapped));
    for (int64_t d = 0; padded && d < t.dim(); ++d) {
      if (d != wrapped) {
        slot = slot.narrow(d, 0, t.size(d));
      }
    }
    slot.copy_(t, non_blocking_to(destination));
    offset += t.size(wrapped);
  }
  return out;
}

} // namespace torchdp::comm
