// Threads for calls that may block (a gRPC handler waiting on an agent's
// answer, which another gRPC thread reads): each call taken gets a thread of
// its own at once, so none waits behind a blocking one. Private to
// libdeepnex.
//
// Threads stay for the next call up to `idle`: on a busy host a woken
// thread runs soon, a new one starts behind every runnable task (1.7 ms of
// a 17 ms container start through deepnex-central on two loaded cores).
#ifndef DEEPNEX_CORE_CALL_POOL_H_
#define DEEPNEX_CORE_CALL_POOL_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>

namespace deepnex {

// Thread-safe.
class CallPool {
 public:
  explicit CallPool(std::chrono::milliseconds idle) : idle_(idle) {}
  ~CallPool() { Shutdown(); }
  CallPool(const CallPool&) = delete;
  CallPool& operator=(const CallPool&) = delete;

  // Runs `call` on a thread of the pool; false (not run) once Shutdown began.
  bool Run(std::function<void()> call);
  // Waits until every call taken has returned and every thread has ended.
  // Idempotent.
  void Shutdown();

 private:
  void Work();

  const std::chrono::milliseconds idle_;
  std::mutex mu_;
  std::condition_variable cv_;       // calls_ or workers_ fell
  std::condition_variable work_cv_;  // work_ grew, or stopping_
  std::deque<std::function<void()>> work_;
  int calls_ = 0;    // taken and not yet returned
  int workers_ = 0;  // threads (detached; Shutdown waits for them)
  size_t waiting_ = 0;
  bool stopping_ = false;
};

}  // namespace deepnex

#endif  // DEEPNEX_CORE_CALL_POOL_H_
