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

// One parallel region: its tasks, the next unclaimed index, and how many tasks are done and threads still inside.
// It lives on the stack of Pool::run, which returns only when every task is done and no worker still holds it.
struct Job {
  const std::function<void(int64_t)>* task;
  int64_t n;
  std::atomic<int64_t> next{0};
  int64_t done = 0;  // guarded by Pool::mu_
  int users = 0;     // workers inside execute(); guarded by Pool::mu_
  std::exception_ptr error;
};

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

  void run(int64_t n_tasks, const std::function<void(int64_t)>& task) {
    std::lock_guard<std::mutex> serial(run_mu_);  // one parallel region at a time
    Job job;
    job.task = &task;
    job.n = n_tasks;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &job;
      ++generation_;
    }
    cv_.notify_all();
    t_in_worker = true;  // nested parallel_for calls from the tasks run inline
    execute(job);
    t_in_worker = false;
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return job.done == job.n && job.users == 0; });
    job_ = nullptr;
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  void execute(Job& job) {
    for (;;) {
      const int64_t i = job.next.fetch_add(1);
      if (i >= job.n) return;
      std::exception_ptr err;
      try {
        (*job.task)(i);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu_);
      if (err && !job.error) job.error = err;
      if (++job.done == job.n) done_cv_.notify_all();
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      Job* job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (job_ != nullptr && generation_ != seen); });
        if (stop_) return;
        seen = generation_;
        job = job_;
        ++job->users;
      }
      t_in_worker = true;
      execute(*job);
      t_in_worker = false;
      std::lock_guard<std::mutex> lk(mu_);
      if (--job->users == 0 && job->done == job->n) done_cv_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  Job* job_ = nullptr;
  uint64_t generation_ = 0;
  bool stop_ = false;
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
