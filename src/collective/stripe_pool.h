// The helper threads that drive a cpu communicator's extra stripes. Private
// to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_STRIPE_POOL_H_
#define DEEPNEX_COLLECTIVE_STRIPE_POOL_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "deepnex/status.h"

namespace deepnex::collective {

// Runs jobs on helper threads, one per extra stripe; job 0 runs on the caller.
// Run is called from one thread at a time.
class StripePool {
 public:
  explicit StripePool(int helpers) {
    slots_.resize(helpers);
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { Loop(i); });
  }
  ~StripePool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  std::vector<absl::Status> Run(const std::vector<std::function<absl::Status()>>& jobs) {
    std::vector<absl::Status> results(jobs.size());
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_ = static_cast<int>(jobs.size()) - 1;
      for (size_t i = 1; i < jobs.size(); ++i) {
        slots_[i - 1] = [&, i] { results[i] = jobs[i](); };
      }
    }
    cv_.notify_all();
    if (!jobs.empty()) results[0] = jobs[0]();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
    return results;
  }

 private:
  void Loop(int i) {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || slots_[i] != nullptr; });
      if (stop_) return;
      auto job = std::move(slots_[i]);
      slots_[i] = nullptr;
      lock.unlock();
      job();
      lock.lock();
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::function<void()>> slots_;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_STRIPE_POOL_H_
