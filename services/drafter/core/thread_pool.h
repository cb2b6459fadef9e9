// A fixed pool of worker threads running one parallel loop at a time; the caller takes part.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sssd {

class ThreadPool {
 public:
  // `num_threads` counts the caller: 1 means no worker threads at all.
  explicit ThreadPool(int32_t num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs body(i, worker) for every i in [0, n); worker in [0, num_threads) identifies the thread
  // (for per-thread scratch memory). Returns when all are done. One loop at a time: concurrent
  // callers queue on a mutex.
  void parallel_for(int32_t n, const std::function<void(int32_t, int32_t)>& body);

  int32_t num_threads() const { return static_cast<int32_t>(workers_.size()) + 1; }

 private:
  void worker_loop(int32_t worker);
  void drain(int32_t worker);

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  // Written under mutex_ before generation_ changes; workers read them after seeing the change.
  const std::function<void(int32_t, int32_t)>* body_ = nullptr;
  int32_t n_ = 0;
  std::atomic<int32_t> next_{0};
  int32_t finished_ = 0;  // workers done with the current loop
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

}  // namespace sssd
