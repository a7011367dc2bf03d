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
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
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

void peer_copy(const at::Tensor& src, const at::Tensor& dst, int streams) {
  TORCH_CHECK(src.is_cuda() && dst.is_cuda() && src.is_contiguous() && dst.is_contiguous() &&
                  src.scalar_type() == dst.scalar_type() && src.numel() == dst.numel(),
              "torchdp::detail::peer_copy: expected two contiguous CUDA tensors of one dtype and "
              "size, got ",
              src.toString(), " ", src.sizes(), " on ", src.device(), " and ", dst.toString(), " ",
              dst.sizes(), " on ", dst.device());
  TORCH_CHECK(streams >= 1, "torchdp::detail::peer_copy: streams must be at least 1, got ",
              streams);
  const size_t bytes = static_cast<size_t>(src.numel()) * src.element_size();
  if (bytes == 0) {
    return;
  }
  const auto from = src.device().index();
  const auto to = dst.device().index();
  if (from != to) {
    at::cuda::get_p2p_access(from, to); // enables peer access once (else the copies are staged)
  }
  c10::cuda::CUDAGuard guard(from);
  const auto source_stream = c10::cuda::getCurrentCUDAStream(from);
  const auto target_stream = c10::cuda::getCurrentCUDAStream(to);
  at::cuda::CUDAEvent source_ready;
  at::cuda::CUDAEvent target_ready;
  source_ready.record(source_stream); // the packing, and whatever wrote src
  target_ready.record(target_stream); // dst's allocation is ordered on this stream
  // Pieces of a multiple of 256 bytes (the last one takes the rest).
  const size_t piece = ((bytes + streams - 1) / streams + 255) / 256 * 256;
  const auto* source = static_cast<const char*>(src.data_ptr());
  auto* target = static_cast<char*>(dst.data_ptr());
  for (size_t offset = 0; offset < bytes; offset += piece) {
    const size_t n = std::min(piece, bytes - offset);
    const auto stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, from);
    source_ready.block(stream);
    target_ready.block(stream);
    C10_CUDA_CHECK(
        cudaMemcpyPeerAsync(target + offset, to, source + offset, from, n, stream.stream()));
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), stream);
    at::cuda::CUDAEvent done;
    done.record(stream);
    done.block(target_stream);
  }
}

#else

void peer_copy(const at::Tensor&, const at::Tensor&, int) {
  TORCH_CHECK(false,
              "torchdp::detail::peer_copy needs torchdp built with its CUDA fast paths "
              "(TORCHDP_WITH_CUDA)");
}

#endif

} // namespace torchdp::detail
