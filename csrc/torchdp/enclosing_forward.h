#pragma once
// Internal: which forward a thread works for (Note [Nested forwards] in replicate.cpp).
#include <cstdint>

namespace torchdp::detail {

/// The take id of the buffer snapshot of the forward this thread runs inside, 0 for none.
uint64_t enclosing_forward();

/// Makes `take` (a BufferSnapshot's take_id()) the enclosing forward of this thread for the
/// guard's lifetime: a forward holds one while its replicas run, and parallel_run carries the
/// caller's into each task.
class EnclosingForwardGuard {
 public:
  explicit EnclosingForwardGuard(uint64_t take);
  ~EnclosingForwardGuard();
  EnclosingForwardGuard(const EnclosingForwardGuard&) = delete;
  EnclosingForwardGuard& operator=(const EnclosingForwardGuard&) = delete;

 private:
  uint64_t previous_;
};

} // namespace torchdp::detail
