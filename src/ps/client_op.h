// An operation of the parameter-server client: the requests it is made of
// are in flight, and it is done when the last one is. Private to
// ps/client.cc.
#ifndef DEEPNEX_PS_CLIENT_OP_H_
#define DEEPNEX_PS_CLIENT_OP_H_

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "deepnex/ps/client.h"
#include "deepnex/units.h"

namespace deepnex::ps {

// An operation made of requests in flight; done when the last one is.
class Op final : public PendingOp {
 public:
  explicit Op(int outstanding) : outstanding_(outstanding) {
    if (outstanding == 0) finishing_ = done_ = true;
  }
  // Adds requests to an op that is still held open by another.
  void Add(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_ += n;
  }
  // The continuations run before waiters wake, so that what they change
  // (e.g. the client's registration) is in place when Wait() returns.
  void RequestDone(const absl::Status& status) {
    std::vector<std::function<void(const absl::Status&)>> then;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The first error wins, except over a cancellation it caused.
      if (!status.ok() && (status_.ok() || absl::IsCancelled(status_))) status_ = status;
      if (--outstanding_ > 0) return;
      finishing_ = true;
      then.swap(then_);
    }
    for (auto& fn : then) fn(status_);
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }
  // Runs `fn` with the final status once the requests are done (at once if
  // they are).
  void Then(std::function<void(const absl::Status&)> fn) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!finishing_) {
      then_.push_back(std::move(fn));
      return;
    }
    lock.unlock();
    fn(status_);
  }
  absl::Status Wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, CappedWait(timeout), [this] { return done_; })) {
      return absl::DeadlineExceededError(absl::StrCat(
          "operation still running after ", timeout.count(), " ms"));
    }
    return status_;
  }
  absl::Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return status_;
  }
  bool Done() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int outstanding_;
  bool finishing_ = false;  // the last request is done; continuations run
  bool done_ = false;
  absl::Status status_;
  std::vector<std::function<void(const absl::Status&)>> then_;
};

inline std::shared_ptr<Op> FailedOp(const absl::Status& status) {
  auto op = std::make_shared<Op>(1);
  op->RequestDone(status);
  return op;
}

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_CLIENT_OP_H_
