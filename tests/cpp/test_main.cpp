// The test runner's main(), for Catch2 v3 (compiled library) and v2 (header-only).
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

int main(int argc, char* argv[]) {
  return Catch::Session().run(argc, argv);
}
