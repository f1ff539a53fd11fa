#include "pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mlx_tfm_kernels {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int available_cores() {
  if (const char* env = std::getenv("MLX_TFM_KERNELS_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// Workers spin this long after a job before sleeping (MLX_TFM_KERNELS_SPIN_US, default
// 20): decoding calls the pool every few tens of microseconds, and waking a sleeping
// thread costs about as much; spinning longer takes a core from the thread that builds
// the next step's graph.
std::chrono::microseconds spin_time() {
  const char* env = std::getenv("MLX_TFM_KERNELS_SPIN_US");
  return std::chrono::microseconds(env ? std::atoi(env) : 20);
}

// One call's tasks. Each call gets its own, so a worker that wakes late for an earlier
// call finds that call's counter exhausted and takes nothing from the next.
struct Job {
  const std::function<void(int64_t)>* task;
  int64_t tasks;
  std::atomic<int64_t> next{0}, done{0};

  void take_tasks() {
    for (int64_t i; (i = next.fetch_add(1)) < tasks;) {
      (*task)(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int64_t tasks, const std::function<void(int64_t)>& task) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (workers_.empty() || tasks <= 1 || !busy.owns_lock()) {
      for (int64_t i = 0; i < tasks; ++i) task(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->task = &task;
    job->tasks = tasks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job->take_tasks();
    while (job->done.load(std::memory_order_acquire) < tasks) cpu_relax();
  }

 private:
  void work() {
    uint64_t seen = 0;
    const auto spin = spin_time();
    while (true) {
      auto spin_until = std::chrono::steady_clock::now() + spin;
      while (generation_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < spin_until)
        cpu_relax();
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        job = job_;
      }
      job->take_tasks();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex busy_, mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Job> job_;
};

Pool& pool() {
  // Never destroyed: workers may still spin while the interpreter exits.
  static Pool* p = new Pool(available_cores());
  return *p;
}

}  // namespace

void parallel_for(int64_t tasks, const std::function<void(int64_t)>& task) { pool().run(tasks, task); }

int pool_threads() { return pool().threads(); }

}  // namespace mlx_tfm_kernels
