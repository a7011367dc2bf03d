#pragma once

#include <ATen/core/Tensor.h>

namespace torchdp::detail {

// Note [Peer-copy broadcast]
// Experimental transport for broadcast_coalesced between CUDA devices, selected by
// TORCHDP_PEER_BROADCAST=<k> (1 to 8; 0 or unset: off). The tensors of each dtype are packed into
// one flat buffer on the first device (one kernel), and each target gets that buffer by the
// runtime's peer copies, cut into k pieces on k streams of the first device so that several copy
// engines work at once; the outputs are views of the target's buffer. ATen's copy_ between devices
// records two events per copy, which chain consecutive copies one after the other whatever their
// streams; these copies carry only the events that order them after the packing and before the
// targets' current streams. Off by default until a two-GPU run shows it faster than the NCCL
// broadcast (benchmarks/probe_broadcast.py, bench_replicate.py's torchdp_replicate_peer).

/// The number of streams TORCHDP_PEER_BROADCAST asks for (0: off). Read at every call; a value
/// other than 0 to 8 raises.
int peer_broadcast_streams();

/// Copies the contiguous CUDA tensor `src` into `dst` (same dtype and size, contiguous, on any
/// CUDA device) with peer copies over `streams` streams of src's device. The copies start after
/// the work queued so far on the current streams of both devices, and dst's device's current
/// stream waits for them; src's memory is kept from reuse until they are done.
void peer_copy(const at::Tensor& src, const at::Tensor& dst, int streams);

} // namespace torchdp::detail
