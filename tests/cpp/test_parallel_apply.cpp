#include "test_common.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

using namespace torchdp_test;

TEST_CASE("parallel_apply runs each replica on its input", "[cpu][parallel_apply]") {
  torch::manual_seed(8);
  torch::nn::Linear linear(4, 2);
  auto replicas = torchdp::replicate(linear, cpu_devices(3));
  std::vector<torch::Tensor> inputs{torch::randn({2, 4}), torch::randn({3, 4}),
                                    torch::randn({1, 4})};
  auto outputs = torchdp::parallel_apply(replicas, inputs);
  REQUIRE(outputs.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(torch::allclose(outputs[i], linear->forward(inputs[i])));
    CHECK(outputs[i].requires_grad());
  }
}

TEST_CASE("parallel_apply moves outputs to the requested devices", "[cpu][parallel_apply]") {
  std::vector<torch::nn::Linear> modules{torch::nn::Linear(3, 3), torch::nn::Linear(3, 3)};
  std::vector<torch::Tensor> inputs{torch::randn({2, 3}), torch::randn({2, 3})};
  auto outputs = torchdp::parallel_apply(modules, inputs,
                                         std::vector<torch::Device>{torch::kCPU, torch::kMeta});
  CHECK(outputs[0].device().is_cpu());
  CHECK(outputs[1].device().is_meta());
}

TEST_CASE("an exception in a replica is rethrown with its replica and device",
          "[cpu][parallel_apply]") {
  Throwing module;
  auto replicas = torchdp::replicate(module, cpu_devices(3));
  std::vector<torch::Tensor> inputs{torch::ones({1}), -torch::ones({1}), -torch::ones({1})};
  // The first failing replica wins, and the c10::Error class is kept.
  CHECK_THROWS_AS(torchdp::parallel_apply(replicas, inputs), c10::ValueError);
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_apply(replicas, inputs),
                            "Caught c10::ValueError in replica 1 on device cpu.\n", "Badness!");
}

TEST_CASE("std exceptions are wrapped too", "[cpu][parallel_apply]") {
  const auto devices = cpu_devices(2);
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_run(2, devices,
                                                  [](size_t i) {
                                                    if (i == 1) {
                                                      throw std::out_of_range("key 'wonderful'");
                                                    }
                                                  }),
                            "Caught std::out_of_range in replica 1 on device cpu.",
                            "key 'wonderful'");
}

TEST_CASE("grad mode and autocast state are carried into the workers", "[cpu][parallel_apply]") {
  const auto devices = cpu_devices(3);
  std::vector<int> grad(3, -1);
  SECTION("grad mode") {
    {
      torch::NoGradGuard no_grad;
      torchdp::parallel_run(3, devices, [&](size_t i) {
        grad[i] = c10::GradMode::is_enabled();
      });
    }
    CHECK(grad == std::vector<int>{0, 0, 0});
    torchdp::parallel_run(3, devices, [&](size_t i) {
      grad[i] = c10::GradMode::is_enabled();
    });
    CHECK(grad == std::vector<int>{1, 1, 1});
  }
  SECTION("autocast enabled flag and dtype") {
    const bool was_enabled = at::autocast::is_autocast_enabled(at::kCPU);
    const auto was_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    std::vector<int> enabled(3, -1);
    std::vector<at::ScalarType> dtypes(3, at::kFloat);
    torchdp::parallel_run(3, devices, [&](size_t i) {
      enabled[i] = at::autocast::is_autocast_enabled(at::kCPU);
      dtypes[i] = at::autocast::get_autocast_dtype(at::kCPU);
    });
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, was_dtype);
    CHECK(enabled == std::vector<int>{1, 1, 1});
    CHECK(dtypes == std::vector<at::ScalarType>{at::kBFloat16, at::kBFloat16, at::kBFloat16});
  }
}

TEST_CASE("tasks run with the caller's intra-op thread count", "[cpu][parallel_apply]") {
  // Note [Intra-op threads of workers]: with OpenMP the count is per thread, so a worker that
  // kept its first setting would miss every later change.
  const auto devices = cpu_devices(3);
  const int was = at::get_num_threads();
  std::vector<int> seen(3, 0);
  std::vector<std::vector<int>> all;
  for (const int k : {1, 3, 2, 1}) {
    at::set_num_threads(k);
    torchdp::parallel_run(3, devices, [&](size_t i) {
      seen[i] = at::get_num_threads();
    });
    all.push_back(seen);
  }
  at::set_num_threads(was);
  CHECK(all == std::vector<std::vector<int>>{{1, 1, 1}, {3, 3, 3}, {2, 2, 2}, {1, 1, 1}});
}

TEST_CASE("workers are persistent and task 0 runs on the calling thread", "[cpu][parallel_apply]") {
  const auto devices = cpu_devices(3);
  std::vector<std::thread::id> first(3), second(3);
  torchdp::parallel_run(3, devices, [&](size_t i) {
    first[i] = std::this_thread::get_id();
  });
  torchdp::parallel_run(3, devices, [&](size_t i) {
    second[i] = std::this_thread::get_id();
  });
  CHECK(first[0] == std::this_thread::get_id());
  CHECK(first[1] != first[0]);
  CHECK(first[2] != first[1]);
  CHECK(first == second);
}

TEST_CASE("nested parallel_run inside a worker runs inline", "[cpu][parallel_apply]") {
  const auto devices = cpu_devices(2);
  std::atomic<int> inner{0};
  torchdp::parallel_run(2, devices, [&](size_t) {
    torchdp::parallel_run(2, devices, [&](size_t) {
      inner++;
    });
  });
  CHECK(inner == 4);
}

TEST_CASE("nested parallel_run inside task 0 runs inline too", "[cpu][parallel_apply]") {
  // Task 0 runs on the calling thread. Queued on worker 0, its nested tasks would wait behind
  // task 1, which here waits for task 0 (as replicas that synchronise with each other do).
  const auto devices = cpu_devices(2);
  std::atomic<bool> task0_done{false};
  std::atomic<bool> task1_saw_it{false};
  std::atomic<int> inner{0};
  torchdp::parallel_run(2, devices, [&](size_t i) {
    if (i == 0) {
      torchdp::parallel_run(2, devices, [&](size_t) {
        inner++;
      });
      task0_done = true;
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!task0_done && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    task1_saw_it = task0_done.load();
  });
  CHECK(inner == 2);
  CHECK(task1_saw_it);
}

TEST_CASE("parallel_apply rejects mismatched lengths", "[cpu][parallel_apply]") {
  std::vector<torch::nn::Linear> modules{torch::nn::Linear(1, 1), torch::nn::Linear(1, 1)};
  std::vector<torch::Tensor> one_input{torch::ones({1, 1})};
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_apply(modules, one_input), "torchdp::parallel_apply",
                            "2 modules but 1 inputs");
  std::vector<torch::Tensor> inputs{torch::ones({1, 1}), torch::ones({1, 1})};
  TORCHDP_CHECK_THROWS_WITH(
      torchdp::parallel_apply(modules, inputs, std::vector<torch::Device>{torch::kCPU}),
      "torchdp::parallel_apply", "2 modules but 1 devices");
}

namespace {

// Threads of this process (0 where /proc is not available).
size_t thread_count() {
  std::error_code error;
  size_t n = 0;
  for (std::filesystem::directory_iterator it("/proc/self/task", error), end; !error && it != end;
       it.increment(error)) {
    ++n;
  }
  return error ? 0 : n;
}

} // namespace

TEST_CASE("an interrupted wait returns while a task hangs, and the next call runs elsewhere",
          "[cpu][parallel_apply]") {
  const auto devices = cpu_devices(3);
  // Owned by the tasks (they may outlive the call).
  struct Hang {
    std::atomic<bool> started{false};
    std::atomic<bool> release{false};
    std::atomic<bool> late{false};
    std::thread::id thread; // written before `started`, read after it
  };
  auto hang = std::make_shared<Hang>();
  std::atomic<int> polls{0};
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(torchdp::parallel_run(
                      3, devices,
                      [hang](size_t i) {
                        if (i == 2) {
                          hang->thread = std::this_thread::get_id();
                          hang->started = true;
                          while (!hang->release) {
                            std::this_thread::sleep_for(std::chrono::milliseconds(1));
                          }
                          hang->late = true;
                        }
                      },
                      [&polls, hang] {
                        // Interrupt only once the task hangs for sure.
                        return hang->started && ++polls >= 3;
                      },
                      5),
                  torchdp::Interrupted);
  CHECK(polls == 3);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK_FALSE(hang->late);
  REQUIRE(hang->started);
  // The hung task's slot runs the next call at once on a new thread; the other slot kept its
  // worker.
  std::vector<std::thread::id> ids(3);
  const auto next = std::chrono::steady_clock::now();
  torchdp::parallel_run(3, devices, [&](size_t i) {
    ids[i] = std::this_thread::get_id();
  });
  CHECK(std::chrono::steady_clock::now() - next < std::chrono::seconds(5));
  CHECK(ids[2] != hang->thread);
  CHECK(ids[2] != ids[1]);
  CHECK(ids[2] != std::this_thread::get_id());
  CHECK_FALSE(hang->late);
  // The abandoned task finishes on its own once released; its worker becomes idle again, so
  // later calls start no thread.
  hang->release = true;
  for (int i = 0; i < 5000 && !hang->late; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(hang->late);
  const auto threads = thread_count();
  for (int k = 0; k < 20; ++k) {
    torchdp::parallel_run(3, devices, [](size_t) {});
  }
  CHECK(thread_count() == threads);
}

namespace {

// A barrier for the tasks of one call: every task waits until all `n` arrived, or `timeout`.
struct CallBarrier {
  explicit CallBarrier(size_t parties) : n(parties) {}
  bool arrive_and_wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex);
    if (++arrived == n) {
      cv.notify_all();
      return true;
    }
    return cv.wait_for(lock, timeout, [this] {
      return arrived == n;
    });
  }
  std::mutex mutex;
  std::condition_variable cv;
  size_t n;
  size_t arrived = 0;
};

} // namespace

TEST_CASE("the tasks of concurrent calls never wait behind each other", "[cpu][parallel_apply]") {
  // Tasks that wait for the other tasks of their call (a barrier, as synchronised BatchNorm
  // does), driven by several threads at once: each call's tasks must all run at the same time.
  const size_t n = 4;
  const auto devices = cpu_devices(n);
  std::atomic<int> timeouts{0};
  std::atomic<int> calls{0};
  auto drive = [&] {
    for (int k = 0; k < 50; ++k) {
      auto barrier = std::make_shared<CallBarrier>(n);
      torchdp::parallel_run(n, devices, [&, barrier](size_t) {
        if (!barrier->arrive_and_wait(std::chrono::seconds(10))) {
          ++timeouts;
        }
      });
      ++calls;
    }
  };
  std::vector<std::thread> callers;
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back(drive);
  }
  for (auto& t : callers) {
    t.join();
  }
  CHECK(timeouts == 0);
  CHECK(calls == 150);
}

TEST_CASE("a forked child runs parallel calls on workers of its own", "[cpu][parallel_apply]") {
  const auto devices = cpu_devices(3);
  std::atomic<int> ran{0};
  torchdp::parallel_run(3, devices, [&](size_t) {
    ++ran;
  }); // the parent's workers exist now
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::atomic<int> child_ran{0};
    torchdp::parallel_run(3, devices, [&](size_t) {
      ++child_ran;
    });
    _exit(child_ran == 3 ? 0 : 3);
  }
  int status = 0;
  bool exited = false;
  for (int i = 0; i < 3000 && !exited; ++i) {
    exited = waitpid(pid, &status, WNOHANG) == pid;
    if (!exited) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  if (!exited) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  CHECK(exited); // a hang would have been killed after 30 s
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  torchdp::parallel_run(3, devices, [&](size_t) {
    ++ran;
  }); // the parent's workers still serve it
  CHECK(ran == 6);
}

TEST_CASE("an interruptible wait that is not interrupted returns results and errors",
          "[cpu][parallel_apply]") {
  const auto devices = cpu_devices(3);
  auto hits = std::make_shared<std::vector<int>>(3, 0);
  torchdp::parallel_run(
      3, devices,
      [hits](size_t i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(i == 1 ? 30 : 0));
        (*hits)[i] = static_cast<int>(i) + 1;
      },
      [] {
        return false;
      },
      1);
  CHECK(*hits == std::vector<int>{1, 2, 3});
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_run(
                                2, devices,
                                [](size_t i) {
                                  if (i == 1) {
                                    throw std::runtime_error("replica one failed");
                                  }
                                },
                                [] {
                                  return false;
                                }),
                            "Caught std::runtime_error in replica 1 on device cpu.",
                            "replica one failed");
  TORCHDP_CHECK_THROWS_WITH(torchdp::parallel_run(
                                1, devices, [](size_t) {},
                                [] {
                                  return false;
                                },
                                0),
                            "poll_ms must be positive, got 0");
}
