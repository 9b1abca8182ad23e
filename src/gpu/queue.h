// The allocator's queue: requests that wait for capacity, in order of
// priority, then arrival (see "The queue" in deepnex/gpu/allocator.h), and
// the asynchronous waiters that left it with an outcome still to be
// answered. Private to libdeepnex.
#ifndef DEEPNEX_GPU_QUEUE_H_
#define DEEPNEX_GPU_QUEUE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/types.h"
#include "deepnex/status.h"
#include "gpu/allocator_state.h"
#include "gpu/placement.h"

namespace deepnex::gpu {

// One call of Allocate (blocking: on its caller's stack) or of
// AllocateGangAsync (asynchronous: owned by the queue, then by the resolved
// list, until answered).
struct Waiter {
  Request request;
  std::pair<int64_t, uint64_t> key;  // in the queue: -priority, arrival
  bool done = false;
  absl::Status status;
  std::vector<Allocation> result;
  uint64_t seq = 0;
  // An asynchronous waiter's answer, and its timeout (0: none) and deadline.
  Allocator::AllocateDone answer;
  std::chrono::milliseconds timeout{0};
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  // When it joined the queue (Pending reports how long it waited).
  std::chrono::steady_clock::time_point queued_at;
};

// Thread-compatible: the Allocator calls it under its mutex and owns the
// condition variables its waiters sleep on.
class RequestQueue {
 public:
  bool empty() const { return waiting_.empty(); }
  size_t size() const { return waiting_.size(); }
  // The first waiting request. REQUIRES: !empty().
  Waiter* head() const { return waiting_.begin()->second; }
  // How many waiting requests `r` of `priority` would queue behind.
  size_t Ahead(int priority) const;
  // How many of `user`'s requests wait.
  size_t Waiting(const std::string& user) const;
  // Whether the head has waited `after` or longer (and so reserves).
  bool HeadWaited(std::chrono::milliseconds after) const;

  // Queues `w` for `r` as of now, with `o`'s timeout.
  void Push(Waiter* w, const Request& r, const AllocateOptions& o);
  // Takes waiting `w` out; returns how many waited ahead of it.
  size_t Remove(const Waiter& w);
  // `w` left the queue with its outcome: a blocking waiter sees `done`; an
  // asynchronous one is kept for TakeResolved.
  void Resolve(Waiter* w);
  bool has_resolved() const { return !resolved_.empty(); }
  // The asynchronous waiters resolved so far, now the caller's to answer.
  std::vector<Waiter*> TakeResolved();

  // Offers the waiters, in order, to `grant`; those it grants or refuses
  // leave the queue (Resolve). `hold` sees the head if it stays. Returns
  // whether any left.
  bool Pump(const std::function<Outcome(Waiter*)>& grant,
            const std::function<void(const Waiter&)>& hold);
  // Every asynchronous waiter leaves with `why` (a blocking one leaves by
  // itself once it sees the allocator stop).
  void CancelAsync(const absl::Status& why);
  // Every waiter for which `why` is not OK leaves with it.
  void RefuseIf(const std::function<absl::Status(const Request&)>& why);
  // Asynchronous waiters past their deadline at `now` leave with
  // DeadlineExceeded; *next is the earliest deadline of those that stay.
  // Returns whether any left.
  bool ExpireAsync(std::chrono::steady_clock::time_point now,
                   std::chrono::steady_clock::time_point* next);
  // The asynchronous waiter with `ticket` leaves, Cancelled; false when it
  // waits no more.
  bool Withdraw(uint64_t ticket);

  // See Allocator::Pending: each waiter and why it waits.
  std::vector<PendingRequest> Pending(const std::string& user, const Placement& placement,
                                      std::chrono::milliseconds reservation_after) const;
  // DeadlineExceeded for `w`, with `ahead` requests ahead of it.
  static absl::Status TimedOut(const Waiter& w, size_t ahead);

 private:
  std::map<std::pair<int64_t, uint64_t>, Waiter*> waiting_;  // (-priority, order)
  uint64_t next_order_ = 1;  // also an asynchronous waiter's ticket
  std::vector<Waiter*> resolved_;  // asynchronous waiters to answer (owned)
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_QUEUE_H_
