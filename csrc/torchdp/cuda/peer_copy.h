#pragma once

#include <ATen/core/Tensor.h>

namespace torchdp::detail {

// Note [Peer-copy broadcast]
// Experimental transport for broadcast_coalesced between CUDA devices, selected by
// TORCHDP_PEER_BROADCAST=<k> (1 to 8; 0 or unset: off). The tensors of each dtype are packed into
// one flat buffer on the first device (one kernel), and each target gets that buffer by the
// runtime's peer copies, cut into k pieces on k streams of the first device so that several copy
// engines work at once (streams of torchdp's own, not ATen's shared pool); the outputs are views
// of the target's buffer. The packing costs a second copy of each dtype's tensors on the first
// device while the copies run (the model's size; the NCCL broadcast sends from the tensors
// themselves). A dtype with a single tensor is sent from the caller's tensor, and the first
// device's current stream then waits for the copies. ATen's copy_ between devices
// records two events per copy, which chain consecutive copies one after the other whatever their
// streams; these copies carry only the events that order them after the packing and before the
// targets' current streams. Off by default until a two-GPU run shows it faster than the NCCL
// broadcast (benchmarks/probe_broadcast.py, bench_replicate.py's torchdp_replicate_peer).

/// The number of streams TORCHDP_PEER_BROADCAST asks for (0: off). Read at every call; a value
/// other than 0 to 8 raises.
int peer_broadcast_streams();

/// Copies the contiguous CUDA tensor `src` into `dst` (same dtype and size, contiguous, on any
/// CUDA device) with peer copies over `streams` (1 to 8) streams of src's device, streams of
/// torchdp's own. The copies start after the work queued so far on the current streams of both
/// devices, and dst's device's current stream waits for them; src's memory is kept from reuse
/// until they are done. With `source_waits`, src's device's current stream waits for them too,
/// so that later writes to src (when it is the caller's tensor, not a packed copy) cannot change
/// what the copies read. Not while a CUDA graph is captured (raises); a source with a lazy
/// conjugate or negative bit raises (its bytes are not its values).
void peer_copy(const at::Tensor& src, const at::Tensor& dst, int streams, bool source_waits);

} // namespace torchdp::detail
