#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace lily {
namespace {

thread_local bool t_in_worker = false;

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i + 1 < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return int(workers_.size()) + 1; }

  void run(int64_t n_tasks, const std::function<void(int64_t)>& task) {
    std::lock_guard<std::mutex> serial(run_mu_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lk(mu_);
      task_ = &task;
      n_tasks_ = n_tasks;
      next_.store(0);
      pending_ = n_tasks;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    t_in_worker = true;
    for (;;) {
      int64_t i = next_.fetch_add(1);
      if (i >= n_tasks_) break;
      try {
        (*task_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
    t_in_worker = false;
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (generation_ != seen && task_ != nullptr); });
        if (stop_) return;
        seen = generation_;
      }
      work();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int64_t pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool p(num_threads());
  return p;
}

}  // namespace

int num_threads() {
  static const int n = [] {
    if (const char* s = std::getenv("LILY_NUM_THREADS")) {
      int v = std::atoi(s);
      if (v > 0) return v;
    }
    return std::max(1, int(std::thread::hardware_concurrency()));
  }();
  return n;
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t chunks = std::min<int64_t>(int64_t(num_threads()) * 4, (n + grain - 1) / grain);
  if (chunks <= 1 || t_in_worker || num_threads() == 1) {
    fn(0, n);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
  pool().run(chunks, [&](int64_t c) {
    int64_t b = c * step, e = std::min(n, b + step);
    if (b < e) fn(b, e);
  });
}

}  // namespace lily
