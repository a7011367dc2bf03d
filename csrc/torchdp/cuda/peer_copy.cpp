#include <torchdp/config.h>
#include <torchdp/cuda/peer_copy.h>

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#if TORCHDP_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <vector>
#endif

namespace torchdp::detail {

int peer_broadcast_streams() {
  const char* env = std::getenv("TORCHDP_PEER_BROADCAST");
  if (env == nullptr || *env == '\0') {
    return 0;
  }
  const std::string value(env);
  TORCH_CHECK(value.size() == 1 && value[0] >= '0' && value[0] <= '8',
              "torchdp: TORCHDP_PEER_BROADCAST must be a number of streams from 0 (off) to 8, "
              "got '",
              value, "'");
  return value[0] - '0';
}

#if TORCHDP_WITH_CUDA

namespace {

// The copy streams of `device`, made once and kept for the process: streams of their own, so that
// the pieces never queue behind other work on ATen's shared stream pool (the gradient reductions'
// side streams come from that pool too).
c10::cuda::CUDAStream copy_stream(c10::DeviceIndex device, int k) {
  constexpr int kMaxStreams = 8;
  static std::mutex mutex;
  static std::vector<std::array<cudaStream_t, kMaxStreams>> streams;
  TORCH_INTERNAL_ASSERT(k >= 0 && k < kMaxStreams);
  std::lock_guard<std::mutex> lock(mutex);
  if (streams.size() <= static_cast<size_t>(device)) {
    streams.resize(static_cast<size_t>(device) + 1);
    // The entries that resize() added are value-initialised (null): made on first use below.
  }
  auto& s = streams[static_cast<size_t>(device)][static_cast<size_t>(k)];
  if (s == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  return c10::cuda::getStreamFromExternal(s, device);
}

} // namespace

void peer_copy(const at::Tensor& src, const at::Tensor& dst, int streams, bool source_waits) {
  TORCH_CHECK(src.is_cuda() && dst.is_cuda() && src.is_contiguous() && dst.is_contiguous() &&
                  src.scalar_type() == dst.scalar_type() && src.numel() == dst.numel(),
              "torchdp::detail::peer_copy: expected two contiguous CUDA tensors of one dtype and "
              "size, got ",
              src.toString(), " ", src.sizes(), " on ", src.device(), " and ", dst.toString(), " ",
              dst.sizes(), " on ", dst.device());
  TORCH_CHECK(streams >= 1 && streams <= 8,
              "torchdp::detail::peer_copy: streams must be from 1 to 8, got ", streams);
  TORCH_CHECK(!src.is_conj() && !src.is_neg(),
              "torchdp::detail::peer_copy: the source has a lazy conjugate or negative bit, which "
              "a copy of its bytes would drop; resolve it first (resolve_conj(), resolve_neg())");
  const size_t bytes = static_cast<size_t>(src.numel()) * src.element_size();
  if (bytes == 0) {
    return;
  }
  const auto from = src.device().index();
  const auto to = dst.device().index();
  // Enables peer access once; without it the runtime stages every copy through host memory.
  if (from != to && !at::cuda::get_p2p_access(from, to)) {
    TORCH_WARN_ONCE("torchdp: TORCHDP_PEER_BROADCAST: no peer access from cuda:", from,
                    " to cuda:", to,
                    ", so the peer copies go through host memory; unset TORCHDP_PEER_BROADCAST "
                    "to broadcast with NCCL");
  }
  c10::cuda::CUDAGuard guard(from);
  const auto source_stream = c10::cuda::getCurrentCUDAStream(from);
  const auto target_stream = c10::cuda::getCurrentCUDAStream(to);
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
              "torchdp: the peer-copy broadcast (TORCHDP_PEER_BROADCAST) cannot run while a CUDA "
              "graph is being captured; unset TORCHDP_PEER_BROADCAST or replicate outside the "
              "capture");
  at::cuda::CUDAEvent source_ready;
  at::cuda::CUDAEvent target_ready;
  source_ready.record(source_stream); // the packing, and whatever wrote src
  target_ready.record(target_stream); // dst's allocation is ordered on this stream
  // Pieces of a multiple of 256 bytes (the last one takes the rest).
  const size_t piece = ((bytes + streams - 1) / streams + 255) / 256 * 256;
  const auto* source = static_cast<const char*>(src.data_ptr());
  auto* target = static_cast<char*>(dst.data_ptr());
  int k = 0;
  for (size_t offset = 0; offset < bytes; offset += piece, ++k) {
    const size_t n = std::min(piece, bytes - offset);
    const auto stream = copy_stream(from, k);
    source_ready.block(stream);
    target_ready.block(stream);
    C10_CUDA_CHECK(
        cudaMemcpyPeerAsync(target + offset, to, source + offset, from, n, stream.stream()));
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), stream);
    at::cuda::CUDAEvent done;
    done.record(stream);
    done.block(target_stream);
    if (source_waits) {
      done.block(source_stream); // later writes to src on its current stream wait for the read
    }
  }
}

#else

void peer_copy(const at::Tensor&, const at::Tensor&, int, bool) {
  TORCH_CHECK(false,
              "torchdp::detail::peer_copy needs torchdp built with its CUDA fast paths "
              "(TORCHDP_WITH_CUDA)");
}

#endif

} // namespace torchdp::detail
