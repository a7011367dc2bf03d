#include <torchdp/devices.h>
#include <torchdp/errors.h>
#include <torchdp/parallel_apply.h>

#include <ATen/ThreadLocalState.h>
#include <ATen/autocast_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Type.h>

#if defined(__GLIBCXX__)
#include <cxxabi.h> // abi::__forced_unwind
// A forced unwind has no exception object, so UBSan reports the (standard) catch clause that
// rethrows it as a null reference binding; that clause's function is not checked for it.
#define TORCHDP_RETHROWS_FORCED_UNWIND __attribute__((no_sanitize("null")))
#else
#define TORCHDP_RETHROWS_FORCED_UNWIND
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace torchdp {
namespace {

thread_local bool in_worker = false;

// Note [Persistent workers]
// parallel_apply runs every step, so creating threads per call (as torch.nn.parallel does) costs
// real time. Workers are created on first use, one per replica slot beyond the first, and live for
// the process (the pool is leaked on purpose: joining threads from static destructors can deadlock
// with libraries that are already torn down). Each worker runs the tasks of its slot in order.
// A worker whose task was abandoned by an interrupted call (Note [Interruptible waits]) is retired:
// it leaves its slot, finishes that task on its own and then ends its thread; the slot's next
// task gets a new worker.
class WorkerPool {
 public:
  static WorkerPool& instance() {
    static auto* pool = new WorkerPool();
    return *pool;
  }

  void submit(size_t slot, std::function<void()> task) {
    // The task is queued under the pool's lock, so a worker that abandon() retires gets no task
    // after it was retired (lock order: pool, then worker).
    std::lock_guard<std::mutex> lock(mutex_);
    if (workers_.size() <= slot) {
      workers_.resize(slot + 1);
    }
    if (!workers_[slot]) {
      workers_[slot] = new Worker();
    }
    Worker* worker = workers_[slot];
    {
      std::lock_guard<std::mutex> worker_lock(worker->mutex);
      worker->tasks.push_back(std::move(task));
    }
    worker->cv.notify_one();
  }

  // The worker of `slot` is busy with a task nobody waits for: it is retired (its thread ends,
  // and deletes it, once its queue is empty) and the slot gets a new worker next time.
  void abandon(size_t slot) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (slot < workers_.size() && workers_[slot]) {
      Worker* worker = workers_[slot];
      {
        // Notified under the worker's lock: once it is released, the worker may end and delete
        // itself.
        std::lock_guard<std::mutex> worker_lock(worker->mutex);
        worker->retired = true;
        worker->cv.notify_one();
      }
      workers_[slot] = nullptr;
    }
  }

 private:
  struct Worker {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> tasks;
    bool retired = false;
    std::thread thread;

    Worker()
        : thread([this] {
            loop();
            delete this; // retired: nothing refers to this worker any more
          }) {
      thread.detach();
    }

    void loop() {
      in_worker = true;
      for (;;) {
        std::function<void()> task;
        {
          std::unique_lock<std::mutex> lock(mutex);
          cv.wait(lock, [this] {
            return !tasks.empty() || retired;
          });
          if (tasks.empty()) {
            return; // retired and done
          }
          task = std::move(tasks.front());
          tasks.pop_front();
        }
        task();
      }
    }
  };

  std::mutex mutex_;
  std::vector<Worker*> workers_;
};

// Counts finished tasks; the caller waits for all.
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
  // True when every task finished within `timeout`.
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

std::string device_label(c10::Device device) {
  return device.str();
}

// Rethrows `error`, caught in replica `index` on `device`, with PyTorch's "Caught ..." wording and
// the same c10::Error class where it has one.
[[noreturn]] void rethrow_wrapped(std::exception_ptr error, size_t index, c10::Device device) {
  const auto where = " in replica " + std::to_string(index) + " on device " + device_label(device);
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    detail::rethrow_with_prefix("Caught " + c10::demangle(typeid(e).name()) + where + ".\n");
  } catch (...) {
    throw c10::Error(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                     "Caught an unknown exception" + where + ".");
  }
}

// Note [Interruptible waits]
// Everything a call's tasks touch lives in one heap object that every task keeps alive, so a
// caller that stops waiting (the interruptible parallel_run: Ctrl-C in Python while a replica
// hangs) can return while tasks are still running. The tasks record their completion in
// `finished`; the caller abandons the worker slots of the unfinished ones.
struct Run {
  Run(size_t n, const std::vector<c10::Device>& devices, std::function<void(size_t)> fn)
      : devices(devices.begin(), devices.begin() + static_cast<std::ptrdiff_t>(n)),
        streams(n),
        autocast_cache(at::autocast::is_autocast_cache_enabled()),
        errors(n),
        finished(n),
        fn(std::move(fn)),
        latch(n > 0 ? n - 1 : 0) {
    // Captured in the calling thread: its current stream on each device and its thread-local
    // state.
    for (size_t i = 0; i < n; ++i) {
      if (needs_guard(this->devices[i])) {
        streams[i] =
            c10::impl::getDeviceGuardImpl(this->devices[i].type())->getStream(this->devices[i]);
      }
      finished[i] = false;
    }
  }

  TORCHDP_RETHROWS_FORCED_UNWIND void run_one(size_t i) {
    try {
      at::ThreadLocalStateGuard tls_guard(state);
      at::autocast::set_autocast_cache_enabled(autocast_cache);
      c10::OptionalStreamGuard stream_guard;
      if (streams[i]) {
        stream_guard.reset_stream(*streams[i]);
      }
      fn(i);
#if defined(__GLIBCXX__)
    } catch (abi::__forced_unwind&) {
      // The thread is being ended (pthread_exit, e.g. by Python taking the GIL away from an
      // abandoned task at interpreter exit): that unwinding must not be stopped.
      throw;
#endif
    } catch (...) {
      errors[i] = std::current_exception();
    }
    finished[i] = true;
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
  std::vector<std::exception_ptr> errors;
  std::vector<std::atomic<bool>> finished;
  std::function<void(size_t)> fn;
  Latch latch;
};

// Marks the calling thread as running a task while it lives (restored at scope exit).
class InWorker {
 public:
  InWorker() : was_(in_worker) {
    in_worker = true;
  }
  ~InWorker() {
    in_worker = was_;
  }
  InWorker(const InWorker&) = delete;
  InWorker& operator=(const InWorker&) = delete;

 private:
  bool was_;
};

bool inline_run(size_t n) {
  return n <= 1 || in_worker;
}

// Runs task 0 on the calling thread and the others on the pool; returns without waiting.
std::shared_ptr<Run> start(size_t n, const std::vector<c10::Device>& devices,
                           const std::function<void(size_t)>& fn) {
  TORCH_CHECK(devices.size() >= n, "torchdp::parallel_run: ", n, " tasks but only ", devices.size(),
              " devices; pass one device per task");
  auto run = std::make_shared<Run>(n, devices, fn);
  if (inline_run(n)) {
    for (size_t i = 0; i < n; ++i) {
      run->run_one(i);
    }
    return run;
  }
  auto& pool = WorkerPool::instance();
  for (size_t i = 1; i < n; ++i) {
    pool.submit(i - 1, [run, i] {
      run->run_one(i);
      run->latch.count_down();
    });
  }
  {
    // Task 0 runs here: parallel_run calls nested in it run inline, as in the workers' tasks
    // (queued on worker 0 they would wait behind this call's task 1, which may wait for task 0).
    const InWorker inline_nested;
    run->run_one(0);
  }
  return run;
}

} // namespace

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
        auto& pool = WorkerPool::instance();
        for (size_t i = 1; i < n; ++i) {
          if (!run->finished[i]) {
            pool.abandon(i - 1);
          }
        }
        throw Interrupted();
      }
    }
  }
  run->fn = nullptr;
  run->rethrow_first_error();
}

} // namespace torchdp
