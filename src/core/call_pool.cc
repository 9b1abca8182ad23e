#include "core/call_pool.h"

#include <thread>
#include <utility>

namespace deepnex {

bool CallPool::Run(std::function<void()> call) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return false;
  ++calls_;
  work_.push_back(std::move(call));
  // One call may wait on another: an idle thread if there are enough for
  // every queued call, else a new one.
  if (waiting_ >= work_.size()) {
    work_cv_.notify_one();
  } else {
    ++workers_;
    std::thread([this] { Work(); }).detach();
  }
  return true;
}

void CallPool::Shutdown() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  cv_.wait(lock, [this] { return calls_ == 0; });
  work_cv_.notify_all();
  cv_.wait(lock, [this] { return workers_ == 0; });
}

void CallPool::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    ++waiting_;
    const bool has_work =
        work_cv_.wait_for(lock, idle_, [this] { return !work_.empty() || stopping_; });
    --waiting_;
    if (!has_work || work_.empty()) break;
    std::function<void()> call = std::move(work_.front());
    work_.pop_front();
    lock.unlock();
    call();
    call = nullptr;  // what it holds goes before the call counts as done
    lock.lock();
    --calls_;
    cv_.notify_all();
  }
  --workers_;
  cv_.notify_all();
}

}  // namespace deepnex
