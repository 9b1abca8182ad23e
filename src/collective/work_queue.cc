#include "collective/work_queue.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/units.h"

namespace deepnex::collective {

namespace {
using Clock = std::chrono::steady_clock;
// The queue's thread polls for lazy collectives while the queue was busy
// this recently, and sleeps until woken otherwise.
constexpr auto kBusyWindow = std::chrono::milliseconds(100);
}  // namespace

struct WorkImpl::Core {
  struct Item {
    std::function<absl::Status()> fn;
    std::shared_ptr<WorkImpl> work;
    bool lazy = false;
    Clock::time_point queued;
  };
  std::chrono::microseconds lazy_grace{0};
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> items;
  bool running = false;   // a thread is running a collective
  bool closing = false;
  bool sleeping = false;  // the queue's thread waits to be woken (no polling)
  Clock::time_point last_busy;
};

void WorkImpl::Finish(absl::Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  status_ = std::move(status);
  done_ = true;
  cv_.notify_all();
}

// Bounded waits leave the collective to the queue's thread: run here, it
// could outlast `timeout`.
absl::Status WorkImpl::Wait(std::chrono::milliseconds timeout) {
  if (auto core = queue_.lock()) SerialQueue::Hurry(*core, this);
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, CappedWait(timeout), [this] { return done_; })) {
    return absl::DeadlineExceededError(
        absl::StrCat("collective still running after ", timeout.count(), " ms"));
  }
  return status_;
}

absl::Status WorkImpl::Wait() {
  if (auto core = queue_.lock()) SerialQueue::RunUpTo(*core, this);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  return status_;
}

bool WorkImpl::Done() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return true;
  }
  if (auto core = queue_.lock()) SerialQueue::Hurry(*core, this);
  return false;
}

SerialQueue::SerialQueue(std::chrono::microseconds lazy_grace)
    : core_(std::make_shared<Core>()) {
  core_->lazy_grace = lazy_grace;
  thread_ = std::thread([core = core_] { Loop(*core); });
}

SerialQueue::~SerialQueue() { Close(); }

void SerialQueue::Close() {
  if (InForkedChild()) {  // its thread was not forked: nothing runs or waits
    if (thread_.joinable()) thread_.detach();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->closing = true;
  }
  core_->cv.notify_all();
  if (thread_.joinable()) thread_.join();
  // A waiting thread may still be running a collective on the communicator.
  std::unique_lock<std::mutex> lock(core_->mu);
  core_->cv.wait(lock, [this] { return !core_->running; });
}

std::shared_ptr<Work> SerialQueue::Enqueue(std::function<absl::Status()> fn, bool lazy) {
  auto work = std::make_shared<WorkImpl>();
  // In a forked child the thread that runs the queue is gone.
  if (absl::Status s = CheckForkSafe("communicator"); !s.ok()) {
    work->Finish(s);
    return work;
  }
  work->queue_ = core_;
  bool wake;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->closing) {
      work->Finish(absl::FailedPreconditionError("the communicator is closed"));
      return work;
    }
    const auto now = Clock::now();
    core_->items.push_back({std::move(fn), work, lazy, now});
    core_->last_busy = now;
    // A lazy collective nobody waits for must still make progress: a
    // sleeping thread would not find it.
    wake = !lazy || core_->sleeping;
  }
  if (wake) core_->cv.notify_all();
  return work;
}

void SerialQueue::RunUpTo(Core& core, WorkImpl* work) {
  std::unique_lock<std::mutex> lock(core.mu);
  while (!core.closing && !core.running &&
         std::any_of(core.items.begin(), core.items.end(),
                     [work](const Core::Item& item) { return item.work.get() == work; })) {
    Core::Item item = std::move(core.items.front());
    core.items.pop_front();
    core.running = true;
    lock.unlock();
    item.work->Finish(item.fn());
    lock.lock();
    core.running = false;
  }
  core.last_busy = Clock::now();
  // Another thread is running a collective: this waiter cannot run `work`
  // and blocks, so the queue's thread takes it when that one ends.
  if (core.running) HurryLocked(core, work);
  // The queue's thread or Close may be waiting for `running` to clear.
  if (!core.items.empty() || core.closing) core.cv.notify_all();
}

void SerialQueue::Hurry(Core& core, const WorkImpl* work) {
  bool found;
  {
    std::lock_guard<std::mutex> lock(core.mu);
    found = HurryLocked(core, work);
  }
  if (found) core.cv.notify_all();
}

bool SerialQueue::HurryLocked(Core& core, const WorkImpl* work) {
  // The thread takes them in order: those ahead of `work` must not wait
  // for waiters either.
  for (Core::Item& item : core.items) {
    item.lazy = false;
    if (item.work.get() == work) return true;
  }
  return false;
}

void SerialQueue::Loop(Core& core) {
  std::unique_lock<std::mutex> lock(core.mu);
  while (true) {
    const auto now = Clock::now();
    if (!core.running && core.items.empty() && core.closing) return;
    // Collectives run in order: a young lazy one at the front holds back
    // the ones behind it, which its waiter runs too.
    if (!core.running && !core.items.empty() &&
        (core.closing || !core.items.front().lazy ||
         now - core.items.front().queued >= core.lazy_grace)) {
      Core::Item item = std::move(core.items.front());
      core.items.pop_front();
      const bool closing = core.closing;
      core.running = true;
      lock.unlock();
      item.work->Finish(closing ? absl::AbortedError("the communicator was destroyed")
                                : item.fn());
      lock.lock();
      core.running = false;
      core.last_busy = Clock::now();
      core.cv.notify_all();
      continue;
    }
    if (!core.items.empty() || now - core.last_busy < kBusyWindow) {
      core.cv.wait_for(lock, core.lazy_grace);
    } else {
      core.sleeping = true;
      core.cv.wait(lock);
      core.sleeping = false;
    }
  }
}

}  // namespace deepnex::collective
