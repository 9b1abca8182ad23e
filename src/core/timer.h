// Runs callbacks at chosen times on one thread of its own: retry backoff in
// clients, deadlines of waiting calls in servers. Private to libdeepnex.
#ifndef DEEPNEX_CORE_TIMER_H_
#define DEEPNEX_CORE_TIMER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

#include "core/grpc_util.h"

namespace deepnex {

// Thread-safe. Callbacks run one at a time, in time order, on the timer's
// thread; those still queued when the timer is destroyed are dropped.
class Timer {
 public:
  using Clock = std::chrono::steady_clock;

  Timer() : state_(std::make_shared<State>()), thread_([s = state_] { Run(*s); }) {}
  ~Timer() {
    if (InForkedChild()) {
      // The thread was not forked; its reference keeps the state, whose
      // condition variable it waited on: destroying that would wait for ever.
      thread_.detach();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->stop = true;
    }
    state_->cv.notify_all();
    thread_.join();
  }

  void At(Clock::time_point when, std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push({when, state_->seq++, std::move(fn)});
    state_->cv.notify_all();
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
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::priority_queue<Item, std::vector<Item>, std::greater<Item>> queue;
    uint64_t seq = 0;
    bool stop = false;
  };

  static void Run(State& s) {
    std::unique_lock<std::mutex> lock(s.mu);
    while (!s.stop) {
      if (s.queue.empty()) {
        s.cv.wait(lock);
      } else if (Clock::now() < s.queue.top().when) {
        s.cv.wait_until(lock, s.queue.top().when);
      } else {
        auto fn = s.queue.top().fn;
        s.queue.pop();
        lock.unlock();
        fn();
        lock.lock();
      }
    }
  }

  std::shared_ptr<State> state_;
  std::thread thread_;  // last: it uses state_
};

}  // namespace deepnex

#endif  // DEEPNEX_CORE_TIMER_H_
