// Threading of the CPU handler: how many threads a call is worth, and a
// parallel loop over work units (or merge rows) on XLA's intra-op pool, or on
// threads of our own when the runtime gives no pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_mla {
namespace cpu {

namespace ffi = xla::ffi;

// Below this many multiply-adds per thread, starting a thread costs more than
// it saves.
constexpr int64_t kMinMacsPerThread = int64_t{1} << 19;
constexpr int kMaxThreads = 64;

inline int MaxThreads() {
  if (const char* env = std::getenv("JAX_MLA_CPU_THREADS")) {
    const int n = std::atoi(env);
    if (n >= 1) return std::min(n, kMaxThreads);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return std::clamp<int>(hw == 0 ? 1 : static_cast<int>(hw), 1, kMaxThreads);
}

inline int ThreadsFor(int64_t tasks, int64_t macs, int available) {
  const int64_t by_work = std::max<int64_t>(1, macs / kMinMacsPerThread);
  return static_cast<int>(
      std::max<int64_t>(1, std::min({int64_t{MaxThreads()}, int64_t{available}, tasks, by_work})));
}

// Threads to use: XLA's intra-op pool when the runtime gives us one (no thread
// creation per call, and XLA's own threading settings apply), else our own.
inline int AvailableThreads(ffi::ThreadPool& pool) {
  const int64_t n = pool.num_threads();
  return n > 0 ? static_cast<int>(std::min<int64_t>(n, kMaxThreads)) : MaxThreads();
}

// State shared with helper tasks. A helper that starts after the caller has
// finished (the pool was busy) finds `closed` set and leaves without touching
// the caller's stack; the caller waits only for helpers that got in before.
struct ForState {
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
  int next_tid = 1;
  bool closed = false;
};

// Runs body(task, thread) for task in [0, tasks) on up to `threads` threads,
// the caller included. Tasks are handed out one at a time in order: the planner
// sorts units longest first, so the stragglers are short. Helpers that never get
// to run (busy pool, thread start failure) simply leave their share to others, so
// this cannot deadlock even when the caller is itself a pool thread.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t tasks, int threads, const Body& body) {
  auto st = std::make_shared<ForState>();
  auto drain = [&body, tasks](ForState& s, int tid) {
    for (int64_t t = s.next.fetch_add(1); t < tasks; t = s.next.fetch_add(1)) body(t, tid);
  };
  auto helper = [st, &drain, threads]() {
    int tid;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      if (st->closed || st->next_tid >= threads) return;
      tid = st->next_tid++;
      ++st->running;
    }
    drain(*st, tid);
    std::lock_guard<std::mutex> lock(st->mu);
    if (--st->running == 0) st->cv.notify_all();
  };
  std::vector<std::thread> own;
  const bool use_pool = pool.num_threads() > 0;
  for (int i = 1; i < threads; ++i) {
    if (use_pool) {
      auto task = helper;  // Schedule takes ownership of a copy
      pool.Schedule(std::move(task));
    } else {
      try {
        own.emplace_back(helper);
      } catch (const std::exception&) {
        break;
      }
    }
  }
  drain(*st, 0);
  {
    std::unique_lock<std::mutex> lock(st->mu);
    st->closed = true;
    st->cv.wait(lock, [&] { return st->running == 0; });
  }
  for (std::thread& t : own) t.join();
}

}  // namespace cpu
}  // namespace jax_mla
