#include "deepnex/gpu/allocator.h"

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "deepnex/units.h"
#include "gpu/allocator_records.h"
#include "gpu/codec.h"
#include "gpu/invariants.h"
#include "gpu/ledger.h"
#include "gpu/placement.h"

namespace deepnex::gpu {
namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---------------------------------------------------------------------------

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

enum class Outcome { kGranted, kBusy, kFailed };

class Allocator::Impl {
 public:
  explicit Impl(const AllocatorOptions& options) : options_(options) {}

  absl::Status Open() {
    if (!options_.state_dir.empty()) {
      LedgerOptions lo;
      lo.fsync = options_.fsync;
      DEEPNEX_ASSIGN_OR_RETURN(
          ledger_, Ledger::Open(options_.state_dir, lo,
                                [this](const std::string& r) { return ApplyRecord(r); },
                                &recovery_));
    }
    reaper_ = std::thread([this] { ReapLoop(); });
    return absl::OkStatus();
  }

  ~Impl() {
    Shutdown();
    if (reaper_.joinable()) reaper_.join();
    // Its last callbacks run while the rest is alive; reset() clears
    // ledger_ before deleting, so a RollBack they start sees no ledger.
    ledger_.reset();
  }

  void Shutdown() {
    std::unique_lock<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto it = queue_.begin(); it != queue_.end();) {
      Waiter* w = it->second;
      if (!w->answer) {  // a blocking waiter leaves by itself
        ++it;
        continue;
      }
      it = queue_.erase(it);
      w->status = Cancelled();
      Resolved(w);
    }
    queue_cv_.notify_all();
    reaper_cv_.notify_all();
    while (active_waiters_ > 0) queue_cv_.wait(lock);
    // The reaper has stopped answering: what is left is answered here.
    AnswerResolved(lock);
  }

  static absl::Status Cancelled() {
    return absl::CancelledError("the allocator shut down while the request waited");
  }

  // ---- records: applying (replay; live changes call the same Apply*
  // functions, so a replayed state equals the live one)

  absl::Status ApplyRecord(const std::string& bytes) {
    Record record;
    DEEPNEX_RETURN_IF_ERROR(DecodeRecord(bytes, &record));
    return std::visit([this](auto&& r) { return Replay(std::move(r)); }, std::move(record));
  }

  absl::Status Replay(NodeRecord r) {
    if (placement_.nodes().count(r.spec.name)) {
      return absl::DataLossError(absl::StrCat("node ", r.spec.name, " added twice"));
    }
    auto n = std::make_unique<NodeState>();
    n->spec = std::move(r.spec);
    n->mode = n->spec.mode;
    n->pending = r.pending;
    n->cordoned = r.cordoned;
    n->draining = r.draining;
    placement_.Add(std::move(n));
    return absl::OkStatus();
  }

  absl::Status Replay(RemoveNodeRecord r) {
    NodeState* n = placement_.Find(r.name);
    if (n == nullptr || !n->allocs.empty()) {
      return absl::DataLossError(absl::StrCat("remove of unknown or busy node ", r.name));
    }
    placement_.Remove(n);
    return absl::OkStatus();
  }

  absl::Status Replay(ModeRecord r) {
    NodeState* n = placement_.Find(r.name);
    if (n == nullptr) return absl::DataLossError(absl::StrCat("mode of unknown node ", r.name));
    placement_.SetMode(n, r.mode, r.pending);
    return absl::OkStatus();
  }

  absl::Status Replay(FlagsRecord r) {
    NodeState* n = placement_.Find(r.name);
    if (n == nullptr) return absl::DataLossError(absl::StrCat("flags of unknown node ", r.name));
    placement_.SetFlags(n, r.cordoned, r.draining);
    return absl::OkStatus();
  }

  absl::Status Replay(QuotaRecord r) {
    if (r.is_default) {
      default_quota_ = r.quota;
    } else {
      quotas_[r.user] = r.quota;
    }
    return absl::OkStatus();
  }

  absl::Status Replay(ClearQuotaRecord r) {
    quotas_.erase(r.user);
    return absl::OkStatus();
  }

  absl::Status Replay(GrantRecord grant) {
    for (AllocRec& r : grant.parts) {
      NodeState* n = placement_.Find(r.a.node);
      if (n == nullptr) {
        return absl::DataLossError(absl::StrCat("grant on unknown node ", r.a.node));
      }
      for (size_t i = 0; i < r.pos.size(); ++i) {
        int pos = r.pos[i];
        if (pos >= static_cast<int>(n->spec.gpus.size()) ||
            (r.a.gpus[i].exclusive && n->count[pos] > 0) ||
            n->used_mem[pos] + r.a.gpus[i].memory > n->spec.gpus[pos].memory) {
          return absl::DataLossError(absl::StrCat("grant a", r.num, " overbooks GPU ", pos,
                                                  " of node ", r.a.node));
        }
      }
      if (allocs_.count(r.num)) {
        return absl::DataLossError(absl::StrCat("allocation a", r.num, " granted twice"));
      }
      ApplyGrant(std::move(r));
    }
    return absl::OkStatus();
  }

  absl::Status Replay(ReleaseRecord r) {
    for (uint64_t num : r.nums) ApplyRelease(num);
    return absl::OkStatus();
  }

  absl::Status Replay(RenewRecord r) {
    ApplyRenew(r.num, r.expires_at_ms);
    return absl::OkStatus();
  }

  absl::Status Replay(NextIdsRecord r) {
    next_id_ = std::max(next_id_, r.next_id);
    next_gang_ = std::max(next_gang_, r.next_gang);
    return absl::OkStatus();
  }

  // ---- state changes

  void ApplyGrant(AllocRec r) {
    placement_.Book(placement_.Find(r.a.node), &r);
    Usage& u = usage_[r.a.user];
    for (const GrantedGpu& g : r.a.gpus) u.gpu_memory += g.memory;
    u.gpus += static_cast<int64_t>(r.pos.size());
    u.cpus += r.a.cpus;
    u.memory += r.a.memory;
    next_id_ = std::max(next_id_, r.num + 1);
    uint64_t gang;
    if (!r.a.gang.empty() && ParseId(r.a.gang, 'g', &gang)) {
      next_gang_ = std::max(next_gang_, gang + 1);
      gangs_[r.a.gang].push_back(r.num);
    }
    if (r.a.expires_at_ms > 0) leases_.emplace(r.a.expires_at_ms, r.num);
    allocs_.emplace(r.num, std::move(r));
  }

  // Unknown ids are ignored (releases are idempotent).
  void ApplyRelease(uint64_t num) {
    auto it = allocs_.find(num);
    if (it == allocs_.end()) return;
    const AllocRec& r = it->second;
    placement_.Unbook(placement_.Find(r.a.node), r);
    Usage& u = usage_[r.a.user];
    for (const GrantedGpu& g : r.a.gpus) u.gpu_memory -= g.memory;
    u.gpus -= static_cast<int64_t>(r.pos.size());
    u.cpus -= r.a.cpus;
    u.memory -= r.a.memory;
    if (u.gpus == 0 && u.cpus == 0 && u.memory == 0 && u.gpu_memory == 0) usage_.erase(r.a.user);
    if (!r.a.gang.empty()) {
      auto g = gangs_.find(r.a.gang);
      if (g != gangs_.end()) {
        auto& v = g->second;
        v.erase(std::remove(v.begin(), v.end(), num), v.end());
        if (v.empty()) gangs_.erase(g);
      }
    }
    if (r.a.expires_at_ms > 0) leases_.erase({r.a.expires_at_ms, num});
    allocs_.erase(it);
  }

  void ApplyRenew(uint64_t num, int64_t expires) {
    auto it = allocs_.find(num);
    if (it == allocs_.end()) return;
    Allocation& a = it->second.a;
    if (a.expires_at_ms > 0) leases_.erase({a.expires_at_ms, num});
    a.expires_at_ms = expires;
    leases_.emplace(expires, num);
  }

  // ---- logging

  // Appends under mu_, after applying the change in memory; returns the
  // ledger ticket to make durable before acknowledging (0 in memory). If
  // that write fails, RollBack undoes the change before anyone is told.
  uint64_t LogLocked(const std::string& record) {
    if (!ledger_) return 0;
    ++records_;
    uint64_t seq = ledger_->Append(record);
    const uint64_t since = ledger_->records_since_snapshot();
    // A failed snapshot is retried every snapshot_every records, not on
    // each one: the log still holds everything (a full disk fails it fast,
    // but writing the state out is not free).
    if (options_.snapshot_every > 0 && since >= options_.snapshot_every &&
        since % options_.snapshot_every == 0) {
      ledger_->Snapshot(SnapshotRecords()).IgnoreError();
    }
    return seq;
  }

  // Waits until ticket `seq` is durable; if its write failed, memory is
  // rolled back to the durable state before the error returns.
  absl::Status Durable(uint64_t seq) {
    if (!ledger_ || seq == 0) return absl::OkStatus();
    absl::Status s = ledger_->Sync(seq);
    if (!s.ok()) RollBack();
    return s;
  }

  // The asynchronous Durable: `done` hears once the rollback is done.
  void WhenDurable(uint64_t seq, Allocator::Done done) {
    ledger_->WhenDurable(seq, [this, done = std::move(done)](absl::Status s) {
      if (!s.ok()) RollBack();
      done(s);
    });
  }

  // After a failed ledger write (takes mu_): rebuilds memory from the
  // durable records, so that no grant, release or other change the write
  // lost stays applied, and lets the ledger take records again -- when the
  // disk has space again the next call succeeds. Every change made since
  // the failure was built on lost ones, and the ledger failed it too.
  void RollBack() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ledger_ || !ledger_->failed()) return;  // rolled back already, or closing
    placement_.Clear();
    allocs_.clear();
    gangs_.clear();
    usage_.clear();
    quotas_.clear();
    default_quota_ = Quota{};
    next_id_ = next_gang_ = 1;
    leases_.clear();
    absl::Status s = ledger_->Recover([this](const std::string& r) { return ApplyRecord(r); });
    if (!s.ok()) ledger_error_ = s;  // Broken() refuses every change from now on
    Pump();  // what the lost changes held may fit the queue now
    queue_cv_.notify_all();
    reaper_cv_.notify_all();
  }

  // The record that adds `n` as it is now (AddNode, snapshots).
  static NodeRecord RecordOf(const NodeState& n) {
    NodeRecord r;
    r.spec = n.spec;
    r.spec.mode = n.mode;
    r.pending = n.pending;
    r.cordoned = n.cordoned;
    r.draining = n.draining;
    return r;
  }

  std::vector<std::string> SnapshotRecords() const {
    std::vector<std::string> out;
    for (const auto& [name, n] : placement_.nodes()) out.push_back(Encode(RecordOf(*n)));
    if (!(default_quota_ == Quota{})) {
      out.push_back(Encode(QuotaRecord{true, "", default_quota_}));
    }
    for (const auto& [user, q] : quotas_) out.push_back(Encode(QuotaRecord{false, user, q}));
    for (const auto& [num, r] : allocs_) out.push_back(Encode(GrantRecord{{r}}));
    out.push_back(Encode(NextIdsRecord{next_id_, next_gang_}));
    return out;
  }

  // ---- validation

  static absl::Status ValidateRequest(const Request& r) {
    auto bad = [](auto... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
    if (!ValidName(r.user)) return bad("user \"", r.user, "\": use 1-253 letters, digits, '-', '_', '.', '@'");
    if (!r.job.empty() && !ValidName(r.job)) {
      return bad("job \"", r.job, "\": use 1-253 letters, digits, '-', '_', '.', '@'");
    }
    if (r.gpus < 0) return bad("gpus=", r.gpus, " must be >= 0");
    if (r.gpus > 4096) return bad("gpus=", r.gpus, " is more than any node has");
    if (r.cpus < 0) return bad("cpus=", r.cpus, " must be >= 0");
    if (r.replicas < 1) return bad("replicas=", r.replicas, " must be >= 1");
    if (r.replicas > 100000) return bad("replicas=", r.replicas, " is too many");
    if (r.lease.count() < 0) return bad("lease=", r.lease.count(), "ms must be >= 0");
    if (r.gpus > 0 && r.mode == Mode::kShared && r.gpu_memory == 0) {
      return bad("gpu_memory=0B: a shared request must give the GPU memory it needs per GPU");
    }
    if (r.gpus == 0 && r.gpu_memory > 0) {
      return bad("gpu_memory=", FormatByteSize(r.gpu_memory), " with gpus=0");
    }
    if (r.gpus == 0 && r.cpus == 0 && r.memory == 0) {
      return bad("the request asks for nothing (gpus=0, cpus=0, memory=0B)");
    }
    for (const auto& [k, v] : r.selector) {
      if (k.empty()) return bad("selector: a label has an empty key");
    }
    return absl::OkStatus();
  }

  // ---- the queue

  // Under mu_: reserves for `head`, the first request of the queue, once it
  // has waited reservation_after.
  void HoldFor(const Waiter& head) {
    if (std::chrono::steady_clock::now() - head.queued_at >= options_.reservation_after) {
      placement_.Reserve(head.request);
    }
  }

  bool HeadReserved() const {
    if (queue_.empty()) return false;
    const auto waited = std::chrono::steady_clock::now() - queue_.begin()->second->queued_at;
    return waited >= options_.reservation_after;
  }

  std::vector<PendingRequest> Pending(const std::string& user) const {
    std::vector<PendingRequest> out;
    const auto now = std::chrono::steady_clock::now();
    size_t position = 0;
    for (const auto& [key, w] : queue_) {
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
      std::string short_of = placement_.Shortage(w->request);
      if (short_of.empty()) {
        // The head fits only between a change and the Pump that follows it;
        // a later request that fits is held back only by the head's reservation.
        if (behind.empty()) {
          p.reason = "being granted";
        } else if (HeadReserved()) {
          p.reason = absl::StrCat("held back: the capacity it fits in is reserved for q",
                                  queue_.begin()->first.second,
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

  UserQuota QuotaEntry(const std::string& user) const {
    UserQuota q;
    q.user = user;
    q.own = quotas_.count(user) > 0;
    q.quota = QuotaFor(user);
    auto it = usage_.find(user);
    if (it != usage_.end()) q.usage = it->second;
    return q;
  }

  Quota QuotaFor(const std::string& user) const {
    auto it = quotas_.find(user);
    return it == quotas_.end() ? default_quota_ : it->second;
  }

  absl::Status CheckQuota(const std::string& user, int64_t gpus, uint64_t gpu_memory,
                          int64_t cpus, uint64_t memory) const {
    if (quotas_.empty() && default_quota_ == Quota{}) return absl::OkStatus();
    const Quota q = QuotaFor(user);
    Usage u;
    auto it = usage_.find(user);
    if (it != usage_.end()) u = it->second;
    auto refuse = [&](const char* field, const std::string& used, const std::string& asked,
                      const std::string& limit, bool below) {
      const char* which = quotas_.count(user) ? "quota" : "default quota";
      std::string s = absl::StrCat(which, " of ", user, ": ", field, " ", used,
                                   " in use + ", asked, " requested > quota ", limit);
      if (below) {
        absl::StrAppend(&s, " (the quota is below current use; new grants are refused "
                            "until use drops under it)");
      }
      return absl::ResourceExhaustedError(s);
    };
    if (gpus > 0 && q.gpus && u.gpus + gpus > *q.gpus) {
      return refuse("gpus", std::to_string(u.gpus), std::to_string(gpus),
                    std::to_string(*q.gpus), u.gpus > *q.gpus);
    }
    if (gpu_memory > 0 && q.gpu_memory && u.gpu_memory + gpu_memory > *q.gpu_memory) {
      return refuse("gpu_memory", FormatByteSize(u.gpu_memory), FormatByteSize(gpu_memory),
                    FormatByteSize(*q.gpu_memory), u.gpu_memory > *q.gpu_memory);
    }
    if (cpus > 0 && q.cpus && u.cpus + cpus > *q.cpus) {
      return refuse("cpus", std::to_string(u.cpus), std::to_string(cpus),
                    std::to_string(*q.cpus), u.cpus > *q.cpus);
    }
    if (memory > 0 && q.memory && u.memory + memory > *q.memory) {
      return refuse("memory", FormatByteSize(u.memory), FormatByteSize(memory),
                    FormatByteSize(*q.memory), u.memory > *q.memory);
    }
    return absl::OkStatus();
  }

  // Places every part of `r` and logs one grant record, or changes nothing.
  Outcome TryGrant(const Request& r, std::vector<Allocation>* out, uint64_t* seq,
                   absl::Status* status) {
    const int64_t parts = r.replicas;
    const bool shared = r.mode == Mode::kShared;
    const int max_priority = QuotaFor(r.user).max_priority;
    if (r.priority > max_priority) {
      *status = absl::PermissionDeniedError(absl::StrCat(
          "priority=", r.priority, " is above ", r.user, "'s maximum priority ", max_priority,
          " (", quotas_.count(r.user) ? "their quota" : "the default quota",
          "'s max_priority, which an admin sets)"));
      return Outcome::kFailed;
    }
    absl::Status q = CheckQuota(r.user, int64_t{r.gpus} * parts,
                                shared ? r.gpu_memory * r.gpus * parts : 0,
                                int64_t{r.cpus} * parts, r.memory * parts);
    if (!q.ok()) {
      *status = q;
      return Outcome::kFailed;
    }
    const uint64_t saved_id = next_id_, saved_gang = next_gang_;
    std::string gang = parts > 1 ? GangId(next_gang_) : "";
    const int64_t now = r.lease.count() > 0 ? NowMs() : 0;
    std::vector<uint64_t> placed;
    std::vector<int> pos;
    for (int64_t p = 0; p < parts; ++p) {
      NodeState* n = placement_.Place(r, &pos);
      if (n == nullptr) {
        for (uint64_t num : placed) ApplyRelease(num);
        next_id_ = saved_id;
        next_gang_ = saved_gang;
        absl::Status why = placement_.Infeasible(r);
        if (!why.ok()) {
          *status = why;
          return Outcome::kFailed;
        }
        return Outcome::kBusy;
      }
      AllocRec rec;
      rec.num = next_id_;
      rec.pos = pos;
      Allocation& a = rec.a;
      a.user = r.user;
      a.job = r.job;
      a.node = n->spec.name;
      for (int i : pos) {
        GrantedGpu g;
        g.exclusive = !shared;
        g.memory = shared ? r.gpu_memory : n->spec.gpus[i].memory;
        a.gpus.push_back(g);
      }
      a.cpus = r.cpus;
      a.memory = r.memory;
      a.priority = r.priority;
      a.gang = gang;
      a.replica = parts > 1 ? static_cast<int>(p) : 0;
      a.lease_ms = r.lease.count();
      a.expires_at_ms = a.lease_ms > 0 ? now + a.lease_ms : 0;
      placed.push_back(rec.num);
      ApplyGrant(std::move(rec));
    }
    if (!shared && r.gpus > 0) {
      // Exclusive GPUs count their whole memory, known only once placed.
      const Quota quota = QuotaFor(r.user);
      const Usage& u = usage_[r.user];
      if (quota.gpu_memory && u.gpu_memory > *quota.gpu_memory) {
        uint64_t asked = 0;
        for (uint64_t num : placed) {
          for (const auto& g : allocs_.at(num).a.gpus) asked += g.memory;
        }
        for (uint64_t num : placed) ApplyRelease(num);
        next_id_ = saved_id;
        next_gang_ = saved_gang;
        *status = CheckQuota(r.user, 0, asked, 0, 0);
        if (status->ok()) *status = absl::ResourceExhaustedError("gpu_memory quota");
        return Outcome::kFailed;
      }
    }
    GrantRecord grant;
    out->clear();
    for (uint64_t num : placed) {
      const AllocRec& rec = allocs_.at(num);
      if (ledger_) grant.parts.push_back(rec);
      out->push_back(rec.a);
    }
    *seq = ledger_ ? LogLocked(Encode(grant)) : 0;
    if (r.lease.count() > 0) reaper_cv_.notify_all();
    return Outcome::kGranted;
  }

  // Grants queued requests in order (priority, then FIFO), with backfill:
  // behind a head that does not fit, every request that fits is granted, and
  // once the head has waited reservation_after only in what its reservation
  // leaves (Reserve). Refused requests (quota, priority) leave the queue.
  void Pump() {
    bool any = false;
    bool head = true;
    for (auto it = queue_.begin(); it != queue_.end();) {
      Waiter* w = it->second;
      Outcome o = TryGrant(w->request, &w->result, &w->seq, &w->status);
      if (o == Outcome::kBusy) {
        if (head) HoldFor(*w);
        head = false;
        ++it;
        continue;
      }
      it = queue_.erase(it);
      Resolved(w);
      any = true;
    }
    placement_.ClearReservations();
    if (any) queue_cv_.notify_all();
  }

  // Under mu_: `w` left the queue with its outcome. A blocking waiter sees
  // `done`; an asynchronous one is answered by the reaper thread.
  void Resolved(Waiter* w) {
    w->done = true;
    if (w->answer) {
      resolved_.push_back(w);
      reaper_cv_.notify_all();
    }
  }

  // Under mu_ (`lock`, released meanwhile): answers the asynchronous waiters
  // that left the queue.
  void AnswerResolved(std::unique_lock<std::mutex>& lock) {
    if (resolved_.empty()) return;
    std::vector<Waiter*> ready;
    ready.swap(resolved_);
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

  absl::Status TimedOut(const Waiter& w, size_t ahead) const {
    return absl::DeadlineExceededError(absl::StrCat(
        "timeout: waited ", w.timeout.count(), "ms in the queue (", Describe(w.request), "; ",
        ahead, " request(s) ahead of it) without free capacity"));
  }

  enum class Admission { kGranted, kRefused, kQueued };

  static absl::Status ValidateAllocate(const Request& r, const AllocateOptions& o) {
    DEEPNEX_RETURN_IF_ERROR(ValidateRequest(r));
    if (o.timeout.count() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("timeout=", o.timeout.count(), "ms must be >= 0"));
    }
    return absl::OkStatus();
  }

  // Under mu_: grants `r` now (w->result, w->seq), refuses it (w->status),
  // or queues `w` to wait for capacity (o.wait).
  Admission Admit(const Request& r, const AllocateOptions& o, Waiter* w) {
    if (stopping_) {
      w->status = absl::CancelledError("the allocator is shutting down");
      return Admission::kRefused;
    }
    w->status = Broken();
    if (!w->status.ok()) return Admission::kRefused;
    // Every queued request is blocked (Pump ran after the last change), so
    // `r` is either the new head or a backfill candidate: granted if it fits
    // beside the head's reservation.
    size_t ahead = 0;
    for (const auto& [key, queued] : queue_) ahead += queued->request.priority >= r.priority;
    if (ahead > 0) HoldFor(*queue_.begin()->second);
    Outcome oc = TryGrant(r, &w->result, &w->seq, &w->status);
    placement_.ClearReservations();
    if (oc == Outcome::kGranted) return Admission::kGranted;
    if (oc == Outcome::kFailed) return Admission::kRefused;
    if (!o.wait) {
      w->status = Busy(r, ahead);
      return Admission::kRefused;
    }
    w->request = r;
    w->key = {-static_cast<int64_t>(r.priority), next_order_++};
    w->timeout = o.timeout;
    w->queued_at = std::chrono::steady_clock::now();
    if (o.timeout.count() > 0) w->deadline = w->queued_at + o.timeout;
    queue_.emplace(w->key, w);
    // A new head has no reservation yet: what the old one held back may fit.
    if (ahead == 0 && queue_.size() > 1) Pump();
    if (w->done) return w->status.ok() ? Admission::kGranted : Admission::kRefused;
    return Admission::kQueued;
  }

  // Under mu_ (`lock`), with active_waiters_ counting the caller: waits
  // until Pump grants or refuses blocking waiter `w`, its timeout runs out or
  // the allocator stops; the outcome is in `w`.
  void AwaitQueued(std::unique_lock<std::mutex>& lock, Waiter* w) {
    while (!w->done && !stopping_) {
      if (w->timeout.count() > 0) {
        if (queue_cv_.wait_until(lock, w->deadline) == std::cv_status::timeout && !w->done) break;
      } else {
        queue_cv_.wait(lock);
      }
    }
    if (!w->done) {
      size_t ahead = std::distance(queue_.begin(), queue_.find(w->key));
      queue_.erase(w->key);
      Pump();
      w->status = stopping_ ? Cancelled() : TimedOut(*w, ahead);
    }
  }

  absl::StatusOr<std::vector<Allocation>> Allocate(const Request& r, const AllocateOptions& o) {
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

  uint64_t AllocateAsync(const Request& r, const AllocateOptions& o,
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
    // It holds its place in the queue; Resolved hands it to the reaper
    // thread, which also times it out.
    w->answer = std::move(done);
    if (w->timeout.count() > 0) reaper_cv_.notify_all();
    return w.release()->key.second;  // owned by the queue, then by resolved_
  }

  bool Withdraw(uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
      Waiter* w = it->second;
      if (it->first.second != ticket || !w->answer) continue;
      queue_.erase(it);
      w->status = absl::CancelledError("the request was withdrawn from the queue");
      Resolved(w);
      Pump();  // what waited behind it may fit now
      return true;
    }
    return false;
  }

  // Calls `done` with the outcome in `w` once a grant is durable.
  void Answer(Waiter w, Allocator::AllocateDone done) {
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

  // Under mu_: releases allocation or gang `id`; *seq is what to make
  // durable before acknowledging.
  absl::Status ReleaseId(const std::string& id, uint64_t* seq) {
    uint64_t num;
    std::vector<uint64_t> nums;
    if (ParseId(id, 'a', &num)) {
      if (allocs_.count(num)) nums.push_back(num);
    } else if (ParseId(id, 'g', &num)) {
      auto it = gangs_.find(id);
      if (it != gangs_.end()) nums = it->second;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("id \"", id, "\" is not an allocation id (a<N>) or a gang id (g<N>)"));
    }
    *seq = ReleaseLocked(nums, "released");
    return absl::OkStatus();
  }

  absl::Status Busy(const Request& r, size_t ahead) const {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no free capacity now for this request (", Describe(r), ") and wait=false",
        ahead > 0 ? absl::StrCat("; ", ahead, " request(s) are queued ahead of it") : ""));
  }

  absl::Status Broken() const {
    if (ledger_error_.ok()) return absl::OkStatus();
    return absl::Status(ledger_error_.code(),
                        absl::StrCat("the ledger failed: ", ledger_error_.message()));
  }

  // Releases `nums`, applies pending mode switches they complete, grants
  // what the queue can now hold. Returns the seq to Sync.
  uint64_t ReleaseLocked(const std::vector<uint64_t>& nums, const std::string& reason) {
    if (nums.empty()) return 0;
    std::set<NodeState*> touched;
    for (uint64_t num : nums) {
      auto it = allocs_.find(num);
      if (it != allocs_.end()) touched.insert(placement_.Find(it->second.a.node));
      ApplyRelease(num);
    }
    uint64_t seq = ledger_ ? LogLocked(Encode(ReleaseRecord{nums, reason})) : 0;
    for (NodeState* n : touched) {
      if (n->pending && n->gpu_allocs == 0) {
        Mode m = *n->pending;
        placement_.SetMode(n, m, false);
        seq = LogLocked(Encode(ModeRecord{n->spec.name, m, false}));
      }
    }
    Pump();
    return seq;
  }

  // The reaper thread: expires leases, times out and answers asynchronous
  // waiters.
  void ReapLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      if (!resolved_.empty()) {
        AnswerResolved(lock);
        continue;
      }
      const auto steady_now = std::chrono::steady_clock::now();
      auto next_deadline = std::chrono::steady_clock::time_point::max();
      bool timed_out = false;
      size_t ahead = 0;
      for (auto it = queue_.begin(); it != queue_.end();) {
        Waiter* w = it->second;
        if (w->answer && w->deadline <= steady_now) {
          it = queue_.erase(it);
          w->status = TimedOut(*w, ahead);
          Resolved(w);
          timed_out = true;
          continue;
        }
        if (w->answer) next_deadline = std::min(next_deadline, w->deadline);
        ++ahead;
        ++it;
      }
      if (timed_out) {
        Pump();  // what waited behind them may fit now
        continue;
      }
      const int64_t now = NowMs();
      std::vector<uint64_t> expired;
      for (auto it = leases_.begin(); it != leases_.end() && it->first <= now; ++it) {
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
      if (!leases_.empty()) wait_ms = std::min(wait_ms, leases_.begin()->first - now);
      if (next_deadline != std::chrono::steady_clock::time_point::max()) {
        wait_ms = std::min<int64_t>(
            wait_ms, std::chrono::ceil<std::chrono::milliseconds>(next_deadline - steady_now).count());
      }
      reaper_cv_.wait_for(lock, std::chrono::milliseconds(std::max<int64_t>(wait_ms, 1)));
    }
  }

  absl::Status CheckInvariants() const {
    return gpu::CheckInvariants(placement_, allocs_, usage_);
  }

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
  std::vector<Waiter*> resolved_;  // asynchronous waiters to answer (owned)

  Placement placement_;

  std::map<uint64_t, AllocRec> allocs_;
  std::map<std::string, std::vector<uint64_t>> gangs_;
  std::unordered_map<std::string, Usage> usage_;
  std::map<std::string, Quota> quotas_;
  Quota default_quota_;
  uint64_t next_id_ = 1;
  uint64_t next_gang_ = 1;
  std::set<std::pair<int64_t, uint64_t>> leases_;  // (expires at, allocation)

  std::map<std::pair<int64_t, uint64_t>, Waiter*> queue_;  // (-priority, order)
  uint64_t next_order_ = 1;  // also an asynchronous waiter's ticket
};

// ---------------------------------------------------------------------------

Allocator::Allocator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Allocator::~Allocator() = default;

absl::StatusOr<std::unique_ptr<Allocator>> Allocator::Create(const AllocatorOptions& options) {
  if (options.lease_check_interval.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_check_interval=", options.lease_check_interval.count(), "ms must be positive"));
  }
  if (options.reservation_after.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reservation_after=", options.reservation_after.count(), "ms must be >= 0"));
  }
  auto impl = std::make_unique<Impl>(options);
  DEEPNEX_RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<Allocator>(new Allocator(std::move(impl)));
}

namespace {
absl::Status NoNode(const std::string& name) {
  return absl::NotFoundError(absl::StrCat("node: no node named \"", name, "\""));
}
}  // namespace

absl::Status Allocator::AddNode(const Node& node) {
  Impl& m = *impl_;
  Node spec = node;
  std::unique_lock<std::mutex> lock(m.mu_);
  DEEPNEX_RETURN_IF_ERROR(m.Broken());
  DEEPNEX_RETURN_IF_ERROR(m.placement_.Validate(&spec));
  auto n = std::make_unique<NodeState>();
  n->spec = std::move(spec);
  n->mode = n->spec.mode;
  NodeState* raw = n.get();
  m.placement_.Add(std::move(n));
  uint64_t seq = m.LogLocked(Encode(m.RecordOf(*raw)));
  m.Pump();
  lock.unlock();
  return m.Durable(seq);
}

absl::Status Allocator::RemoveNode(const std::string& name) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu_);
  NodeState* n = m.placement_.Find(name);
  if (n == nullptr) return NoNode(name);
  if (!n->allocs.empty()) {
    std::vector<std::string> ids;
    for (uint64_t num : n->allocs) ids.push_back(AllocId(num));
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", name, " is not empty: it holds ", NameList(ids),
        "; release or drain them first"));
  }
  m.placement_.Remove(n);
  uint64_t seq = m.LogLocked(Encode(RemoveNodeRecord{name}));
  // Requests that only this node could hold can never be granted now.
  m.Pump();
  for (auto it = m.queue_.begin(); it != m.queue_.end();) {
    absl::Status why = m.placement_.Infeasible(it->second->request);
    if (!why.ok()) {
      it->second->status = why;
      m.Resolved(it->second);
      it = m.queue_.erase(it);
    } else {
      ++it;
    }
  }
  m.queue_cv_.notify_all();
  lock.unlock();
  return m.Durable(seq);
}

absl::Status Allocator::SetNodeMode(const std::string& name, Mode mode, ModeSwitch when) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu_);
  NodeState* n = m.placement_.Find(name);
  if (n == nullptr) return NoNode(name);
  if (n->mode == mode) {
    if (!n->pending) return absl::OkStatus();
    m.placement_.SetMode(n, mode, false);  // cancels the pending switch
  } else if (n->gpu_allocs == 0) {
    m.placement_.SetMode(n, mode, false);
  } else if (when == ModeSwitch::kRefuse) {
    std::vector<std::string> ids;
    for (uint64_t num : n->allocs) {
      const AllocRec& r = m.allocs_.at(num);
      if (!r.pos.empty()) ids.push_back(absl::StrCat(AllocId(num), " (", r.a.user, ")"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", name, " holds ", ModeName(n->mode), " allocations ", NameList(ids),
        "; release them first, or switch when they are drained (--when-drained)"));
  } else {
    if (n->pending && *n->pending == mode) return absl::OkStatus();
    m.placement_.SetMode(n, mode, true);
  }
  uint64_t seq = m.LogLocked(Encode(ModeRecord{name, mode, n->pending.has_value()}));
  m.Pump();
  lock.unlock();
  return m.Durable(seq);
}

namespace {
// `keep_draining`: the node's draining flag stays as it is.
absl::Status SetFlags(Allocator::Impl& m, const std::string& name, bool cordoned,
                      bool draining, bool release, bool keep_draining = false) {
  std::unique_lock<std::mutex> lock(m.mu_);
  NodeState* n = m.placement_.Find(name);
  if (n == nullptr) return NoNode(name);
  if (keep_draining) draining = n->draining;
  uint64_t seq = 0;
  if (n->cordoned != cordoned || n->draining != draining) {
    m.placement_.SetFlags(n, cordoned, draining);
    seq = m.LogLocked(Encode(FlagsRecord{name, cordoned, draining}));
  }
  if (release && !n->allocs.empty()) {
    std::vector<uint64_t> nums(n->allocs.begin(), n->allocs.end());
    seq = m.ReleaseLocked(nums, "node drained");
  }
  m.Pump();
  lock.unlock();
  return m.Durable(seq);
}
}  // namespace

absl::Status Allocator::Cordon(const std::string& name) {
  return SetFlags(*impl_, name, true, false, false, /*keep_draining=*/true);
}

absl::Status Allocator::Uncordon(const std::string& name) {
  return SetFlags(*impl_, name, false, false, false);
}

absl::Status Allocator::Drain(const std::string& name, bool release) {
  return SetFlags(*impl_, name, true, true, release);
}

namespace {
absl::Status ValidateQuota(const std::string& who, const Quota& q) {
  if (q.gpus && *q.gpus < 0) {
    return absl::InvalidArgumentError(absl::StrCat("quota of ", who, ": gpus=", *q.gpus,
                                                   " must be >= 0"));
  }
  if (q.cpus && *q.cpus < 0) {
    return absl::InvalidArgumentError(absl::StrCat("quota of ", who, ": cpus=", *q.cpus,
                                                   " must be >= 0"));
  }
  return absl::OkStatus();
}

std::string BelowUseNote(const std::string& who, const Quota& q, const Usage& u) {
  std::vector<std::string> over;
  if (q.gpus && u.gpus > *q.gpus) over.push_back(absl::StrCat("gpus ", u.gpus, " > ", *q.gpus));
  if (q.gpu_memory && u.gpu_memory > *q.gpu_memory) {
    over.push_back(absl::StrCat("gpu_memory ", FormatByteSize(u.gpu_memory), " > ",
                                FormatByteSize(*q.gpu_memory)));
  }
  if (q.cpus && u.cpus > *q.cpus) over.push_back(absl::StrCat("cpus ", u.cpus, " > ", *q.cpus));
  if (q.memory && u.memory > *q.memory) {
    over.push_back(absl::StrCat("memory ", FormatByteSize(u.memory), " > ",
                                FormatByteSize(*q.memory)));
  }
  if (over.empty()) return "";
  return absl::StrCat("the quota of ", who, " is below current use (", absl::StrJoin(over, ", "),
                      "): existing allocations stay, new grants are refused until use drops "
                      "under it");
}
}  // namespace

absl::StatusOr<std::string> Allocator::SetQuota(const std::string& user, const Quota& quota) {
  Impl& m = *impl_;
  if (!ValidName(user)) {
    return absl::InvalidArgumentError(absl::StrCat("user \"", user, "\": not a valid user name"));
  }
  DEEPNEX_RETURN_IF_ERROR(ValidateQuota(user, quota));
  std::unique_lock<std::mutex> lock(m.mu_);
  auto it = m.quotas_.find(user);
  uint64_t seq = 0;
  if (it == m.quotas_.end() || !(it->second == quota)) {
    m.quotas_[user] = quota;
    seq = m.LogLocked(Encode(QuotaRecord{false, user, quota}));
  }
  Usage u;
  auto ui = m.usage_.find(user);
  if (ui != m.usage_.end()) u = ui->second;
  m.Pump();
  lock.unlock();
  DEEPNEX_RETURN_IF_ERROR(m.Durable(seq));
  return BelowUseNote(user, quota, u);
}

absl::StatusOr<std::string> Allocator::SetDefaultQuota(const Quota& quota) {
  Impl& m = *impl_;
  DEEPNEX_RETURN_IF_ERROR(ValidateQuota("default", quota));
  std::unique_lock<std::mutex> lock(m.mu_);
  uint64_t seq = 0;
  if (!(m.default_quota_ == quota)) {
    m.default_quota_ = quota;
    seq = m.LogLocked(Encode(QuotaRecord{true, "", quota}));
  }
  std::vector<std::string> notes;
  for (const auto& [user, u] : m.usage_) {
    if (m.quotas_.count(user)) continue;
    std::string note = BelowUseNote(user, quota, u);
    if (!note.empty()) notes.push_back(note);
  }
  std::sort(notes.begin(), notes.end());
  m.Pump();
  lock.unlock();
  DEEPNEX_RETURN_IF_ERROR(m.Durable(seq));
  return absl::StrJoin(notes, "; ");
}

absl::Status Allocator::ClearQuota(const std::string& user) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu_);
  if (!m.quotas_.count(user)) return absl::OkStatus();
  m.quotas_.erase(user);
  uint64_t seq = m.LogLocked(Encode(ClearQuotaRecord{user}));
  m.Pump();
  lock.unlock();
  return m.Durable(seq);
}

Quota Allocator::GetQuota(const std::string& user) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->QuotaFor(user);
}

Usage Allocator::GetUsage(const std::string& user) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  auto it = impl_->usage_.find(user);
  return it == impl_->usage_.end() ? Usage{} : it->second;
}

std::vector<UserQuota> Allocator::Quotas(const std::string& user) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu_);
  if (!user.empty()) return {m.QuotaEntry(user)};
  std::vector<UserQuota> out;
  UserQuota d;
  d.quota = m.default_quota_;
  out.push_back(d);
  std::set<std::string> users;
  for (const auto& [u, q] : m.quotas_) users.insert(u);
  for (const auto& [u, usage] : m.usage_) users.insert(u);
  for (const auto& u : users) out.push_back(m.QuotaEntry(u));
  return out;
}

absl::StatusOr<Allocation> Allocator::Allocate(const Request& request,
                                               const AllocateOptions& options) {
  if (request.replicas != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replicas=", request.replicas, ": Allocate grants one part; use AllocateGang"));
  }
  DEEPNEX_ASSIGN_OR_RETURN(std::vector<Allocation> parts, impl_->Allocate(request, options));
  return std::move(parts.front());
}

absl::StatusOr<std::vector<Allocation>> Allocator::AllocateGang(const Request& request,
                                                                const AllocateOptions& options) {
  return impl_->Allocate(request, options);
}

absl::Status Allocator::Release(const std::string& id) {
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    DEEPNEX_RETURN_IF_ERROR(impl_->ReleaseId(id, &seq));
  }
  return impl_->Durable(seq);
}

uint64_t Allocator::AllocateGangAsync(const Request& request, const AllocateOptions& options,
                                      AllocateDone done) {
  return impl_->AllocateAsync(request, options, std::move(done));
}

bool Allocator::Withdraw(uint64_t ticket) { return impl_->Withdraw(ticket); }

void Allocator::ReleaseAsync(const std::string& id, Done done) {
  uint64_t seq = 0;
  absl::Status s;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    s = impl_->ReleaseId(id, &seq);
  }
  if (!s.ok() || !impl_->ledger_ || seq == 0) return done(s);
  impl_->WhenDurable(seq, std::move(done));
}

absl::StatusOr<Allocation> Allocator::Renew(const std::string& id) {
  Impl& m = *impl_;
  uint64_t num;
  std::unique_lock<std::mutex> lock(m.mu_);
  auto it = ParseId(id, 'a', &num) ? m.allocs_.find(num) : m.allocs_.end();
  if (it == m.allocs_.end()) {
    return absl::NotFoundError(absl::StrCat("allocation \"", id, "\" does not exist (released, "
                                            "or its lease expired)"));
  }
  if (it->second.a.lease_ms == 0) {
    return absl::FailedPreconditionError(absl::StrCat("allocation ", id, " has no lease"));
  }
  const int64_t expires = NowMs() + it->second.a.lease_ms;
  m.ApplyRenew(num, expires);
  uint64_t seq = m.LogLocked(Encode(RenewRecord{num, expires}));
  Allocation a = it->second.a;
  lock.unlock();
  DEEPNEX_RETURN_IF_ERROR(m.Durable(seq));
  return a;
}

std::vector<NodeInfo> Allocator::Nodes() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  std::vector<NodeInfo> out;
  for (const auto& [name, n] : impl_->placement_.nodes()) out.push_back(impl_->placement_.Info(*n));
  return out;
}

absl::StatusOr<NodeInfo> Allocator::GetNode(const std::string& name) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  NodeState* n = impl_->placement_.Find(name);
  if (n == nullptr) return NoNode(name);
  return impl_->placement_.Info(*n);
}

std::vector<Allocation> Allocator::Allocations(const std::string& user) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  std::vector<Allocation> out;
  for (const auto& [num, r] : impl_->allocs_) {
    if (user.empty() || r.a.user == user) out.push_back(r.a);
  }
  return out;
}

absl::StatusOr<Allocation> Allocator::GetAllocation(const std::string& id) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  uint64_t num;
  auto it = ParseId(id, 'a', &num) ? impl_->allocs_.find(num) : impl_->allocs_.end();
  if (it == impl_->allocs_.end()) {
    return absl::NotFoundError(absl::StrCat("allocation \"", id, "\" does not exist"));
  }
  return it->second.a;
}

void Allocator::Shutdown() { impl_->Shutdown(); }

size_t Allocator::QueueLength() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->queue_.size();
}

std::vector<PendingRequest> Allocator::Pending(const std::string& user) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->Pending(user);
}

absl::Status Allocator::Compact() {
  absl::Status s;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    if (!impl_->ledger_) return absl::OkStatus();
    s = impl_->ledger_->Snapshot(impl_->SnapshotRecords());
  }
  // If writing out the log before the snapshot failed, what it held is lost
  // (a snapshot file that failed loses nothing: RollBack then does nothing).
  if (!s.ok()) impl_->RollBack();
  return s;
}

uint64_t Allocator::LedgerRecords() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->records_;
}

LedgerReport Allocator::Recovered() const {
  const LedgerRecovery& r = impl_->recovery_;  // set once, by Create
  return {r.snapshot_records, r.log_records, r.torn_records, r.torn_bytes};
}

std::string Allocator::StateDigest() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  std::string out;
  Encoder e(&out);
  for (const auto& r : impl_->SnapshotRecords()) e.Str(r);
  return out;
}

absl::Status Allocator::CheckInvariants() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->CheckInvariants();
}

}  // namespace deepnex::gpu
