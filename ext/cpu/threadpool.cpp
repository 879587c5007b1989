// The CPU thread pool: persistent workers, one job at a time, static contiguous chunks.
//
// A step issues hundreds of parallel_for calls (every projection of every layer), so waking the
// workers must be cheap: after a job a worker spins briefly on the job counter before it sleeps
// on the condition variable, and the caller's own thread runs chunk 0. Chunking is static
// (chunk i of k is [i*n/k, (i+1)*n/k)): which thread computes a row never changes its value,
// because every kernel computes each row independently.
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dispatch.h"

namespace ds4 {

namespace cpu {

int physical_cores() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  int allowed = 0;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) allowed = CPU_COUNT(&mask);
  // Count distinct (package, core) pairs among the CPUs we may run on: SMT siblings share a core
  // and add little to memory-bound matrix products.
  std::set<std::pair<int, int>> cores;
  const int max_cpu = CPU_SETSIZE;
  for (int cpu = 0; cpu < max_cpu; ++cpu) {
    if (allowed > 0 && !CPU_ISSET(cpu, &mask)) continue;
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    std::ifstream core_f(base + "core_id"), pkg_f(base + "physical_package_id");
    int core = -1, pkg = -1;
    if (!(core_f >> core) || !(pkg_f >> pkg)) continue;
    cores.emplace(pkg, core);
  }
  int n = static_cast<int>(cores.size());
  if (n == 0) n = static_cast<int>(std::thread::hardware_concurrency());
  if (allowed > 0 && n > allowed) n = allowed;
  return n > 0 ? n : 1;
}

}  // namespace cpu

namespace {
// Set while a thread runs a chunk, so a nested parallel_for runs inline instead of deadlocking.
thread_local bool t_in_pool_job = false;
constexpr int kSpinIterations = 4000;  // some tens to hundreds of microseconds before sleeping
}  // namespace

struct ThreadPool::Impl {
  int n_threads = 1;
  std::vector<std::thread> workers;

  std::mutex call_mu;  // one job at a time when several threads share the pool

  std::mutex mu;
  std::condition_variable wake_cv, done_cv;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> pending{0};
  bool stop = false;

  // The current job (valid while pending > 0).
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t n = 0;
  int n_chunks = 0;
  std::exception_ptr error;
  std::mutex error_mu;

  void run_chunk(int i) {
    const int64_t b = n * i / n_chunks, e = n * (i + 1) / n_chunks;
    if (b >= e) return;
    t_in_pool_job = true;
    try {
      (*fn)(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
    }
    t_in_pool_job = false;
  }

  void worker(int index) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = generation.load(std::memory_order_acquire);
      for (int spin = 0; gen == seen && spin < kSpinIterations; ++spin) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        gen = generation.load(std::memory_order_acquire);
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mu);
        wake_cv.wait(lock, [&] { return stop || generation.load(std::memory_order_acquire) != seen; });
        if (stop) return;
        gen = generation.load(std::memory_order_acquire);
      }
      seen = gen;
      if (index < n_chunks) run_chunk(index);
      if (pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu);
        done_cv.notify_one();
      }
    }
  }
};

ThreadPool::ThreadPool(int n_threads) : impl_(new Impl) {
  impl_->n_threads = n_threads > 0 ? n_threads : cpu::physical_cores();
  for (int i = 1; i < impl_->n_threads; ++i) impl_->workers.emplace_back([this, i] { impl_->worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->wake_cv.notify_all();
  for (auto& t : impl_->workers) t.join();
  delete impl_;
}

int ThreadPool::size() const { return impl_->n_threads; }

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  const int64_t want = (n + grain - 1) / grain;
  const int chunks = static_cast<int>(std::min<int64_t>(want, impl_->n_threads));
  if (chunks <= 1 || t_in_pool_job) {
    fn(0, n);
    return;
  }
  Impl& p = *impl_;
  std::lock_guard<std::mutex> call_lock(p.call_mu);
  p.fn = &fn;
  p.n = n;
  p.n_chunks = chunks;
  p.error = nullptr;
  // Every worker acknowledges every job (workers past n_chunks just count down), which keeps the
  // generation protocol simple: no worker can miss a generation and run a stale job.
  p.pending.store(static_cast<int>(p.workers.size()), std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.generation.fetch_add(1, std::memory_order_acq_rel);
  }
  p.wake_cv.notify_all();
  p.run_chunk(0);
  for (int spin = 0; p.pending.load(std::memory_order_acquire) != 0 && spin < kSpinIterations; ++spin) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  if (p.pending.load(std::memory_order_acquire) != 0) {
    std::unique_lock<std::mutex> lock(p.mu);
    p.done_cv.wait(lock, [&] { return p.pending.load(std::memory_order_acquire) == 0; });
  }
  p.fn = nullptr;
  if (p.error) std::rethrow_exception(std::exchange(p.error, nullptr));
}

}  // namespace ds4
