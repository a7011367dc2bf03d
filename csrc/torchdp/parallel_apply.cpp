#include <torchdp/devices.h>
#include <torchdp/parallel_apply.h>

#include <ATen/ThreadLocalState.h>
#include <ATen/autocast_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Type.h>

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
class WorkerPool {
 public:
  static WorkerPool& instance() {
    static auto* pool = new WorkerPool();
    return *pool;
  }

  void submit(size_t slot, std::function<void()> task) {
    Worker* worker = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (workers_.size() <= slot) {
        workers_.push_back(std::make_unique<Worker>());
      }
      worker = workers_[slot].get();
    }
    {
      std::lock_guard<std::mutex> lock(worker->mutex);
      worker->tasks.push_back(std::move(task));
    }
    worker->cv.notify_one();
  }

 private:
  struct Worker {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> tasks;
    std::thread thread;

    Worker()
        : thread([this] {
            loop();
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
            return !tasks.empty();
          });
          task = std::move(tasks.front());
          tasks.pop_front();
        }
        task();
      }
    }
  };

  std::mutex mutex_;
  std::vector<std::unique_ptr<Worker>> workers_;
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
};

bool needs_guard(c10::Device device) {
  return !device.is_cpu() && !device.is_meta() && c10::impl::hasDeviceGuardImpl(device.type());
}

std::string device_label(c10::Device device) {
  return device.str();
}

template <typename E>
[[noreturn]] void throw_as(const std::string& message) {
  throw E(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
}

// Rethrows `error`, caught in replica `index` on `device`, with PyTorch's "Caught ..." wording and
// the same c10::Error class where it has one.
[[noreturn]] void rethrow_wrapped(std::exception_ptr error, size_t index, c10::Device device) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    const std::string prefix = "Caught " + c10::demangle(typeid(e).name()) + " in replica " +
                               std::to_string(index) + " on device " + device_label(device) + ".\n";
    const std::string message = prefix + e.what_without_backtrace();
    if (dynamic_cast<const c10::IndexError*>(&e)) {
      throw_as<c10::IndexError>(message);
    } else if (dynamic_cast<const c10::ValueError*>(&e)) {
      throw_as<c10::ValueError>(message);
    } else if (dynamic_cast<const c10::TypeError*>(&e)) {
      throw_as<c10::TypeError>(message);
    } else if (dynamic_cast<const c10::NotImplementedError*>(&e)) {
      throw_as<c10::NotImplementedError>(message);
    } else if (dynamic_cast<const c10::LinAlgError*>(&e)) {
      throw_as<c10::LinAlgError>(message);
    } else if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) {
      throw_as<c10::OutOfMemoryError>(message);
    }
    throw_as<c10::Error>(message);
  } catch (const std::exception& e) {
    throw_as<c10::Error>("Caught " + c10::demangle(typeid(e).name()) + " in replica " +
                         std::to_string(index) + " on device " + device_label(device) + ".\n" +
                         e.what());
  } catch (...) {
    throw_as<c10::Error>("Caught an unknown exception in replica " + std::to_string(index) +
                         " on device " + device_label(device) + ".");
  }
}

} // namespace

void parallel_run(size_t n, const std::vector<c10::Device>& devices,
                  const std::function<void(size_t)>& fn) {
  TORCH_CHECK(devices.size() >= n, "torchdp::parallel_run: ", n, " tasks but only ", devices.size(),
              " devices; pass one device per task");
  if (n == 0) {
    return;
  }
  // Captured in the calling thread: its current stream on each device and its thread-local state.
  std::vector<std::optional<c10::Stream>> streams(n);
  for (size_t i = 0; i < n; ++i) {
    if (needs_guard(devices[i])) {
      streams[i] = c10::impl::getDeviceGuardImpl(devices[i].type())->getStream(devices[i]);
    }
  }
  const at::ThreadLocalState state;
  const bool autocast_cache = at::autocast::is_autocast_cache_enabled();
  std::vector<std::exception_ptr> errors(n);

  auto run_one = [&](size_t i) {
    try {
      at::ThreadLocalStateGuard tls_guard(state);
      at::autocast::set_autocast_cache_enabled(autocast_cache);
      c10::OptionalStreamGuard stream_guard;
      if (streams[i]) {
        stream_guard.reset_stream(*streams[i]);
      }
      fn(i);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };

  if (n == 1 || in_worker) {
    for (size_t i = 0; i < n; ++i) {
      run_one(i);
    }
  } else {
    Latch latch(n - 1);
    auto& pool = WorkerPool::instance();
    for (size_t i = 1; i < n; ++i) {
      pool.submit(i - 1, [&, i] {
        run_one(i);
        latch.count_down();
      });
    }
    run_one(0);
    latch.wait();
  }
  for (size_t i = 0; i < n; ++i) {
    if (errors[i]) {
      rethrow_wrapped(errors[i], i, devices[i]);
    }
  }
}

} // namespace torchdp
