// Allocator::Impl's methods (allocator_impl.h declares the class and says
// which lock each one needs).
#include "gpu/allocator_impl.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/text.h"
#include "deepnex/units.h"
#include "gpu/codec.h"

namespace deepnex::gpu {
namespace {

// Requests of one user waiting at once.
constexpr size_t kMaxWaitingPerUser = 128;

absl::Status Cancelled() {
  return absl::CancelledError("the allocator shut down while the request waited");
}

absl::Status ValidateAllocate(const Request& r, const AllocateOptions& o) {
  DEEPNEX_RETURN_IF_ERROR(ValidateRequest(r));
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(o.timeout, "timeout", true));
  return absl::OkStatus();
}

// `shortage`: what it would wait for in the queue (Placement::Shortage), so
// that a node switching mode or cordoned is named, not "no free capacity"
// alone beside a free GPU (probe).
absl::Status Busy(const Request& r, size_t ahead, const std::string& shortage) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "no free capacity now for this request (", Describe(r), ") and wait=false",
      shortage.empty() ? "" : absl::StrCat("; queued, it would be ", shortage),
      ahead > 0 ? absl::StrCat("; ", ahead, " request(s) are queued ahead of it") : ""));
}

}  // namespace

absl::Status Allocator::Impl::NoNode(const std::string& name) {
  return absl::NotFoundError(absl::StrCat("node: no node named ", Quoted(name)));
}

absl::Status Allocator::Impl::Open() {
  if (!options_.state_dir.empty()) {
    LedgerOptions lo;
    lo.fsync = options_.fsync;
    // Both states start as what is on disk.
    auto apply = [this](const std::string& r) {
      DEEPNEX_RETURN_IF_ERROR(state_.Apply(r));
      return durable_.Apply(r);
    };
    DEEPNEX_ASSIGN_OR_RETURN(ledger_, Ledger::Open(options_.state_dir, lo, apply, &recovery_));
  }
  reaper_ = std::thread([this] { ReapLoop(); });
  return absl::OkStatus();
}

Allocator::Impl::~Impl() {
  Shutdown();
  if (reaper_.joinable()) reaper_.join();
  // Its last callbacks run while the rest is alive; reset() clears
  // ledger_ before deleting, so a RollBack they start sees no ledger.
  ledger_.reset();
}

void Allocator::Impl::Shutdown() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  queue_.CancelAsync(Cancelled());
  queue_cv_.notify_all();
  reaper_cv_.notify_all();
  while (active_waiters_ > 0) queue_cv_.wait(lock);
  // The reaper has stopped answering: what is left is answered here.
  AnswerResolved(lock);
}

absl::Status Allocator::Impl::AddNode(Node spec) {
  std::unique_lock<std::mutex> lock(mu_);
  DEEPNEX_RETURN_IF_ERROR(Broken());
  DEEPNEX_RETURN_IF_ERROR(placement().Validate(&spec));
  auto n = std::make_unique<NodeState>();
  n->spec = std::move(spec);
  n->mode = n->spec.mode;
  NodeState* raw = n.get();
  placement().Add(std::move(n));
  uint64_t seq = LogLocked(Encode(AllocatorState::RecordOf(*raw)));
  Pump();
  lock.unlock();
  return Durable(seq);
}

absl::Status Allocator::Impl::RemoveNode(const std::string& name) {
  std::unique_lock<std::mutex> lock(mu_);
  NodeState* n = placement().Find(name);
  if (n == nullptr) return NoNode(name);
  if (!n->allocs.empty()) {
    std::vector<std::string> ids;
    for (uint64_t num : n->allocs) ids.push_back(AllocId(num));
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", name, " is not empty: it holds ", NameList(ids),
        "; release or drain them first"));
  }
  placement().Remove(n);
  uint64_t seq = LogLocked(Encode(RemoveNodeRecord{name}));
  // Requests that only this node could hold can never be granted now.
  Pump();
  queue_.RefuseIf([this](const Request& r) { return placement().Infeasible(r); });
  if (queue_.has_resolved()) reaper_cv_.notify_all();
  queue_cv_.notify_all();
  lock.unlock();
  return Durable(seq);
}

absl::Status Allocator::Impl::SetNodeMode(const std::string& name, Mode mode, ModeSwitch when) {
  DEEPNEX_RETURN_IF_ERROR(CheckMode(mode, "mode"));
  std::unique_lock<std::mutex> lock(mu_);
  NodeState* n = placement().Find(name);
  if (n == nullptr) return NoNode(name);
  if (n->mode == mode) {
    if (!n->pending) return AfterPending(lock);
    placement().SetMode(n, mode, false);  // cancels the pending switch
  } else if (n->gpu_allocs == 0) {
    placement().SetMode(n, mode, false);
  } else if (when == ModeSwitch::kRefuse) {
    std::vector<std::string> ids;
    for (uint64_t num : n->allocs) {
      const AllocRec& r = state_.allocs().at(num);
      if (!r.pos.empty()) ids.push_back(absl::StrCat(AllocId(num), " (", r.a.user, ")"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", name, " holds ", ModeName(n->mode), " allocations ", NameList(ids),
        "; release them first, or switch when they are drained (--when-drained)"));
  } else {
    if (n->pending && *n->pending == mode) return AfterPending(lock);
    placement().SetMode(n, mode, true);
  }
  uint64_t seq = LogLocked(Encode(ModeRecord{name, mode, n->pending.has_value()}));
  Pump();
  lock.unlock();
  return Durable(seq);
}

absl::Status Allocator::Impl::SetReady(const std::string& name, bool ready) {
  std::lock_guard<std::mutex> lock(mu_);
  NodeState* n = placement().Find(name);
  if (n == nullptr) return NoNode(name);
  if (n->ready == ready) return absl::OkStatus();
  // Readiness is heard, not logged: set on both states (views read
  // durable_), and kept apart so that a rollback's rebuild keeps it.
  placement().SetReady(n, ready);
  if (ledger_) {
    Placement& shown = durable_.placement();
    if (NodeState* d = shown.Find(name)) shown.SetReady(d, ready);
  }
  if (ready) {
    not_ready_.erase(name);
  } else {
    not_ready_.insert(name);
  }
  // A node back may take what waits in the queue.
  Pump();
  return absl::OkStatus();
}

absl::Status Allocator::Impl::SetFlags(const std::string& name, bool cordoned, bool draining,
                                       bool release, bool keep_draining) {
  std::unique_lock<std::mutex> lock(mu_);
  NodeState* n = placement().Find(name);
  if (n == nullptr) return NoNode(name);
  if (keep_draining) draining = n->draining;
  uint64_t seq = PendingLocked();
  if (n->cordoned != cordoned || n->draining != draining) {
    placement().SetFlags(n, cordoned, draining);
    seq = LogLocked(Encode(FlagsRecord{name, cordoned, draining}));
  }
  if (release && !n->allocs.empty()) {
    std::vector<uint64_t> nums(n->allocs.begin(), n->allocs.end());
    seq = ReleaseLocked(nums, "node drained");
  }
  Pump();
  lock.unlock();
  return Durable(seq);
}

absl::StatusOr<std::string> Allocator::Impl::SetQuota(const std::string& user, const Quota& quota) {
  if (!ValidName(user)) {
    return absl::InvalidArgumentError(
        absl::StrCat("user ", Quoted(user), ": not a valid user name"));
  }
  DEEPNEX_RETURN_IF_ERROR(ValidateQuota(user, quota));
  std::unique_lock<std::mutex> lock(mu_);
  uint64_t seq = PendingLocked();
  if (state_.SetQuota(user, quota)) seq = LogLocked(Encode(QuotaRecord{false, user, quota}));
  const Usage u = state_.UsageOf(user);
  Pump();
  lock.unlock();
  DEEPNEX_RETURN_IF_ERROR(Durable(seq));
  return BelowUseNote(user, quota, u);
}

absl::StatusOr<std::string> Allocator::Impl::SetDefaultQuota(const Quota& quota) {
  DEEPNEX_RETURN_IF_ERROR(ValidateQuota("default", quota));
  std::unique_lock<std::mutex> lock(mu_);
  uint64_t seq = PendingLocked();
  if (state_.SetDefaultQuota(quota)) seq = LogLocked(Encode(QuotaRecord{true, "", quota}));
  const std::vector<std::string> notes = state_.DefaultQuotaNotes(quota);
  Pump();
  lock.unlock();
  DEEPNEX_RETURN_IF_ERROR(Durable(seq));
  return absl::StrJoin(notes, "; ");
}

absl::Status Allocator::Impl::ClearQuota(const std::string& user) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!state_.ClearQuota(user)) return AfterPending(lock);
  uint64_t seq = LogLocked(Encode(ClearQuotaRecord{user}));
  Pump();
  lock.unlock();
  return Durable(seq);
}

absl::StatusOr<std::vector<Allocation>> Allocator::Impl::Allocate(const Request& r,
                                                                  const AllocateOptions& o) {
  DEEPNEX_RETURN_IF_ERROR(ValidateAllocate(r, o));
  Waiter w;
  std::unique_lock<std::mutex> lock(mu_);
  if (Admit(r, o, &w) == Admission::kQueued) {
    ++active_waiters_;
    AwaitQueued(lock, &w);
    --active_waiters_;
    queue_cv_.notify_all();  // Shutdown may wait for active_waiters_
  }
  lock.unlock();
  if (!w.status.ok()) return w.status;
  DEEPNEX_RETURN_IF_ERROR(Durable(w.seq));
  return std::move(w.result);
}

uint64_t Allocator::Impl::AllocateAsync(const Request& r, const AllocateOptions& o,
                                        Allocator::AllocateDone done) {
  absl::Status valid = ValidateAllocate(r, o);
  if (!valid.ok()) {
    done(valid);
    return 0;
  }
  auto w = std::make_unique<Waiter>();
  std::unique_lock<std::mutex> lock(mu_);
  if (Admit(r, o, w.get()) != Admission::kQueued) {
    lock.unlock();
    Answer(std::move(*w), std::move(done));
    return 0;
  }
  // It holds its place in the queue; Resolve hands it to the reaper
  // thread, which also times it out.
  w->answer = std::move(done);
  if (w->timeout.count() > 0) reaper_cv_.notify_all();
  return w.release()->key.second;  // owned by the queue, then by its resolved list
}

bool Allocator::Impl::Withdraw(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!queue_.Withdraw(ticket)) return false;
  reaper_cv_.notify_all();
  Pump();  // what waited behind it may fit now
  return true;
}

absl::Status Allocator::Impl::Release(const std::string& id, const Allocator::Permit& permit) {
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DEEPNEX_RETURN_IF_ERROR(ReleaseId(id, permit, &seq));
  }
  return Durable(seq);
}

void Allocator::Impl::ReleaseAsync(const std::string& id, Allocator::Done done,
                                   const Allocator::Permit& permit) {
  uint64_t seq = 0;
  absl::Status s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = ReleaseId(id, permit, &seq);
  }
  if (!s.ok() || !ledger_ || seq == 0) return done(s);
  WhenDurable(seq, std::move(done));
}

absl::StatusOr<Allocation> Allocator::Impl::Renew(const std::string& id,
                                                  const Allocator::Permit& permit) {
  uint64_t num;
  std::unique_lock<std::mutex> lock(mu_);
  const auto& allocs = state_.allocs();
  auto it = ParseId(id, 'a', &num) ? allocs.find(num) : allocs.end();
  if (it == allocs.end()) {
    return absl::NotFoundError(absl::StrCat("allocation \"", id, "\" does not exist (released, "
                                            "or its lease expired)"));
  }
  if (permit) DEEPNEX_RETURN_IF_ERROR(permit(it->second.a));
  if (it->second.a.lease_ms == 0) {
    return absl::FailedPreconditionError(absl::StrCat("allocation ", id, " has no lease"));
  }
  const int64_t expires = NowMs() + it->second.a.lease_ms;
  state_.ApplyRenew(num, expires);
  uint64_t seq = LogLocked(Encode(RenewRecord{num, expires}));
  Allocation a = it->second.a;
  lock.unlock();
  DEEPNEX_RETURN_IF_ERROR(Durable(seq));
  return a;
}

absl::Status Allocator::Impl::CheckInvariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  DEEPNEX_RETURN_IF_ERROR(state_.CheckInvariants());
  return view().CheckInvariants();
}

std::vector<PendingRequest> Allocator::Impl::Pending(const std::string& user) const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.Pending(user, placement(), options_.reservation_after);
}

size_t Allocator::Impl::QueueLength() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

absl::Status Allocator::Impl::Compact() {
  absl::Status s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ledger_) return absl::OkStatus();
    s = ledger_->Snapshot(state_.SnapshotRecords());
    if (s.ok()) ApplyDurableLocked();
  }
  // If writing out the log before the snapshot failed, what it held is lost
  // (a snapshot file that failed loses nothing: RollBack then does nothing).
  if (!s.ok()) RollBack();
  return s;
}

uint64_t Allocator::Impl::LedgerRecords() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

uint64_t Allocator::Impl::LogLocked(const std::string& record) {
  if (!ledger_) return 0;
  ++records_;
  uint64_t seq = ledger_->Append(record);
  unapplied_.emplace_back(seq, record);
  const uint64_t since = ledger_->records_since_snapshot();
  // A failed snapshot is retried every snapshot_every records, not on
  // each one: the log still holds everything (a full disk fails it fast,
  // but writing the state out is not free).
  if (options_.snapshot_every > 0 && since >= options_.snapshot_every &&
      since % options_.snapshot_every == 0 &&
      ledger_->Snapshot(state_.SnapshotRecords()).ok()) {
    ApplyDurableLocked();  // a snapshot writes out what was in flight
  }
  return seq;
}

uint64_t Allocator::Impl::PendingLocked() const {
  return unapplied_.empty() ? 0 : unapplied_.back().first;
}

absl::Status Allocator::Impl::AfterPending(std::unique_lock<std::mutex>& lock) {
  const uint64_t seq = PendingLocked();
  lock.unlock();
  return Durable(seq);
}

void Allocator::Impl::ApplyDurableLocked() {
  if (!ledger_) return;  // closing
  while (!unapplied_.empty() && ledger_->durable(unapplied_.front().first)) {
    absl::Status s = durable_.Apply(unapplied_.front().second);
    unapplied_.pop_front();
    // state_ accepted the same record in the same order: a refusal here
    // means the two states parted, and no view can be trusted any more.
    if (!s.ok() && ledger_error_.ok()) {
      ledger_error_ = absl::InternalError(
          absl::StrCat("the view of the durable state refused a logged record: ", s.message()));
    }
  }
}

absl::Status Allocator::Impl::Durable(uint64_t seq) {
  if (!ledger_ || seq == 0) return absl::OkStatus();
  absl::Status s = ledger_->Sync(seq);
  if (!s.ok()) {
    RollBack();
    return s;
  }
  std::lock_guard<std::mutex> lock(mu_);
  ApplyDurableLocked();
  return s;
}

void Allocator::Impl::WhenDurable(uint64_t seq, Allocator::Done done) {
  ledger_->WhenDurable(seq, [this, done = std::move(done)](absl::Status s) {
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      ApplyDurableLocked();
    } else {
      RollBack();
    }
    done(s);
  });
}

void Allocator::Impl::RollBack() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ledger_ || !ledger_->failed()) return;  // rolled back already, or closing
  ApplyDurableLocked();  // written before the failure, not yet shown
  unapplied_.clear();    // lost
  state_.Clear();
  absl::Status s = ledger_->Recover([this](const std::string& r) { return state_.Apply(r); });
  if (!s.ok()) ledger_error_ = s;  // Broken() refuses every change from now on
  for (const std::string& name : not_ready_) {
    if (NodeState* n = placement().Find(name)) placement().SetReady(n, false);
  }
  Pump();  // what the lost changes held may fit the queue now
  queue_cv_.notify_all();
  reaper_cv_.notify_all();
}

absl::Status Allocator::Impl::Broken() const {
  if (ledger_error_.ok()) return absl::OkStatus();
  return absl::Status(ledger_error_.code(),
                      absl::StrCat("the ledger failed: ", ledger_error_.message()));
}

Outcome Allocator::Impl::TryGrant(const Request& r, std::vector<Allocation>* out, uint64_t* seq,
                                  absl::Status* status) {
  std::vector<uint64_t> placed;
  const Outcome o = state_.Grant(r, &placed, status);
  if (o != Outcome::kGranted) return o;
  GrantRecord grant;
  out->clear();
  for (uint64_t num : placed) {
    const AllocRec& rec = state_.allocs().at(num);
    if (ledger_) grant.parts.push_back(rec);
    out->push_back(rec.a);
  }
  *seq = ledger_ ? LogLocked(Encode(grant)) : 0;
  if (r.lease.count() > 0) reaper_cv_.notify_all();
  return Outcome::kGranted;
}

void Allocator::Impl::HoldFor(const Waiter& head) {
  if (std::chrono::steady_clock::now() - head.queued_at >= options_.reservation_after) {
    placement().Reserve(head.request);
  }
}

void Allocator::Impl::Pump() {
  const bool any = queue_.Pump(
      [this](Waiter* w) { return TryGrant(w->request, &w->result, &w->seq, &w->status); },
      [this](const Waiter& head) { HoldFor(head); });
  placement().ClearReservations();
  if (queue_.has_resolved()) reaper_cv_.notify_all();
  if (any) queue_cv_.notify_all();
}

void Allocator::Impl::AnswerResolved(std::unique_lock<std::mutex>& lock) {
  if (!queue_.has_resolved()) return;
  std::vector<Waiter*> ready = queue_.TakeResolved();
  ++active_waiters_;  // Shutdown waits for these answers
  lock.unlock();
  for (Waiter* raw : ready) {
    std::unique_ptr<Waiter> w(raw);
    Allocator::AllocateDone done = std::move(w->answer);
    Answer(std::move(*w), std::move(done));
  }
  lock.lock();
  --active_waiters_;
  queue_cv_.notify_all();
}

Allocator::Impl::Admission Allocator::Impl::Admit(const Request& r, const AllocateOptions& o,
                                                  Waiter* w) {
  if (stopping_) {
    w->status = absl::CancelledError("the allocator is shutting down");
    return Admission::kRefused;
  }
  w->status = Broken();
  if (!w->status.ok()) return Admission::kRefused;
  // Every queued request is blocked (Pump ran after the last change), so
  // `r` is either the new head or a backfill candidate: granted if it fits
  // beside the head's reservation.
  const size_t ahead = queue_.Ahead(r.priority);
  if (ahead > 0) HoldFor(*queue_.head());
  Outcome oc = TryGrant(r, &w->result, &w->seq, &w->status);
  placement().ClearReservations();
  if (oc == Outcome::kGranted) return Admission::kGranted;
  if (oc == Outcome::kFailed) return Admission::kRefused;
  if (!o.wait) {
    w->status = Busy(r, ahead, placement().Shortage(r));
    return Admission::kRefused;
  }
  // As Slurm's MaxSubmitJobs: one user's flood of waiting requests would
  // put everyone else's behind it (a probe queued 2000).
  if (queue_.Waiting(r.user) >= kMaxWaitingPerUser) {
    w->status = absl::ResourceExhaustedError(absl::StrCat(
        "user ", r.user, " has ", kMaxWaitingPerUser,
        " requests waiting, the most one user may have; withdraw one or wait for one"));
    return Admission::kRefused;
  }
  queue_.Push(w, r, o);
  // A new head has no reservation yet: what the old one held back may fit.
  if (ahead == 0 && queue_.size() > 1) Pump();
  if (w->done) return w->status.ok() ? Admission::kGranted : Admission::kRefused;
  return Admission::kQueued;
}

void Allocator::Impl::AwaitQueued(std::unique_lock<std::mutex>& lock, Waiter* w) {
  while (!w->done && !stopping_) {
    if (w->timeout.count() > 0) {
      if (queue_cv_.wait_until(lock, w->deadline) == std::cv_status::timeout && !w->done) break;
    } else {
      queue_cv_.wait(lock);
    }
  }
  if (!w->done) {
    const size_t ahead = queue_.Remove(*w);
    Pump();
    w->status = stopping_ ? Cancelled() : RequestQueue::TimedOut(*w, ahead);
  }
}

void Allocator::Impl::Answer(Waiter w, Allocator::AllocateDone done) {
  if (!w.status.ok()) return done(w.status);
  if (!ledger_ || w.seq == 0) return done(std::move(w.result));
  WhenDurable(w.seq, [done = std::move(done), result = std::move(w.result)](
                         absl::Status s) mutable {
    if (s.ok()) {
      done(std::move(result));
    } else {
      done(s);
    }
  });
}

absl::Status Allocator::Impl::ReleaseId(const std::string& id, const Allocator::Permit& permit,
                                        uint64_t* seq) {
  uint64_t num;
  std::vector<uint64_t> nums;
  const bool gang = !ParseId(id, 'a', &num);
  if (gang && !ParseId(id, 'g', &num)) {
    return absl::InvalidArgumentError(
        absl::StrCat("id ", Quoted(id), " is not an allocation id (a<N>) or a gang id (g<N>)"));
  }
  // A typo must not read as done while the allocation meant stays held.
  if (!state_.Issued(gang ? 'g' : 'a', num)) {
    return absl::NotFoundError(absl::StrCat(gang ? "gang " : "allocation ", id,
                                            " was never issued (see deepnex allocations)"));
  }
  if (gang) {
    nums = state_.GangParts(id);
  } else if (state_.allocs().count(num)) {
    nums.push_back(num);
  }
  for (uint64_t part : nums) {
    if (permit) DEEPNEX_RETURN_IF_ERROR(permit(state_.allocs().at(part).a));
  }
  *seq = nums.empty() ? PendingLocked() : ReleaseLocked(nums, "released");
  return absl::OkStatus();
}

uint64_t Allocator::Impl::ReleaseLocked(const std::vector<uint64_t>& nums,
                                        const std::string& reason) {
  if (nums.empty()) return 0;
  std::set<NodeState*> touched;
  for (uint64_t num : nums) {
    auto it = state_.allocs().find(num);
    if (it != state_.allocs().end()) touched.insert(placement().Find(it->second.a.node));
    state_.ApplyRelease(num);
  }
  uint64_t seq = ledger_ ? LogLocked(Encode(ReleaseRecord{nums, reason})) : 0;
  for (NodeState* n : touched) {
    if (n->pending && n->gpu_allocs == 0) {
      Mode m = *n->pending;
      placement().SetMode(n, m, false);
      seq = LogLocked(Encode(ModeRecord{n->spec.name, m, false}));
    }
  }
  Pump();
  return seq;
}

void Allocator::Impl::ReapLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (queue_.has_resolved()) {
      AnswerResolved(lock);
      continue;
    }
    const auto steady_now = std::chrono::steady_clock::now();
    auto next_deadline = std::chrono::steady_clock::time_point::max();
    if (queue_.ExpireAsync(steady_now, &next_deadline)) {
      Pump();  // what waited behind them may fit now
      continue;
    }
    const int64_t now = NowMs();
    const auto& leases = state_.leases();
    std::vector<uint64_t> expired;
    for (auto it = leases.begin(); it != leases.end() && it->first <= now; ++it) {
      expired.push_back(it->second);
    }
    if (!expired.empty()) {
      uint64_t seq = ReleaseLocked(expired, "lease expired");
      lock.unlock();
      const bool logged = Durable(seq).ok();
      lock.lock();
      // A failed write rolled the expiry back: retry it after the usual
      // interval rather than spin on a full disk.
      if (!logged) reaper_cv_.wait_for(lock, options_.lease_check_interval);
      continue;
    }
    int64_t wait_ms = options_.lease_check_interval.count();
    if (!leases.empty()) wait_ms = std::min(wait_ms, leases.begin()->first - now);
    if (next_deadline != std::chrono::steady_clock::time_point::max()) {
      const auto until = next_deadline - steady_now;
      wait_ms = std::min<int64_t>(
          wait_ms, std::chrono::ceil<std::chrono::milliseconds>(until).count());
    }
    reaper_cv_.wait_for(lock, std::chrono::milliseconds(std::max<int64_t>(wait_ms, 1)));
  }
}

}  // namespace deepnex::gpu
