#include "thread_pool.h"

namespace sssd {

ThreadPool::ThreadPool(int32_t num_threads) {
  for (int32_t w = 1; w < num_threads; ++w) workers_.emplace_back([this, w] { worker_loop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::drain(int32_t worker) {
  for (int32_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*body_)(i, worker);
}

void ThreadPool::worker_loop(int32_t worker) {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    drain(worker);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++finished_;
    }
    done_.notify_all();
  }
}

void ThreadPool::parallel_for(int32_t n, const std::function<void(int32_t, int32_t)>& body) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int32_t i = 0; i < n; ++i) body(i, 0);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    body_ = &body;
    n_ = n;
    next_.store(0);
    finished_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  drain(0);
  // Every worker takes part in every loop (possibly finding no work left), so once all have
  // reported, none can still touch this loop's state when the next one is set up.
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return finished_ == static_cast<int32_t>(workers_.size()); });
}

}  // namespace sssd
