// The CPU thread pool: persistent workers, one job at a time, static chunk boundaries, each
// chunk preferably run by the same thread every time, any chunk run by whoever is free.
//
// A step issues a few hundred parallel_for calls, most of them small, on a machine that other
// processes share. The rules:
// - Chunk i of k is always [i*n/k, (i+1)*n/k) (which thread computes a row never changes its
//   value: every kernel computes each row independently).
// - Thread i (the caller is 0) first claims chunk i, so while all threads keep up, each one reads
//   the same rows of every weight matrix step after step (its share can stay in its own cache;
//   not measured apart from the rest).
// - Then it claims any chunk still unclaimed. Nobody waits for a thread that has not started: a
//   worker that wakes late, or that the OS descheduled, finds its chunk done by the others and
//   costs nothing; the caller waits only for chunks being computed. (A pool with a fixed chunk
//   per thread waits tens of milliseconds for a worker whose core another process holds.)
// - A worker that finished a job spins for the next one for kSpinTime, long enough to span the
//   serial stretches inside a step and the host's work between steps, then sleeps on a condition
//   variable: an idle engine leaves the other cores to the rest of the machine. Waking a sleeping
//   worker costs the caller 7-17 us (futex and scheduler latency in a VM), and a worker that
//   wakes late may claim a chunk just before the caller would have, so sleeping between the jobs
//   of a step made 2 threads slower than 1 (docs/performance.md).
// - While spinning, a worker yields its core every kYieldTime, so that if the OS has put it on
//   the caller's core (the other core being busy with another process) the caller runs.
// - A worker that finds itself on the caller's CPU when a job arrives moves off it (its affinity
//   becomes the allowed CPUs less the caller's). Measured on the 2-vCPU VM: the guest scheduler
//   now and then places the worker beside the thread that calls the pool and leaves it there
//   (both threads on one CPU for whole runs, the worker getting almost no time): a 1-lane decode
//   step of the tiny model took 0.166 ms against 0.100-0.106 with the threads apart, the "two
//   threads no faster than one" mode that earlier notes blamed on the host. Nothing is pinned
//   while the threads are apart, and a worker never leaves the CPUs the process may use.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <fstream>
#include <memory>
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
// How long a worker waits for the next job before it sleeps, and how often it yields meanwhile.
constexpr std::chrono::microseconds kSpinTime{500};
constexpr std::chrono::microseconds kYieldTime{50};
// The job word: generation << 10 | chunk count. The count travels with the generation, so a
// claim is checked against the job it belongs to in one atomic read.
constexpr int kCountBits = 10;
constexpr int kMaxChunks = (1 << kCountBits) - 1;
inline uint64_t job_gen(uint64_t j) { return j >> kCountBits; }
inline int job_chunks(uint64_t j) { return static_cast<int>(j & kMaxChunks); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
}  // namespace

struct ThreadPool::Impl {
  using Fn = std::function<void(int64_t, int64_t)>;
  int n_threads = 1;
  std::vector<std::thread> workers;

  std::mutex call_mu;  // one job at a time when several threads share the pool

  // The current job. fn and n are written by the caller before it publishes the job in `job`,
  // and read by workers after they load `job`. Atomics, because a late worker may read them
  // while the next job is being written (its claim then fails, and it discards what it read).
  // Cache lines: the job (fn, n, job) on one line that only the caller writes; each chunk's
  // owner word and the done counter each on their own line, so that the caller claiming chunk 0
  // does not take away the line the worker needs to claim chunk 1. Measured on the 2-vCPU VM
  // (1-lane decode steps of the tiny model, 38 pool calls a step): the caller's wait after its
  // own chunk is 0.1 us a call either way when the host places the two vCPUs close, and 0.2-0.5
  // us with separate lines against 0.6-0.7 us with shared ones when it does not.
  alignas(64) std::atomic<const Fn*> fn{nullptr};
  std::atomic<int64_t> n{0};
  std::atomic<uint64_t> job{0};  // see job_gen / job_chunks
  std::atomic<int> caller_cpu{-1};  // the CPU the caller ran on when it published the job
  cpu_set_t allowed;                // the creating thread's CPUs (set before the workers start)
  bool have_allowed = false;
  // owner[c]: the generation of the last job whose chunk c was claimed. A chunk of job g is free
  // while owner[c] < g; claiming is a CAS to g. Values only grow, so a claim cannot succeed for a
  // finished job: job g stays open, its fn and n unchanged, until all its chunks are claimed.
  struct alignas(64) Owner {
    std::atomic<uint64_t> gen{0};
  };
  std::unique_ptr<Owner[]> owner;
  alignas(64) std::atomic<int> done{0};  // chunks of the current job finished
  alignas(64) uint64_t generation = 0;   // caller side, under call_mu
  std::exception_ptr error;
  std::mutex error_mu;

  // Sleeping workers.
  std::mutex mu;
  std::condition_variable wake_cv;
  std::atomic<int> sleepers{0};
  bool stop = false;  // under mu

  void run_chunk(const Fn& f, int64_t total, int chunks, int i) {
    const int64_t b = total * i / chunks, e = total * (i + 1) / chunks;
    if (b < e) {
      t_in_pool_job = true;
      try {
        f(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
      t_in_pool_job = false;
    }
    done.fetch_add(1, std::memory_order_release);
  }

  bool try_claim(int c, uint64_t gen) {
    uint64_t seen = owner[c].gen.load(std::memory_order_relaxed);
    while (seen < gen)
      if (owner[c].gen.compare_exchange_weak(seen, gen, std::memory_order_acq_rel, std::memory_order_relaxed)) return true;
    return false;
  }

  // As thread `self`: run chunk self if still free, then every other free chunk of job j.
  void help(uint64_t j, int self) {
    const uint64_t gen = job_gen(j);
    const int chunks = job_chunks(j);
    const Fn* f = fn.load(std::memory_order_relaxed);
    const int64_t total = n.load(std::memory_order_relaxed);
    for (int k = 0; k < chunks; ++k) {
      const int c = (self + k) % chunks;
      if (try_claim(c, gen)) run_chunk(*f, total, chunks, c);
    }
  }

  // The anti-co-location rule above: if this worker runs on the caller's CPU and the process may
  // use another, restrict it to the others (the kernel migrates it at once). Costs a getcpu
  // (vDSO, tens of ns) a job; the affinity call only when the two have met.
  void step_off_caller_cpu() {
    const int cc = caller_cpu.load(std::memory_order_relaxed);
    if (cc < 0 || !have_allowed || sched_getcpu() != cc) return;
    cpu_set_t mask = allowed;  // the CPUs the pool's creator could use, less the caller's
    if (!CPU_ISSET(cc, &mask) || CPU_COUNT(&mask) < 2) return;
    CPU_CLR(cc, &mask);
    sched_setaffinity(0, sizeof(mask), &mask);
  }

  void worker(int self) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t j = job.load(std::memory_order_acquire);
      if (job_gen(j) == seen) {
        const auto start = std::chrono::steady_clock::now();
        auto last_yield = start;
        for (int spin = 1; job_gen(j) == seen; ++spin) {
          cpu_relax();
          j = job.load(std::memory_order_acquire);
          if (spin % 64 == 0) {  // read the clock now and then, not every pause
            const auto now = std::chrono::steady_clock::now();
            if (now - start > kSpinTime) break;
            if (now - last_yield > kYieldTime) {
              std::this_thread::yield();
              last_yield = now;
            }
          }
        }
      }
      if (job_gen(j) == seen) {
        std::unique_lock<std::mutex> lock(mu);
        // seq_cst pairs with the caller's store of job then load of sleepers: either the caller
        // sees this sleeper and notifies, or this check sees the new job.
        sleepers.fetch_add(1, std::memory_order_seq_cst);
        wake_cv.wait(lock, [&] { return stop || job_gen(job.load(std::memory_order_seq_cst)) != seen; });
        sleepers.fetch_sub(1, std::memory_order_relaxed);
        if (stop) return;
        j = job.load(std::memory_order_acquire);
      }
      seen = job_gen(j);
      step_off_caller_cpu();
      help(j, self);
    }
  }
};

ThreadPool::ThreadPool(int n_threads) : impl_(new Impl) {
  impl_->n_threads = n_threads > 0 ? n_threads : cpu::physical_cores();
  CPU_ZERO(&impl_->allowed);
  impl_->have_allowed = sched_getaffinity(0, sizeof(impl_->allowed), &impl_->allowed) == 0;
  impl_->owner.reset(new Impl::Owner[kMaxChunks]);
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
  const int chunks = static_cast<int>(std::min<int64_t>({want, impl_->n_threads, kMaxChunks}));
  if (chunks <= 1 || t_in_pool_job) {
    fn(0, n);
    return;
  }
  Impl& p = *impl_;
  std::lock_guard<std::mutex> call_lock(p.call_mu);
  p.fn.store(&fn, std::memory_order_relaxed);
  p.n.store(n, std::memory_order_relaxed);
  p.caller_cpu.store(sched_getcpu(), std::memory_order_relaxed);
  p.done.store(0, std::memory_order_relaxed);
  p.error = nullptr;
  const uint64_t j = (++p.generation << kCountBits) | static_cast<uint64_t>(chunks);
  p.job.store(j, std::memory_order_seq_cst);  // publishes the job
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(p.mu);  // a sleeper is either waiting or will see the job
    p.wake_cv.notify_all();
  }
  p.help(j, 0);
  // What is left is running on workers that claimed it: wait for those chunks only.
  for (int spin = 0; p.done.load(std::memory_order_acquire) != chunks; ++spin) {
    if (spin < 4096) {
      cpu_relax();
    } else {
      std::this_thread::yield();  // the worker may have lost its core to another process
    }
  }
  if (p.error) std::rethrow_exception(std::exchange(p.error, nullptr));
}

}  // namespace ds4
