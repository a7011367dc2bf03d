#include <torchdp/devices.h>
#include <torchdp/enclosing_forward.h>
#include <torchdp/errors.h>
#include <torchdp/parallel_apply.h>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/TracerMode.h>
#include <ATen/autocast_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Type.h>
#include <torch/csrc/autograd/engine.h>

#if defined(__GLIBCXX__)
#include <cxxabi.h> // abi::__forced_unwind
// UBSan sees the catch clause rethrowing a forced unwind (no exception object) as a null binding.
#define TORCHDP_RETHROWS_FORCED_UNWIND __attribute__((no_sanitize("null")))
#else
#define TORCHDP_RETHROWS_FORCED_UNWIND
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include <pthread.h>

namespace torchdp {
namespace {

thread_local bool in_worker = false;

// Note [Persistent workers]
// Workers are made on first use and reused, since parallel_apply runs every step. A call's tasks
// start at once, each on an idle worker of its slot or a new one, never queued behind another
// call's: replicas that wait for each other (synchronised BatchNorm) cannot deadlock with a
// concurrent call's. A forked child gets a fresh pool (Note [Forked children]). Pools are never
// destroyed: joining threads in static destructors can deadlock with libraries already torn down.
class WorkerPool {
 public:
  static WorkerPool& instance() {
    WorkerPool* pool = current_.load(std::memory_order_acquire);
    if (pool == nullptr) {
      auto* fresh = new WorkerPool();
      if (current_.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) {
        return *fresh;
      }
      delete fresh; // another thread made the pool first; `pool` holds it
    }
    return *pool;
  }

  // In a forked child: the parent's workers are gone, the next call makes a new pool (the old
  // one is leaked, with the idle lists that name the dead threads).
  static void forget() {
    current_.store(nullptr, std::memory_order_release);
  }

  // Runs `task` at once on an idle worker of `slot`, or a new one; then `done`, once that worker
  // is idle again, so that a caller woken by `done` finds it for its next call.
  void submit(size_t slot, std::function<void()> task, std::function<void()> done) {
    Worker* worker = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (idle_.size() <= slot) {
        idle_.resize(slot + 1);
      }
      auto& idle = idle_[slot];
      if (!idle.empty()) {
        worker = idle.back();
        idle.pop_back();
      }
    }
    if (worker == nullptr) {
      worker = new Worker(this, slot); // owns itself: deleted when its thread ends
    }
    {
      std::lock_guard<std::mutex> lock(worker->mutex);
      worker->job = Job{std::move(task), std::move(done)};
    }
    worker->cv.notify_one();
  }

 private:
  static constexpr size_t kIdlePerSlot = 4;

  struct Job {
    std::function<void()> task;
    std::function<void()> done;
  };

  struct Worker {
    WorkerPool* pool;
    size_t slot;
    std::mutex mutex;
    std::condition_variable cv;
    std::optional<Job> job; // set only while the worker is not idle

    Worker(WorkerPool* p, size_t s) : pool(p), slot(s) {
      std::thread([this] {
        loop();
        delete this;
      }).detach();
    }

    void loop() {
      in_worker = true;
      at::init_num_threads(); // Note [Intra-op threads of workers]
      for (;;) {
        Job next;
        {
          std::unique_lock<std::mutex> lock(mutex);
          cv.wait(lock, [this] {
            return job.has_value();
          });
          next = std::move(*job);
          job.reset();
        }
        next.task();
        const bool kept = pool->park(this);
        next.done();
        if (!kept) {
          return;
        }
      }
    }
  };

  // Puts an idle worker back on its slot's list; false when the slot has enough idle workers.
  bool park(Worker* worker) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& idle = idle_[worker->slot];
    if (idle.size() >= kIdlePerSlot) {
      return false;
    }
    idle.push_back(worker);
    return true;
  }

  static std::atomic<WorkerPool*> current_;
  std::mutex mutex_;
  std::vector<std::vector<Worker*>> idle_;
};

std::atomic<WorkerPool*> WorkerPool::current_{nullptr};

struct Latch {
  std::mutex mutex;
  std::condition_variable cv;
  size_t remaining;
  explicit Latch(size_t n) : remaining(n) {}
  void count_down() {
    std::lock_guard<std::mutex> lock(mutex);
    if (--remaining == 0) {
      cv.notify_all();
    }
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [this] {
      return remaining == 0;
    });
  }
  bool wait_for(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex);
    return cv.wait_for(lock, timeout, [this] {
      return remaining == 0;
    });
  }
};

bool needs_guard(c10::Device device) {
  return !device.is_cpu() && !device.is_meta() && c10::impl::hasDeviceGuardImpl(device.type());
}

// Rethrows `error` of replica `index` with PyTorch's "Caught ..." wording and c10::Error class.
[[noreturn]] void rethrow_wrapped(std::exception_ptr error, size_t index, c10::Device device) {
  const auto where = " in replica " + std::to_string(index) + " on device " + device.str();
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    detail::rethrow_with_prefix("Caught " + c10::demangle(typeid(e).name()) + where + ".\n");
  } catch (...) {
    throw c10::Error(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "Caught an unknown exception" + where + ".");
  }
}

// Note [Intra-op threads of workers]
// A task runs with its caller's intra-op thread count, as torch's own pool threads do. With
// OpenMP that count is per thread (omp_set_num_threads, MKL's local setting), and a new thread
// starts with the default team: each replica would run a full team, oversubscribing the cores,
// and a later torch.set_num_threads would never reach the workers. So a worker starts as torch's
// threads do (at::init_num_threads) and each task takes the count its caller had at submission
// through at::set_num_threads when the worker's differs (with the native backend the count is
// global and never differs).
void match_intra_op_threads(int caller_threads) {
  if (at::get_num_threads() != caller_threads) {
    at::set_num_threads(caller_threads);
  }
}

// Note [Interruptible waits]
// A call's state lives in one heap object that every task keeps alive, so a caller that stops
// waiting (Ctrl-C in Python while a replica hangs) can return while tasks still run. Their workers
// stay busy until the tasks end (Note [Persistent workers]), so the next call takes other workers.
struct Run {
  Run(size_t n, const std::vector<c10::Device>& devices, std::function<void(size_t)> fn)
      : devices(devices.begin(), devices.begin() + static_cast<std::ptrdiff_t>(n)),
        streams(n),
        autocast_cache(at::autocast::is_autocast_cache_enabled()),
        intra_op_threads(at::get_num_threads()),
        enclosing(detail::enclosing_forward()),
        errors(n),
        fn(std::move(fn)),
        latch(n > 0 ? n - 1 : 0) {
    // The calling thread's current streams and thread-local state, carried into the tasks.
    for (size_t i = 0; i < n; ++i) {
      if (needs_guard(this->devices[i])) {
        streams[i] =
            c10::impl::getDeviceGuardImpl(this->devices[i].type())->getStream(this->devices[i]);
      }
    }
  }

  TORCHDP_RETHROWS_FORCED_UNWIND void run_one(size_t i) {
    try {
      at::ThreadLocalStateGuard tls_guard(state);
      at::autocast::set_autocast_cache_enabled(autocast_cache);
      match_intra_op_threads(intra_op_threads);
      const detail::EnclosingForwardGuard forward(enclosing);
      c10::OptionalStreamGuard stream_guard;
      if (streams[i]) {
        stream_guard.reset_stream(*streams[i]);
      }
      fn(i);
#if defined(__GLIBCXX__)
    } catch (abi::__forced_unwind&) {
      // A thread ended by pthread_exit (Python at interpreter exit) must not stop unwinding.
      throw;
#endif
    } catch (...) {
      errors[i] = std::current_exception();
    }
  }

  void rethrow_first_error() const {
    for (size_t i = 0; i < errors.size(); ++i) {
      if (errors[i]) {
        rethrow_wrapped(errors[i], i, devices[i]);
      }
    }
  }

  std::vector<c10::Device> devices;
  std::vector<std::optional<c10::Stream>> streams;
  const at::ThreadLocalState state;
  const bool autocast_cache;
  const int intra_op_threads; // Note [Intra-op threads of workers]
  const uint64_t enclosing;   // Note [Nested forwards]
  std::vector<std::exception_ptr> errors;
  std::function<void(size_t)> fn;
  Latch latch;
};

// Note [Forked children]
// The parent's workers do not exist in a forked child: the child makes a new pool. torch's Python
// autograd engine also rebuilds itself in a child, on its first use by any thread and without a
// lock (it counts on the GIL, which torch's ops release while they run): replicas that start
// together in a fresh child would rebuild it at the same time and corrupt the heap. So the first
// parallel run in a child has the engine rebuilt on the calling thread before any task starts.
std::atomic<bool> forked_child{false};
std::mutex forked_child_mutex;

void after_fork_in_child() {
  WorkerPool::forget();
  forked_child.store(true, std::memory_order_release);
}

// Registered when the library loads, so that a child forked before torchdp's first parallel run
// is seen too.
[[maybe_unused]] const bool fork_handler_registered = [] {
  return pthread_atfork(nullptr, nullptr, &after_fork_in_child) == 0;
}();

void settle_after_fork() {
  if (!forked_child.load(std::memory_order_acquire)) {
    return;
  }
  const std::lock_guard<std::mutex> lock(forked_child_mutex);
  if (forked_child.load(std::memory_order_acquire)) {
    (void)torch::autograd::Engine::get_default_engine();
    forked_child.store(false, std::memory_order_release);
  }
}

bool inline_run(size_t n) {
  return n <= 1 || in_worker;
}

// Runs task 0 on the calling thread and the others on the pool; returns without waiting.
std::shared_ptr<Run> start(size_t n, const std::vector<c10::Device>& devices,
                           const std::function<void(size_t)>& fn) {
  TORCH_CHECK(devices.size() >= n, "torchdp::parallel_run: ", n, " tasks but only ", devices.size(),
              " devices; pass one device per task");
  if (n > 1) {
    detail::check_forward_context("torchdp::parallel_run");
  }
  auto run = std::make_shared<Run>(n, devices, fn);
  if (inline_run(n)) {
    for (size_t i = 0; i < n; ++i) {
      run->run_one(i);
    }
    return run;
  }
  settle_after_fork();
  auto& pool = WorkerPool::instance();
  for (size_t i = 1; i < n; ++i) {
    pool.submit(
        i - 1,
        [run, i] {
          run->run_one(i);
        },
        [run] {
          run->latch.count_down();
        });
  }
  // Task 0 runs here: parallel_run calls nested in it run inline, as in the workers' tasks
  // (run_one keeps the task's error, so the flag is always reset; it was false, see inline_run).
  in_worker = true;
  run->run_one(0);
  in_worker = false;
  return run;
}

} // namespace

namespace detail {
void check_forward_context(const char* api) {
  TORCH_CHECK(!at::tracer::impl::is_dispatch_enabled(), api,
              ": torch.jit.trace cannot record a data-parallel forward (its replicas run on "
              "worker threads, which the tracer does not see); trace the wrapped module instead, "
              "e.g. torch.jit.trace(dp.module, example_inputs), and wrap the traced module");
  TORCH_CHECK(
      !c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode),
      api,
      ": a data-parallel forward cannot run inside a torch.func transform (vmap, grad, "
      "jacrev, ...): its replicas copy the parameters, which the transform does not "
      "see. Apply the transform to the wrapped module instead, e.g. "
      "torch.func.vmap(dp.module)(x)");
}
} // namespace detail

void parallel_run(size_t n, const std::vector<c10::Device>& devices,
                  const std::function<void(size_t)>& fn) {
  const auto run = start(n, devices, fn);
  if (!inline_run(n)) {
    run->latch.wait();
  }
  // Every task is done with fn; the workers may still hold `run` for a moment.
  run->fn = nullptr;
  run->rethrow_first_error();
}

void parallel_run(size_t n, const std::vector<c10::Device>& devices,
                  const std::function<void(size_t)>& fn, const std::function<bool()>& interrupted,
                  int poll_ms) {
  TORCH_CHECK(poll_ms > 0, "torchdp::parallel_run: poll_ms must be positive, got ", poll_ms);
  const auto run = start(n, devices, fn);
  if (!inline_run(n)) {
    while (!run->latch.wait_for(std::chrono::milliseconds(poll_ms))) {
      if (interrupted()) {
        throw Interrupted();
      }
    }
  }
  run->fn = nullptr;
  run->rethrow_first_error();
}

} // namespace torchdp
