#pragma once
// Internal: what the nn::Module and TorchScript replicators share (replicate.cpp,
// script_module.cpp).
#include <c10/core/Device.h>

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace torchdp::detail {

/// How many device lists a replicator keeps replica sets for.
inline constexpr size_t kMaxCachedDeviceLists = 8;

/// The replica set cached for `devices`, made most recently used (moved last), when it was built
/// for `signature`; one built for another signature is dropped. Otherwise `build()` makes one,
/// stored last, dropping the least recently used set when kMaxCachedDeviceLists are kept.
/// `*built` says which happened. `Set` has `devices` and `signature` members.
template <typename Set, typename Signature, typename Build>
Set& cached_replica_set(std::vector<Set>& sets, const std::vector<c10::Device>& devices,
                        const Signature& signature, Build&& build, bool* built) {
  for (auto it = sets.begin(); it != sets.end(); ++it) {
    if (it->devices != devices) {
      continue;
    }
    if (it->signature == signature) {
      std::rotate(it, it + 1, sets.end());
      *built = false;
      return sets.back();
    }
    sets.erase(it);
    break;
  }
  auto fresh = build();
  if (sets.size() >= kMaxCachedDeviceLists) {
    sets.erase(sets.begin());
  }
  sets.push_back(std::move(fresh));
  *built = true;
  return sets.back();
}

/// Copies of `tensors` (all on `source`) for each of `devices`: replica j's are at
/// `copies[j + *offset]`, as a source that is not devices[0] gets its own copy first. With
/// `detach`, the copies record no autograd history.
std::vector<std::vector<at::Tensor>> broadcast_from(const std::vector<at::Tensor>& tensors,
                                                    c10::Device source,
                                                    const std::vector<c10::Device>& devices,
                                                    bool detach, size_t* offset);

} // namespace torchdp::detail
