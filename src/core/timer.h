// Runs callbacks at chosen times on one thread of its own: retry backoff in
// clients, deadlines of waiting calls in servers. Private to libdeepnex.
#ifndef DEEPNEX_CORE_TIMER_H_
#define DEEPNEX_CORE_TIMER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

namespace deepnex {

// Thread-safe. Callbacks run one at a time, in time order, on the timer's
// thread; those still queued when the timer is destroyed are dropped.
class Timer {
 public:
  using Clock = std::chrono::steady_clock;

  Timer() : thread_([this] { Run(); }) {}
  ~Timer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void At(Clock::time_point when, std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push({when, seq_++, std::move(fn)});
    cv_.notify_all();
  }
  void After(std::chrono::milliseconds delay, std::function<void()> fn) {
    At(Clock::now() + delay, std::move(fn));
  }

 private:
  struct Item {
    Clock::time_point when;
    uint64_t seq;  // equal times run in the order they were added
    std::function<void()> fn;
    bool operator>(const Item& o) const {
      return when != o.when ? when > o.when : seq > o.seq;
    }
  };

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (queue_.empty()) {
        cv_.wait(lock);
      } else if (Clock::now() < queue_.top().when) {
        cv_.wait_until(lock, queue_.top().when);
      } else {
        auto fn = queue_.top().fn;
        queue_.pop();
        lock.unlock();
        fn();
        lock.lock();
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> queue_;
  uint64_t seq_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: it uses the members above
};

}  // namespace deepnex

#endif  // DEEPNEX_CORE_TIMER_H_
