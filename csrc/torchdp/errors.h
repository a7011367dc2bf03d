#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

#include <exception>
#include <string>

namespace torchdp::detail {

/// Rethrows the exception being handled (call it inside a catch block) with `prefix` before its
/// message, as a c10::Error of the same class where it has one, else a plain c10::Error.
[[noreturn]] inline void rethrow_with_prefix(const std::string& prefix) {
  const c10::SourceLocation here{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  try {
    throw;
  } catch (const c10::Error& e) {
    const std::string message = prefix + e.what_without_backtrace();
    if (dynamic_cast<const c10::IndexError*>(&e)) {
      throw c10::IndexError(here, message);
    } else if (dynamic_cast<const c10::ValueError*>(&e)) {
      throw c10::ValueError(here, message);
    } else if (dynamic_cast<const c10::TypeError*>(&e)) {
      throw c10::TypeError(here, message);
    } else if (dynamic_cast<const c10::NotImplementedError*>(&e)) {
      throw c10::NotImplementedError(here, message);
    } else if (dynamic_cast<const c10::LinAlgError*>(&e)) {
      throw c10::LinAlgError(here, message);
    } else if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) {
      throw c10::OutOfMemoryError(here, message);
    }
    throw c10::Error(here, message);
  } catch (const std::exception& e) {
    throw c10::Error(here, prefix + e.what());
  } catch (...) {
    throw c10::Error(here, prefix + "an exception that is not a std::exception");
  }
}

} // namespace torchdp::detail
