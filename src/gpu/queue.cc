#include "gpu/queue.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace deepnex::gpu {

size_t RequestQueue::Ahead(int priority) const {
  size_t ahead = 0;
  for (const auto& [key, queued] : waiting_) ahead += queued->request.priority >= priority;
  return ahead;
}

bool RequestQueue::HeadWaited(std::chrono::milliseconds after) const {
  if (waiting_.empty()) return false;
  const auto waited = std::chrono::steady_clock::now() - waiting_.begin()->second->queued_at;
  return waited >= after;
}

void RequestQueue::Push(Waiter* w, const Request& r, const AllocateOptions& o) {
  w->request = r;
  w->key = {-static_cast<int64_t>(r.priority), next_order_++};
  w->timeout = o.timeout;
  w->queued_at = std::chrono::steady_clock::now();
  if (o.timeout.count() > 0) w->deadline = w->queued_at + o.timeout;
  waiting_.emplace(w->key, w);
}

size_t RequestQueue::Waiting(const std::string& user) const {
  return std::count_if(waiting_.begin(), waiting_.end(),
                       [&](const auto& kv) { return kv.second->request.user == user; });
}

size_t RequestQueue::Remove(const Waiter& w) {
  size_t ahead = std::distance(waiting_.begin(), waiting_.find(w.key));
  waiting_.erase(w.key);
  return ahead;
}

void RequestQueue::Resolve(Waiter* w) {
  w->done = true;
  if (w->answer) resolved_.push_back(w);
}

std::vector<Waiter*> RequestQueue::TakeResolved() {
  std::vector<Waiter*> out;
  out.swap(resolved_);
  return out;
}

bool RequestQueue::Pump(const std::function<Outcome(Waiter*)>& grant,
                        const std::function<void(const Waiter&)>& hold) {
  bool any = false;
  bool head = true;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiter* w = it->second;
    if (grant(w) == Outcome::kBusy) {
      if (head) hold(*w);
      head = false;
      ++it;
      continue;
    }
    it = waiting_.erase(it);
    Resolve(w);
    any = true;
  }
  return any;
}

void RequestQueue::CancelAsync(const absl::Status& why) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiter* w = it->second;
    if (!w->answer) {  // a blocking waiter leaves by itself
      ++it;
      continue;
    }
    it = waiting_.erase(it);
    w->status = why;
    Resolve(w);
  }
}

void RequestQueue::RefuseIf(const std::function<absl::Status(const Request&)>& why) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    absl::Status s = why(it->second->request);
    if (!s.ok()) {
      it->second->status = s;
      Resolve(it->second);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
}

bool RequestQueue::ExpireAsync(std::chrono::steady_clock::time_point now,
                               std::chrono::steady_clock::time_point* next) {
  bool timed_out = false;
  size_t ahead = 0;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Waiter* w = it->second;
    if (w->answer && w->deadline <= now) {
      it = waiting_.erase(it);
      w->status = TimedOut(*w, ahead);
      Resolve(w);
      timed_out = true;
      continue;
    }
    if (w->answer) *next = std::min(*next, w->deadline);
    ++ahead;
    ++it;
  }
  return timed_out;
}

bool RequestQueue::Withdraw(uint64_t ticket) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    Waiter* w = it->second;
    if (it->first.second != ticket || !w->answer) continue;
    waiting_.erase(it);
    w->status = absl::CancelledError("the request was withdrawn from the queue");
    Resolve(w);
    return true;
  }
  return false;
}

std::vector<PendingRequest> RequestQueue::Pending(
    const std::string& user, const Placement& placement,
    std::chrono::milliseconds reservation_after) const {
  std::vector<PendingRequest> out;
  const auto now = std::chrono::steady_clock::now();
  size_t position = 0;
  for (const auto& [key, w] : waiting_) {
    ++position;
    if (!user.empty() && w->request.user != user) continue;
    PendingRequest p;
    p.position = position;
    p.id = absl::StrCat("q", key.second);
    p.request = w->request;
    p.waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - w->queued_at);
    const size_t ahead = position - 1;
    std::string behind =
        ahead == 0 ? "" : absl::StrCat("behind ", ahead, ahead == 1 ? " request" : " requests");
    std::string short_of = placement.Shortage(w->request);
    if (short_of.empty()) {
      // The head fits only between a change and the Pump that follows it;
      // a later request that fits is held back only by the head's reservation.
      if (behind.empty()) {
        p.reason = "being granted";
      } else if (HeadWaited(reservation_after)) {
        p.reason = absl::StrCat("held back: the capacity it fits in is reserved for q",
                                waiting_.begin()->first.second,
                                ", which has waited longer than reservation_after; ", behind);
      } else {
        p.reason = behind;
      }
    } else {
      p.reason = behind.empty() ? short_of : absl::StrCat(short_of, "; ", behind);
    }
    out.push_back(std::move(p));
  }
  return out;
}

absl::Status RequestQueue::TimedOut(const Waiter& w, size_t ahead) {
  return absl::DeadlineExceededError(absl::StrCat(
      "timeout: waited ", w.timeout.count(), "ms in the queue (", Describe(w.request), "; ",
      ahead, " request(s) ahead of it) without free capacity"));
}

}  // namespace deepnex::gpu
