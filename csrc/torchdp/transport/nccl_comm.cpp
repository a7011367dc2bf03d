#include <torchdp/transport/nccl_comm.h>
#include <torchdp/profiling.h>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAMiscFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <nccl.h>

#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>

namespace torchdp::nccl {
namespace {

#define TORCHDP_NCCL_CHECK(expr)                                                                  \
  do {                                                                                            \
    ncclResult_t _r = (expr);                                                                     \
    TORCH_CHECK(_r == ncclSuccess, "torchdp NCCL error in ", #expr, ": ", ncclGetErrorString(_r), \
                " (set TORCHDP_DISABLE_NCCL=1 to use peer copies instead)");                      \
  } while (0)

std::vector<ncclComm_t>& communicators(const std::vector<c10::Device>& devices) {
  static std::mutex mutex;
  static auto* cache = new std::map<std::vector<int>, std::vector<ncclComm_t>>();
  std::vector<int> key;
  key.reserve(devices.size());
  for (const auto& d : devices) {
    key.push_back(d.index());
  }
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(key);
  if (it == cache->end()) {
    std::vector<ncclComm_t> comms(key.size());
    TORCHDP_NCCL_CHECK(ncclCommInitAll(comms.data(), static_cast<int>(key.size()), key.data()));
    it = cache->emplace(key, std::move(comms)).first;
  }
  return it->second;
}

// The NCCL type that ncclReduce sums `t` as; none where NCCL cannot reduce it.
std::optional<ncclDataType_t> reduce_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kChar:
      return ncclInt8;
    case at::kByte:
      return ncclUint8;
    default:
      return std::nullopt;
  }
}

// Holds the allocator's free mutex while enqueuing, as torch.cuda.nccl does: a cudaFree between
// NCCL kernels can deadlock against a device waiting in the collective.
struct GroupGuard {
  std::lock_guard<std::mutex> free_lock{*c10::cuda::getFreeMutex()};
  GroupGuard() {
    TORCHDP_NCCL_CHECK(ncclGroupStart());
  }
  ~GroupGuard() noexcept(false) {
    const ncclResult_t r = ncclGroupEnd();
    if (std::uncaught_exceptions() == 0) {
      TORCHDP_NCCL_CHECK(r);
    }
  }
};

} // namespace

bool usable(const std::vector<c10::Device>& devices) {
  static const bool disabled = [] {
    const char* v = std::getenv("TORCHDP_DISABLE_NCCL");
    return v != nullptr && std::string(v) != "0" && std::string(v) != "";
  }();
  if (disabled || devices.size() < 2) {
    return false;
  }
  std::unordered_set<int> seen;
  for (const auto& d : devices) {
    if (!d.is_cuda() || !d.has_index() || !seen.insert(d.index()).second) {
      return false;
    }
  }
  return true;
}

bool reduce_supports(at::ScalarType dtype) {
  return reduce_type(dtype).has_value();
}

void broadcast_each(const std::vector<at::Tensor>& sources,
                    const std::vector<std::vector<at::Tensor>>& destinations,
                    const std::vector<c10::Device>& devices) {
  auto& comms = communicators(devices);
  const detail::ProfilerRange range("torchdp.nccl.broadcast_group");
  // Checked before the group starts: a throw inside it would end a group that some ranks joined.
  for (const auto j : c10::irange(size_t{1}, devices.size())) {
    for (const auto k : c10::irange(sources.size())) {
      const auto& destination = destinations[j][k];
      TORCH_INTERNAL_ASSERT(destination.is_contiguous() &&
                            destination.numel() * destination.element_size() ==
                                sources[k].numel() * sources[k].element_size());
    }
  }
  GroupGuard group;
  for (const auto j : c10::irange(devices.size())) {
    c10::cuda::CUDAGuard guard(devices[j]);
    auto stream = c10::cuda::getCurrentCUDAStream(devices[j].index());
    for (const auto k : c10::irange(sources.size())) {
      const auto& source = sources[k];
      const size_t bytes = source.numel() * source.element_size();
      if (bytes == 0) {
        continue;
      }
      void* recv = j > 0 ? destinations[j][k].data_ptr() : source.data_ptr();
      TORCHDP_NCCL_CHECK(ncclBroadcast(source.data_ptr(), recv, bytes, ncclUint8, /*root=*/0,
                                       comms[j], stream.stream()));
    }
  }
}

void reduce(const std::vector<at::Tensor>& inputs, at::Tensor& output, size_t root,
            const std::vector<c10::Device>& devices) {
  auto& comms = communicators(devices);
  const auto count = static_cast<size_t>(inputs[0].numel());
  if (count == 0) {
    return;
  }
  const auto supported = reduce_type(inputs[0].scalar_type());
  TORCH_CHECK(supported.has_value(), "torchdp: NCCL cannot reduce dtype ", inputs[0].scalar_type());
  const ncclDataType_t type = *supported;
  for (const auto j : c10::irange(devices.size())) {
    TORCH_INTERNAL_ASSERT(inputs[j].is_contiguous() &&
                          static_cast<size_t>(inputs[j].numel()) == count);
  }
  GroupGuard group;
  for (const auto j : c10::irange(devices.size())) {
    c10::cuda::CUDAGuard guard(devices[j]);
    auto stream = c10::cuda::getCurrentCUDAStream(devices[j].index());
    void* recv = j == root ? output.data_ptr() : nullptr;
    TORCHDP_NCCL_CHECK(ncclReduce(inputs[j].data_ptr(), recv, count, type, ncclSum,
                                  static_cast<int>(root), comms[j], stream.stream()));
  }
}

} // namespace torchdp::nccl
