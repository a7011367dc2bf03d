#pragma once

// One include for Catch2 v2 (Debian 12) and v3 (Debian 13, Ubuntu 24.04).
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define TORCHDP_CATCH_V3 1
#define TORCHDP_SKIP(msg) SKIP(msg)
#else
#include <catch2/catch.hpp>
#define TORCHDP_CATCH_V3 0
#define TORCHDP_SKIP(msg)     \
  do {                        \
    WARN("skipped: " << msg); \
    return;                   \
  } while (0)
#endif
