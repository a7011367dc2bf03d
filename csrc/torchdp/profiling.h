#pragma once

// Named ranges of torchdp's work in profiler traces; nearly free when no profiler runs.

#include <ATen/record_function.h>

#include <string_view>

namespace torchdp::detail {

/// A user-scope range named `name` (a string literal) from construction to destruction.
class ProfilerRange {
 public:
  explicit ProfilerRange(std::string_view name) : fn_(at::RecordScope::USER_SCOPE) {
    if (fn_.isActive()) {
      fn_.before(name, c10::ArrayRef<const c10::IValue>{});
    }
  }
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

 private:
  at::RecordFunction fn_;
};

} // namespace torchdp::detail
