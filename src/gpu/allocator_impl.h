// Allocator::Impl, the allocator behind the public Allocator: its lock, its
// ledger and its threads around AllocatorState (what the ledger records),
// RequestQueue (who waits) and Placement (where things fit). Each public
// method (allocator.cc) forwards to Impl, which takes the lock, changes the
// state, logs the change and waits for it to be durable without the lock.
// Private to libdeepnex: its methods are in allocator_impl.cc, and the
// comment on each declaration below says which lock it needs.
//
// With a ledger there are two states. `state_` decides: a change is made
// there at once, so that what is in flight holds its capacity and nothing
// is booked twice. `durable_` is what every view reads (allocations, nodes,
// usage, hence metrics): each record is applied to it only once it is on
// disk, in log order, by the same Apply that replays a restart. A failed
// write therefore never shows: `durable_` never saw it, and `state_` is
// rebuilt from the durable log (RollBack).
#ifndef DEEPNEX_GPU_ALLOCATOR_IMPL_H_
#define DEEPNEX_GPU_ALLOCATOR_IMPL_H_

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "deepnex/units.h"
#include "gpu/allocator_records.h"
#include "gpu/allocator_state.h"
#include "gpu/codec.h"
#include "gpu/ledger.h"
#include "gpu/placement.h"
#include "gpu/queue.h"

namespace deepnex::gpu {

// Thread-safe: mu_ guards the state, the queue and the flags declared after
// it; the ledger and the reaper thread are set up by Open and torn down by
// the destructor.
class Allocator::Impl {
 public:
  explicit Impl(const AllocatorOptions& options) : options_(options) {}

  // Also what Allocator::GetNode answers.
  static absl::Status NoNode(const std::string& name);

  absl::Status Open();

  ~Impl();

  void Shutdown();

  // ---- nodes

  absl::Status AddNode(Node spec);

  absl::Status RemoveNode(const std::string& name);

  absl::Status SetNodeMode(const std::string& name, Mode mode, ModeSwitch when);

  // In memory only: readiness is what central sees of the node's agent now.
  absl::Status SetReady(const std::string& name, bool ready);

  // `keep_draining`: the node's draining flag stays as it is.
  absl::Status SetFlags(const std::string& name, bool cordoned, bool draining, bool release,
                        bool keep_draining = false);

  // ---- quotas

  absl::StatusOr<std::string> SetQuota(const std::string& user, const Quota& quota);

  absl::StatusOr<std::string> SetDefaultQuota(const Quota& quota);

  absl::Status ClearQuota(const std::string& user);

  // ---- allocations

  absl::StatusOr<std::vector<Allocation>> Allocate(const Request& r, const AllocateOptions& o);

  uint64_t AllocateAsync(const Request& r, const AllocateOptions& o,
                         Allocator::AllocateDone done);

  bool Withdraw(uint64_t ticket);

  absl::Status Release(const std::string& id, const Allocator::Permit& permit);

  void ReleaseAsync(const std::string& id, Allocator::Done done,
                    const Allocator::Permit& permit);

  absl::StatusOr<Allocation> Renew(const std::string& id, const Allocator::Permit& permit);

  // ---- views: each under mu_, of what is durable

  template <typename F>
  auto Locked(F f) const {
    std::lock_guard<std::mutex> lock(mu_);
    return f(view());
  }

  absl::Status CheckInvariants() const;

  std::vector<PendingRequest> Pending(const std::string& user) const;

  size_t QueueLength() const;

  // ---- persistence

  absl::Status Compact();

  uint64_t LedgerRecords() const;

  const LedgerRecovery& recovery() const { return recovery_; }  // set once, by Open

 private:
  enum class Admission { kGranted, kRefused, kQueued };

  Placement& placement() { return state_.placement(); }
  const Placement& placement() const { return state_.placement(); }
  // What views read: without a ledger every change is final at once.
  const AllocatorState& view() const { return ledger_ ? durable_ : state_; }

  // ---- logging

  // Appends under mu_, after making the change in state_; returns the
  // ledger ticket to make durable before acknowledging (0 in memory). The
  // views see the change once that write is done (ApplyDurableLocked); if
  // it fails, RollBack drops it from state_ before anyone is told.
  uint64_t LogLocked(const std::string& record);
  // Under mu_: the ticket of the last change not yet known durable (0: none).
  // A call that changes nothing because state_ already holds what it asks
  // (a second release of an id, a quota set again) waits for it before it
  // answers OK: state_ runs ahead of the disk, and a crash before that
  // write lost the change the OK vouched for (a probe's released
  // allocations came back after a kill -9, 16 times in 21 races).
  uint64_t PendingLocked() const;
  // Unlocks and returns Durable(PendingLocked()): such a call's answer.
  absl::Status AfterPending(std::unique_lock<std::mutex>& lock);

  // Under mu_: applies to durable_, in log order, every record now on disk.
  void ApplyDurableLocked();

  // Waits until ticket `seq` is durable and the views show it; if its write
  // failed, state_ is rolled back to the durable state before the error
  // returns.
  absl::Status Durable(uint64_t seq);

  // The asynchronous Durable: `done` hears once the views show the change,
  // or once the rollback is done.
  void WhenDurable(uint64_t seq, Allocator::Done done);

  // After a failed ledger write (takes mu_): rebuilds state_ from the
  // durable records, so that no grant, release or other change the write
  // lost still holds capacity, and lets the ledger take records again --
  // when the disk has space again the next call succeeds. Every change made
  // since the failure was built on lost ones, and the ledger failed it too.
  // The views (durable_) never saw a lost change: they only take in what
  // was written before the failure.
  void RollBack();

  absl::Status Broken() const;

  // ---- grants and the queue

  // Places every part of `r` and logs one grant record, or changes nothing.
  Outcome TryGrant(const Request& r, std::vector<Allocation>* out, uint64_t* seq,
                   absl::Status* status);

  // Under mu_: reserves for `head`, the first request of the queue, once it
  // has waited reservation_after.
  void HoldFor(const Waiter& head);

  // Grants queued requests in order (priority, then FIFO), with backfill:
  // behind a head that does not fit, every request that fits is granted, and
  // once the head has waited reservation_after only in what its reservation
  // leaves (Placement::Reserve). Refused requests (quota, priority) leave.
  void Pump();

  // Under mu_ (`lock`, released meanwhile): answers the asynchronous waiters
  // that left the queue.
  void AnswerResolved(std::unique_lock<std::mutex>& lock);

  // Under mu_: grants `r` now (w->result, w->seq), refuses it (w->status),
  // or queues `w` to wait for capacity (o.wait).
  Admission Admit(const Request& r, const AllocateOptions& o, Waiter* w);

  // Under mu_ (`lock`), with active_waiters_ counting the caller: waits
  // until Pump grants or refuses blocking waiter `w`, its timeout runs out or
  // the allocator stops; the outcome is in `w`.
  void AwaitQueued(std::unique_lock<std::mutex>& lock, Waiter* w);

  // Calls `done` with the outcome in `w` once a grant is durable.
  void Answer(Waiter w, Allocator::AllocateDone done);

  // ---- releases

  // Under mu_: releases allocation or gang `id` if `permit` (when set)
  // allows each of its parts; *seq is what to make durable before
  // acknowledging.
  absl::Status ReleaseId(const std::string& id, const Allocator::Permit& permit, uint64_t* seq);

  // Releases `nums`, applies pending mode switches they complete, grants
  // what the queue can now hold. Returns the seq to Sync.
  uint64_t ReleaseLocked(const std::vector<uint64_t>& nums, const std::string& reason);

  // The reaper thread: expires leases, times out and answers asynchronous
  // waiters.
  void ReapLoop();

  AllocatorOptions options_;
  LedgerRecovery recovery_;
  std::unique_ptr<Ledger> ledger_;
  uint64_t records_ = 0;
  absl::Status ledger_error_;  // the ledger cannot go on: a restart must repair it

  mutable std::mutex mu_;
  std::condition_variable queue_cv_;
  std::condition_variable reaper_cv_;
  std::thread reaper_;
  bool stopping_ = false;
  int active_waiters_ = 0;

  AllocatorState state_;     // decides; runs ahead of durable_ by unapplied_
  AllocatorState durable_;   // what views read when there is a ledger
  std::set<std::string> not_ready_;  // nodes SetReady(false) took out
  std::deque<std::pair<uint64_t, std::string>> unapplied_;  // (ticket, record) in flight
  RequestQueue queue_;
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_ALLOCATOR_IMPL_H_
