#include "collective/work_queue.h"

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"

namespace deepnex::collective {

void WorkImpl::Finish(absl::Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  status_ = std::move(status);
  done_ = true;
  cv_.notify_all();
}

absl::Status WorkImpl::Wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [this] { return done_; })) {
    return absl::DeadlineExceededError(
        absl::StrCat("collective still running after ", timeout.count(), " ms"));
  }
  return status_;
}

absl::Status WorkImpl::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  return status_;
}

bool WorkImpl::Done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

SerialQueue::SerialQueue(std::function<void()> on_thread_start) {
  thread_ = std::thread([this, start = std::move(on_thread_start)] {
    if (start) start();
    Loop();
  });
}

SerialQueue::~SerialQueue() { Close(); }

void SerialQueue::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Work> SerialQueue::Enqueue(std::function<absl::Status()> fn) {
  auto work = std::make_shared<WorkImpl>();
  // In a forked child the thread that runs the queue is gone.
  if (absl::Status s = CheckForkSafe("communicator"); !s.ok()) {
    work->Finish(s);
    return work;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) {
      work->Finish(absl::FailedPreconditionError("the communicator is closed"));
      return work;
    }
    queue_.push_back({std::move(fn), work});
  }
  cv_.notify_all();
  return work;
}

void SerialQueue::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return closing_ || !queue_.empty(); });
    if (queue_.empty()) return;
    Item item = std::move(queue_.front());
    queue_.pop_front();
    const bool closing = closing_;
    lock.unlock();
    item.work->Finish(closing ? absl::AbortedError("the communicator was destroyed")
                              : item.fn());
    lock.lock();
  }
}

}  // namespace deepnex::collective
