// The serial work queue both communicator backends run their collectives on.
// Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_WORK_QUEUE_H_
#define DEEPNEX_COLLECTIVE_WORK_QUEUE_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "deepnex/collective/communicator.h"

namespace deepnex::collective {

class SerialQueue;

// A collective's completion: finished once, by whoever ran it. Wait()
// (unbounded) on a collective its queue has not started runs it, and those
// queued before it, on the waiting thread when the queue allows that;
// Wait(timeout) and Done() hand a lazy collective to the queue's thread.
class WorkImpl final : public Work {
 public:
  void Finish(absl::Status status);
  absl::Status Wait(std::chrono::milliseconds timeout) override;
  absl::Status Wait() override;
  bool Done() const override;

 private:
  friend class SerialQueue;
  struct Core;
  std::weak_ptr<Core> queue_;  // the queue it is on, for running it inline

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
};

// Runs a communicator's collectives one at a time, in the order they were
// enqueued: every rank must issue them in the same order, and the streams
// between ranks carry one at a time. A thread of its own runs them, or the
// thread that waits for one that has not started.
//
// A small collective costs a few microseconds, and waking a thread for it
// costs as much again (on a busy host, several times more), so a lazy one
// is left for its waiter: the queue's thread is not woken for it, and takes
// it only once it has waited `lazy_grace` (the thread polls while the queue
// has been busy in the last 100 ms and sleeps otherwise), or when Done() or
// Wait(timeout) asks. Enqueue may be called from any thread; a collective
// must therefore set up what it needs of its thread (a CUDA device) itself.
//
// Collectives of at most kLazyBytes are lazy in both backends. Waking the
// queue's thread for one costs a futex wake and a context switch on a core
// the peer ranks need: measured with 2 ranks on 2 cores, 20 us of a 42 us
// 256 KiB allreduce and 15 us of a 110 us 1 MiB one; on an H200, 15 of the
// 18 us of a one-GPU nccl allreduce (collective_gpu_test's sweep). Bigger
// ones start at once, for callers that overlap them with compute.
inline constexpr size_t kLazyBytes = 1 << 20;

class SerialQueue {
 public:
  explicit SerialQueue(std::chrono::microseconds lazy_grace = std::chrono::milliseconds(1));
  // Close().
  ~SerialQueue();
  SerialQueue(const SerialQueue&) = delete;
  SerialQueue& operator=(const SerialQueue&) = delete;

  // FailedPrecondition in a forked child (the queue's thread is not there)
  // and after Close.
  std::shared_ptr<Work> Enqueue(std::function<absl::Status()> fn, bool lazy = false);
  // Stops taking work; what is queued finishes with Aborted. Waits for the
  // running collective. Idempotent.
  void Close();

 private:
  using Core = WorkImpl::Core;
  friend class WorkImpl;
  // Runs queued collectives on this thread up to and including `work`,
  // while the queue's thread is not running one.
  static void RunUpTo(Core& core, WorkImpl* work);
  // Lets the queue's thread take `work` now.
  static void Hurry(Core& core, const WorkImpl* work);
  // Hurry with core.mu held; false when `work` is not queued.
  static bool HurryLocked(Core& core, const WorkImpl* work);
  static void Loop(Core& core);

  std::shared_ptr<Core> core_;
  std::thread thread_;
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_WORK_QUEUE_H_
