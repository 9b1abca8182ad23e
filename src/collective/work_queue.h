// The serial work queue both communicator backends run their collectives on.
// Private to libdeepnex.
#ifndef DEEPNEX_COLLECTIVE_WORK_QUEUE_H_
#define DEEPNEX_COLLECTIVE_WORK_QUEUE_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "deepnex/collective/communicator.h"

namespace deepnex::collective {

// A collective's completion: finished once, by whoever ran it.
class WorkImpl final : public Work {
 public:
  void Finish(absl::Status status);
  absl::Status Wait(std::chrono::milliseconds timeout) override;
  absl::Status Wait() override;
  bool Done() const override;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
};

// Runs a communicator's collectives one at a time, in the order they were
// enqueued, on a thread of its own: every rank must issue them in the same
// order, and the streams between ranks carry one at a time. Enqueue may be
// called from any thread.
class SerialQueue {
 public:
  // `on_thread_start` runs first on the queue's thread (e.g. to select a
  // CUDA device); may be empty.
  explicit SerialQueue(std::function<void()> on_thread_start = nullptr);
  // Finishes what is still queued with Aborted and joins the thread.
  ~SerialQueue();
  SerialQueue(const SerialQueue&) = delete;
  SerialQueue& operator=(const SerialQueue&) = delete;

  // FailedPrecondition in a forked child (the queue's thread is not there)
  // and after Close.
  std::shared_ptr<Work> Enqueue(std::function<absl::Status()> fn);
  // Stops taking work; what is queued finishes with Aborted. Waits for the
  // running item. Idempotent.
  void Close();

 private:
  void Loop();

  struct Item {
    std::function<absl::Status()> fn;
    std::shared_ptr<WorkImpl> work;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool closing_ = false;
  std::thread thread_;
};

}  // namespace deepnex::collective

#endif  // DEEPNEX_COLLECTIVE_WORK_QUEUE_H_
