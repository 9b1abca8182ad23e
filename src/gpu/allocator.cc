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
#include "gpu/ledger.h"

namespace deepnex::gpu {
namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool ValidName(const std::string& s) {
  if (s.empty() || s.size() > 253) return false;
  for (char c : s) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == '@')) {
      return false;
    }
  }
  return true;
}

std::string Selector(const std::map<std::string, std::string>& sel) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : sel) parts.push_back(absl::StrCat(k, "=", v));
  return absl::StrCat("{", absl::StrJoin(parts, ","), "}");
}

std::string NameList(const std::vector<std::string>& names, size_t max = 8) {
  std::vector<std::string> shown(names.begin(),
                                 names.begin() + std::min(names.size(), max));
  std::string s = absl::StrJoin(shown, ", ");
  if (names.size() > max) absl::StrAppend(&s, ", ... (", names.size(), " in all)");
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------

struct NodeState {
  int id = 0;
  Node spec;  // GPU indices and UUIDs filled in
  Mode mode = Mode::kExclusive;
  std::optional<Mode> pending;
  bool cordoned = false;
  bool draining = false;
  std::vector<uint64_t> used_mem;
  std::vector<int> count;
  int cpus_used = 0;
  uint64_t mem_used = 0;
  int free_gpus = 0;
  int gpu_allocs = 0;
  std::set<uint64_t> allocs;
  // What Index() inserted, so Unindex() removes exactly that.
  bool in_excl = false;
  std::pair<int, int> excl_key;
  std::vector<uint64_t> shared_free;  // per GPU: its key in shared_, 0 if absent
  uint32_t tried = 0;
};

// Capacity of one node kept for the head of the queue (Allocator::Impl::Reserve).
struct Hold {
  int cpus = 0;
  uint64_t memory = 0;
  // Per GPU position (empty: none): memory held; a held exclusive GPU is
  // held whole.
  std::vector<uint64_t> gpu;
};

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
    if (by_name_.count(r.spec.name)) {
      return absl::DataLossError(absl::StrCat("node ", r.spec.name, " added twice"));
    }
    auto n = std::make_unique<NodeState>();
    n->spec = std::move(r.spec);
    n->mode = n->spec.mode;
    n->pending = r.pending;
    n->cordoned = r.cordoned;
    n->draining = r.draining;
    ApplyAddNode(std::move(n));
    return absl::OkStatus();
  }

  absl::Status Replay(RemoveNodeRecord r) {
    NodeState* n = FindNode(r.name);
    if (n == nullptr || !n->allocs.empty()) {
      return absl::DataLossError(absl::StrCat("remove of unknown or busy node ", r.name));
    }
    ApplyRemoveNode(n);
    return absl::OkStatus();
  }

  absl::Status Replay(ModeRecord r) {
    NodeState* n = FindNode(r.name);
    if (n == nullptr) return absl::DataLossError(absl::StrCat("mode of unknown node ", r.name));
    ApplySetMode(n, r.mode, r.pending);
    return absl::OkStatus();
  }

  absl::Status Replay(FlagsRecord r) {
    NodeState* n = FindNode(r.name);
    if (n == nullptr) return absl::DataLossError(absl::StrCat("flags of unknown node ", r.name));
    ApplyNodeFlags(n, r.cordoned, r.draining);
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
      NodeState* n = FindNode(r.a.node);
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

  NodeState* FindNode(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
  }

  void Unindex(NodeState* n) {
    if (n->in_excl) excl_.erase(n->excl_key);
    n->in_excl = false;
    for (size_t i = 0; i < n->shared_free.size(); ++i) {
      if (n->shared_free[i] > 0) shared_.erase({n->shared_free[i], n->id, static_cast<int>(i)});
      n->shared_free[i] = 0;
    }
  }

  void Index(NodeState* n) {
    if (n->cordoned || n->pending) return;
    if (n->mode == Mode::kExclusive) {
      if (n->free_gpus > 0) {
        n->excl_key = {n->free_gpus, n->id};
        excl_.insert(n->excl_key);
        n->in_excl = true;
      }
    } else {
      for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
        uint64_t free = n->spec.gpus[i].memory - n->used_mem[i];
        n->shared_free[i] = free;
        if (free > 0) shared_.emplace(free, n->id, static_cast<int>(i));
      }
    }
  }

  // A grant or release on a shared node that stays schedulable only moves the
  // keys of the GPUs it touched (the hot path; Unindex/Index move them all).
  bool FastReindex(const NodeState* n) const {
    return n->mode == Mode::kShared && !n->cordoned && !n->pending;
  }
  void ReindexGpu(NodeState* n, int i) {
    uint64_t& key = n->shared_free[i];
    if (key > 0) shared_.erase({key, n->id, i});
    key = n->spec.gpus[i].memory - n->used_mem[i];
    if (key > 0) shared_.emplace(key, n->id, i);
  }

  void ApplyAddNode(std::unique_ptr<NodeState> n) {
    const size_t g = n->spec.gpus.size();
    n->shared_free.assign(g, 0);
    n->used_mem.assign(g, 0);
    n->count.assign(g, 0);
    n->free_gpus = static_cast<int>(g);
    n->id = static_cast<int>(slots_.size());
    for (const auto& gpu : n->spec.gpus) uuids_[gpu.uuid] = n->spec.name;
    by_name_[n->spec.name] = n.get();
    Index(n.get());
    slots_.push_back(std::move(n));
  }

  void ApplyRemoveNode(NodeState* n) {
    Unindex(n);
    for (const auto& gpu : n->spec.gpus) uuids_.erase(gpu.uuid);
    by_name_.erase(n->spec.name);
    slots_[n->id].reset();
  }

  void ApplySetMode(NodeState* n, Mode mode, bool pending) {
    Unindex(n);
    if (pending) {
      n->pending = mode;
    } else {
      n->mode = mode;
      n->spec.mode = mode;
      n->pending.reset();
    }
    Index(n);
  }

  void ApplyNodeFlags(NodeState* n, bool cordoned, bool draining) {
    Unindex(n);
    n->cordoned = cordoned;
    n->draining = draining;
    Index(n);
  }

  void FillAllocation(const NodeState& n, AllocRec* r) const {
    Allocation& a = r->a;
    a.id = AllocId(r->num);
    std::vector<std::string> idx, uuids;
    bool shared = false;
    for (size_t i = 0; i < r->pos.size(); ++i) {
      const Gpu& g = n.spec.gpus[r->pos[i]];
      a.gpus[i].index = g.index;
      a.gpus[i].uuid = g.uuid;
      idx.push_back(std::to_string(g.index));
      uuids.push_back(g.uuid);
      shared |= !a.gpus[i].exclusive;
    }
    a.env.clear();
    a.env["CUDA_VISIBLE_DEVICES"] = absl::StrJoin(idx, ",");
    a.env["NVIDIA_VISIBLE_DEVICES"] = uuids.empty() ? "void" : absl::StrJoin(uuids, ",");
    if (shared) a.env["DEEPNEX_GPU_MEMORY_LIMIT"] = std::to_string(a.gpus[0].memory);
  }

  void ApplyGrant(AllocRec r) {
    NodeState* n = FindNode(r.a.node);
    FillAllocation(*n, &r);
    const bool fast = FastReindex(n);
    if (!fast) Unindex(n);
    Usage& u = usage_[r.a.user];
    for (size_t i = 0; i < r.pos.size(); ++i) {
      int p = r.pos[i];
      if (n->count[p] == 0) --n->free_gpus;
      ++n->count[p];
      n->used_mem[p] += r.a.gpus[i].memory;
      u.gpu_memory += r.a.gpus[i].memory;
    }
    u.gpus += static_cast<int64_t>(r.pos.size());
    u.cpus += r.a.cpus;
    u.memory += r.a.memory;
    n->cpus_used += r.a.cpus;
    n->mem_used += r.a.memory;
    if (!r.pos.empty()) ++n->gpu_allocs;
    n->allocs.insert(r.num);
    if (fast) {
      for (int p : r.pos) ReindexGpu(n, p);
    } else {
      Index(n);
    }
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
    NodeState* n = FindNode(r.a.node);
    const bool fast = FastReindex(n);
    if (!fast) Unindex(n);
    Usage& u = usage_[r.a.user];
    for (size_t i = 0; i < r.pos.size(); ++i) {
      int p = r.pos[i];
      --n->count[p];
      if (n->count[p] == 0) ++n->free_gpus;
      n->used_mem[p] -= r.a.gpus[i].memory;
      u.gpu_memory -= r.a.gpus[i].memory;
    }
    u.gpus -= static_cast<int64_t>(r.pos.size());
    u.cpus -= r.a.cpus;
    u.memory -= r.a.memory;
    if (u.gpus == 0 && u.cpus == 0 && u.memory == 0 && u.gpu_memory == 0) usage_.erase(r.a.user);
    n->cpus_used -= r.a.cpus;
    n->mem_used -= r.a.memory;
    if (!r.pos.empty()) --n->gpu_allocs;
    n->allocs.erase(num);
    if (fast) {
      for (int p : r.pos) ReindexGpu(n, p);
    } else {
      Index(n);
    }
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
    slots_.clear();
    by_name_.clear();
    uuids_.clear();
    excl_.clear();
    shared_.clear();
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
    for (const auto& [name, n] : by_name_) out.push_back(Encode(RecordOf(*n)));
    if (!(default_quota_ == Quota{})) {
      out.push_back(Encode(QuotaRecord{true, "", default_quota_}));
    }
    for (const auto& [user, q] : quotas_) out.push_back(Encode(QuotaRecord{false, user, q}));
    for (const auto& [num, r] : allocs_) out.push_back(Encode(GrantRecord{{r}}));
    out.push_back(Encode(NextIdsRecord{next_id_, next_gang_}));
    return out;
  }

  // ---- validation

  absl::Status ValidateNode(Node* node) const {
    const std::string& name = node->name;
    if (!ValidName(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "node name \"", name, "\": use 1-253 letters, digits, '-', '_', '.'"));
    }
    if (FindNode(name) != nullptr) {
      return absl::AlreadyExistsError(absl::StrCat("node ", name, " already exists"));
    }
    if (node->cpus <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", name, ": cpus=", node->cpus, " must be positive"));
    }
    if (node->memory == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", name, ": memory=0 must be positive"));
    }
    std::set<int> indices;
    std::set<std::string> uuids;
    for (size_t i = 0; i < node->gpus.size(); ++i) {
      Gpu& g = node->gpus[i];
      if (g.memory == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("node ", name, ": gpus[", i, "].memory=0 must be positive"));
      }
      if (g.index < 0) g.index = static_cast<int>(i);
      if (!indices.insert(g.index).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("node ", name, ": gpus[", i, "].index=", g.index, " is used twice"));
      }
      if (g.uuid.empty()) g.uuid = absl::StrCat("GPU-", name, "-", g.index);
      if (!uuids.insert(g.uuid).second) {
        return absl::AlreadyExistsError(
            absl::StrCat("node ", name, ": gpus[", i, "].uuid=", g.uuid, " is used twice"));
      }
      auto other = uuids_.find(g.uuid);
      if (other != uuids_.end()) {
        return absl::AlreadyExistsError(absl::StrCat("node ", name, ": gpus[", i, "].uuid=",
                                                     g.uuid, " is already on node ",
                                                     other->second));
      }
    }
    for (const auto& [k, v] : node->labels) {
      if (k.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("node ", name, ": a label has an empty key"));
      }
    }
    return absl::OkStatus();
  }

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

  // ---- placement

  // What is free on `n` for others than the head of the queue: its free
  // capacity less what held_ keeps for the head there.
  const Hold* HoldOn(const NodeState* n) const {
    if (held_.empty()) return nullptr;
    auto it = held_.find(n);
    return it == held_.end() ? nullptr : &it->second;
  }
  static int FreeCpus(const NodeState* n, const Hold* h) {
    return n->spec.cpus - n->cpus_used - (h ? h->cpus : 0);
  }
  static uint64_t FreeMemory(const NodeState* n, const Hold* h) {
    const uint64_t free = n->spec.memory - n->mem_used, held = h ? h->memory : 0;
    return free > held ? free - held : 0;
  }
  static uint64_t FreeGpuMemory(const NodeState* n, const Hold* h, int i) {
    const uint64_t free = n->spec.gpus[i].memory - n->used_mem[i];
    const uint64_t held = h && !h->gpu.empty() ? h->gpu[i] : 0;
    return free > held ? free - held : 0;
  }
  static bool GpuHeld(const Hold* h, int i) { return h && !h->gpu.empty() && h->gpu[i] > 0; }

  bool FitOnNode(NodeState* n, const Request& r, std::vector<int>* pos) const {
    if (n->cordoned) return false;
    const Hold* h = HoldOn(n);
    if (FreeCpus(n, h) < r.cpus) return false;
    if (FreeMemory(n, h) < r.memory) return false;
    for (const auto& [k, v] : r.selector) {
      auto it = n->spec.labels.find(k);
      if (it == n->spec.labels.end() || it->second != v) return false;
    }
    pos->clear();
    if (r.gpus == 0) return true;
    if (n->pending || n->mode != r.mode) return false;
    const auto& gpus = n->spec.gpus;
    std::vector<int> cand;
    cand.reserve(gpus.size());
    const bool excl = r.mode == Mode::kExclusive;
    for (size_t i = 0; i < gpus.size(); ++i) {
      const int k = static_cast<int>(i);
      if (excl ? (n->count[i] == 0 && gpus[i].memory >= r.gpu_memory && !GpuHeld(h, k))
               : (FreeGpuMemory(n, h, k) >= r.gpu_memory)) {
        cand.push_back(k);
      }
    }
    if (static_cast<int>(cand.size()) < r.gpus) return false;
    if (!excl) {
      // Best fit: the GPUs with the least free memory that still fits (most
      // free when spreading); index order breaks ties.
      auto free = [&](int i) { return FreeGpuMemory(n, h, i); };
      auto before = [&](int a, int b) { return r.spread ? free(a) > free(b) : free(a) < free(b); };
      for (size_t i = 1; i < cand.size(); ++i) {  // stable insertion sort: few GPUs
        int x = cand[i];
        size_t j = i;
        for (; j > 0 && before(x, cand[j - 1]); --j) cand[j] = cand[j - 1];
        cand[j] = x;
      }
    }
    if (r.gpus > 1) {
      // Prefer one switch, then one NUMA node: the smallest group that holds
      // the whole request keeps larger groups whole for larger requests.
      for (int level = 0; level < 2; ++level) {
        std::map<int, std::vector<int>> groups;
        for (int i : cand) {
          int key = level == 0 ? gpus[i].switch_id : gpus[i].numa_node;
          if (key >= 0) groups[key].push_back(i);
        }
        const std::vector<int>* best = nullptr;
        for (const auto& [key, members] : groups) {
          if (static_cast<int>(members.size()) >= r.gpus &&
              (best == nullptr || members.size() < best->size())) {
            best = &members;
          }
        }
        if (best != nullptr) {
          pos->assign(best->begin(), best->begin() + r.gpus);
          return true;
        }
      }
    }
    pos->assign(cand.begin(), cand.begin() + r.gpus);
    return true;
  }

  NodeState* FindPlacement(const Request& r, std::vector<int>* pos) {
    if (!r.node.empty()) {
      NodeState* n = FindNode(r.node);
      return n != nullptr && FitOnNode(n, r, pos) ? n : nullptr;
    }
    if (r.gpus == 0) {
      NodeState* best = nullptr;
      for (const auto& slot : slots_) {
        NodeState* n = slot.get();
        if (n == nullptr || !FitOnNode(n, r, pos)) continue;
        if (!r.spread) return n;
        if (best == nullptr || n->spec.cpus - n->cpus_used > best->spec.cpus - best->cpus_used) {
          best = n;
        }
      }
      if (best != nullptr) FitOnNode(best, r, pos);
      return best;
    }
    if (r.mode == Mode::kExclusive) {
      if (!r.spread) {
        for (auto it = excl_.lower_bound({r.gpus, INT_MIN}); it != excl_.end(); ++it) {
          NodeState* n = slots_[it->second].get();
          if (FitOnNode(n, r, pos)) return n;
        }
      } else {
        for (auto it = excl_.rbegin(); it != excl_.rend() && it->first >= r.gpus; ++it) {
          NodeState* n = slots_[it->second].get();
          if (FitOnNode(n, r, pos)) return n;
        }
      }
      return nullptr;
    }
    const uint32_t gen = ++try_gen_;
    auto visit = [&](int id) -> NodeState* {
      NodeState* n = slots_[id].get();
      if (n->tried == gen) return nullptr;
      n->tried = gen;
      return FitOnNode(n, r, pos) ? n : nullptr;
    };
    if (!r.spread) {
      for (auto it = shared_.lower_bound({r.gpu_memory, INT_MIN, INT_MIN}); it != shared_.end();
           ++it) {
        if (NodeState* n = visit(std::get<1>(*it))) return n;
      }
    } else {
      for (auto it = shared_.rbegin(); it != shared_.rend() && std::get<0>(*it) >= r.gpu_memory;
           ++it) {
        if (NodeState* n = visit(std::get<1>(*it))) return n;
      }
    }
    return nullptr;
  }

  // `n` could take a part of `r` by its name, labels, state and mode.
  static bool Eligible(const NodeState& n, const Request& r) {
    if (!r.node.empty() && n.spec.name != r.node) return false;
    for (const auto& [k, v] : r.selector) {
      auto it = n.spec.labels.find(k);
      if (it == n.spec.labels.end() || it->second != v) return false;
    }
    return !n.cordoned && (r.gpus == 0 || (!n.pending && n.mode == r.mode));
  }

  // Under mu_: keeps the capacity that the head of the queue `r` needs out of
  // others' reach (held_), part by part, on its best node: of the nodes that
  // could ever hold the part, the one where least of it is missing now (GPUs,
  // then cpus, then memory). Exclusive GPUs are held whole, free ones first;
  // a busy one is held too, so that it is the head's when it frees.
  void Reserve(const Request& r) {
    const bool excl = r.mode == Mode::kExclusive;
    for (int part = 0; part < r.replicas; ++part) {
      NodeState* best = nullptr;
      std::tuple<int, int, uint64_t> best_missing;
      std::vector<int> best_gpus;
      for (const auto& [name, n] : by_name_) {
        if (!Eligible(*n, r)) continue;
        const Hold* h = HoldOn(n);
        const int held_cpus = h ? h->cpus : 0;
        const uint64_t held_memory = h ? h->memory : 0;
        if (n->spec.cpus - held_cpus < r.cpus || n->spec.memory < held_memory ||
            n->spec.memory - held_memory < r.memory) {
          continue;
        }
        // GPUs it could ever take, those free now first (most free memory
        // first when shared).
        std::vector<int> gpus;
        int ready = 0;
        for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
          const int k = static_cast<int>(i);
          const uint64_t memory = n->spec.gpus[i].memory;
          if (excl) {
            if (memory < r.gpu_memory || GpuHeld(h, k)) continue;
            ready += n->count[i] == 0;
          } else {
            const uint64_t held = h && !h->gpu.empty() ? h->gpu[i] : 0;
            if (memory - std::min(memory, held) < r.gpu_memory) continue;
            ready += FreeGpuMemory(n, h, k) >= r.gpu_memory;
          }
          gpus.push_back(k);
        }
        if (static_cast<int>(gpus.size()) < r.gpus) continue;
        std::stable_sort(gpus.begin(), gpus.end(), [&](int a, int b) {
          if (excl) return n->count[a] == 0 && n->count[b] != 0;
          return FreeGpuMemory(n, h, a) > FreeGpuMemory(n, h, b);
        });
        gpus.resize(r.gpus);
        const uint64_t free_memory = FreeMemory(n, h);
        std::tuple<int, int, uint64_t> missing{
            std::max(0, r.gpus - ready), std::max(0, r.cpus - FreeCpus(n, h)),
            r.memory > free_memory ? r.memory - free_memory : 0};
        if (best == nullptr || missing < best_missing) {
          best = n;
          best_missing = missing;
          best_gpus = std::move(gpus);
        }
      }
      if (best == nullptr) return;  // Infeasible refuses it at its next try
      Hold& h = held_[best];
      h.cpus += r.cpus;
      h.memory += r.memory;
      h.gpu.resize(best->spec.gpus.size(), 0);
      for (int i : best_gpus) h.gpu[i] += excl ? best->spec.gpus[i].memory : r.gpu_memory;
    }
  }

  // Under mu_: reserves for `head`, the first request of the queue, once it
  // has waited reservation_after.
  void HoldFor(const Waiter& head) {
    if (std::chrono::steady_clock::now() - head.queued_at >= options_.reservation_after) {
      Reserve(head.request);
    }
  }

  bool HeadReserved() const {
    if (queue_.empty()) return false;
    const auto waited = std::chrono::steady_clock::now() - queue_.begin()->second->queued_at;
    return waited >= options_.reservation_after;
  }

  std::string Describe(const Request& r) const {
    std::string s = absl::StrCat(r.user, " asks ");
    if (r.replicas > 1) absl::StrAppend(&s, r.replicas, " x (");
    absl::StrAppend(&s, r.gpus, " ", ModeName(r.mode), " GPUs");
    if (r.gpu_memory > 0) absl::StrAppend(&s, " of ", FormatByteSize(r.gpu_memory));
    absl::StrAppend(&s, ", ", r.cpus, " cpus, ", FormatByteSize(r.memory), " memory");
    if (r.replicas > 1) absl::StrAppend(&s, ")");
    return s;
  }

  // Why `r` can never be granted, or OK when it could be once capacity frees.
  absl::Status Infeasible(const Request& r) const {
    if (by_name_.empty()) {
      return absl::FailedPreconditionError("the allocator has no nodes (add one with AddNode)");
    }
    if (r.gpus > 0) {
      uint64_t largest = 0;
      for (const auto& [name, n] : by_name_) {
        for (const auto& g : n->spec.gpus) largest = std::max(largest, g.memory);
      }
      if (r.gpu_memory > largest) {
        return absl::InvalidArgumentError(absl::StrCat(
            "gpu_memory=", FormatByteSize(r.gpu_memory), " is larger than any GPU (the largest has ",
            FormatByteSize(largest), ")"));
      }
    }
    std::vector<const NodeState*> matched;
    if (!r.node.empty()) {
      const NodeState* n = FindNode(r.node);
      if (n == nullptr) {
        return absl::NotFoundError(absl::StrCat("node: no node named \"", r.node, "\""));
      }
      matched.push_back(n);
    } else {
      for (const auto& [name, n] : by_name_) matched.push_back(n);
    }
    std::vector<const NodeState*> labeled;
    for (const NodeState* n : matched) {
      bool ok = true;
      for (const auto& [k, v] : r.selector) {
        auto it = n->spec.labels.find(k);
        ok &= it != n->spec.labels.end() && it->second == v;
      }
      if (ok) labeled.push_back(n);
    }
    if (labeled.empty()) {
      return absl::NotFoundError(absl::StrCat("selector ", Selector(r.selector), ": no ",
                                              r.node.empty() ? "node" : "such node",
                                              " has these labels"));
    }
    std::vector<const NodeState*> moded;
    std::vector<std::string> other;
    for (const NodeState* n : labeled) {
      if (r.gpus == 0 || n->mode == r.mode || (n->pending && *n->pending == r.mode)) {
        moded.push_back(n);
      } else {
        other.push_back(n->spec.name);
      }
    }
    if (moded.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "mode=", ModeName(r.mode), ": a ", ModeName(r.mode), " request needs ",
          r.mode == Mode::kExclusive ? "an " : "a ", ModeName(r.mode), " node, and every node that could take it is ",
          ModeName(r.mode == Mode::kShared ? Mode::kExclusive : Mode::kShared), " (",
          NameList(other), ")"));
    }
    for (const NodeState* n : moded) {
      int fits = 0;
      for (const auto& g : n->spec.gpus) fits += g.memory >= r.gpu_memory;
      if (n->spec.cpus >= r.cpus && n->spec.memory >= r.memory && fits >= r.gpus) {
        return absl::OkStatus();
      }
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "no node can ever hold this request (", Describe(r), " per part): ", moded.size(),
        " node(s) match, none has that many GPUs, cpus and memory"));
  }

  // Under mu_: why one part of queued request `r` does not fit now, naming
  // the resource that is short on the nodes that could take it; empty when
  // one part fits (it waits only for its turn).
  std::string Shortage(const Request& r) const {
    const bool excl = r.mode == Mode::kExclusive;
    int matching = 0, eligible = 0, most_gpus = 0, most_cpus = 0;
    uint64_t most_memory = 0;
    bool fits = false;
    for (const auto& [name, n] : by_name_) {
      if (!r.node.empty() && name != r.node) continue;
      bool labeled = true;
      for (const auto& [k, v] : r.selector) {
        auto it = n->spec.labels.find(k);
        labeled &= it != n->spec.labels.end() && it->second == v;
      }
      if (!labeled) continue;
      ++matching;
      if (n->cordoned || (r.gpus > 0 && (n->pending || n->mode != r.mode))) continue;
      ++eligible;
      int gpus = 0;
      for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
        const uint64_t memory = n->spec.gpus[i].memory;
        gpus += excl ? (n->count[i] == 0 && memory >= r.gpu_memory)
                     : (memory - n->used_mem[i] >= r.gpu_memory);
      }
      const int cpus = n->spec.cpus - n->cpus_used;
      const uint64_t memory = n->spec.memory - n->mem_used;
      most_gpus = std::max(most_gpus, gpus);
      most_cpus = std::max(most_cpus, cpus);
      most_memory = std::max(most_memory, memory);
      fits |= gpus >= r.gpus && cpus >= r.cpus && memory >= r.memory;
    }
    if (eligible == 0) {
      return absl::StrCat("waiting for a node to take it (", matching,
                          " matching node(s), all cordoned or switching mode)");
    }
    if (fits) {
      if (r.replicas == 1) return "";
      return absl::StrCat("waiting for room for all ", r.replicas, " parts of the gang at once");
    }
    auto free = [](const std::string& most, bool none) {
      return none ? std::string(" (0 free on any eligible node)")
                  : absl::StrCat(" (at most ", most, " free on an eligible node)");
    };
    std::vector<std::string> short_of;
    if (r.gpus > most_gpus) {
      std::string gpus =
          absl::StrCat(r.gpus, " ", ModeName(r.mode), " GPU", r.gpus == 1 ? "" : "s");
      if (!excl) absl::StrAppend(&gpus, " with ", FormatByteSize(r.gpu_memory), " free");
      short_of.push_back(gpus + free(std::to_string(most_gpus), most_gpus == 0));
    }
    if (r.cpus > most_cpus) {
      short_of.push_back(absl::StrCat(r.cpus, " cpus", free(std::to_string(most_cpus),
                                                             most_cpus == 0)));
    }
    if (r.memory > most_memory) {
      short_of.push_back(absl::StrCat(FormatByteSize(r.memory), " memory",
                                      free(FormatByteSize(most_memory), most_memory == 0)));
    }
    if (short_of.empty()) {
      // Each resource is free somewhere, but on no node all together.
      std::vector<std::string> asked;
      if (r.gpus > 0) asked.push_back(absl::StrCat(r.gpus, " ", ModeName(r.mode), " GPUs"));
      if (r.cpus > 0) asked.push_back(absl::StrCat(r.cpus, " cpus"));
      if (r.memory > 0) asked.push_back(absl::StrCat(FormatByteSize(r.memory), " memory"));
      return absl::StrCat("waiting for one node with ", absl::StrJoin(asked, ", "),
                          " free at once");
    }
    return absl::StrCat("waiting for ", absl::StrJoin(short_of, " and "));
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
      std::string short_of = Shortage(w->request);
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
      NodeState* n = FindPlacement(r, &pos);
      if (n == nullptr) {
        for (uint64_t num : placed) ApplyRelease(num);
        next_id_ = saved_id;
        next_gang_ = saved_gang;
        absl::Status why = Infeasible(r);
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
    held_.clear();
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
    held_.clear();
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
      if (it != allocs_.end()) touched.insert(FindNode(it->second.a.node));
      ApplyRelease(num);
    }
    uint64_t seq = ledger_ ? LogLocked(Encode(ReleaseRecord{nums, reason})) : 0;
    for (NodeState* n : touched) {
      if (n->pending && n->gpu_allocs == 0) {
        Mode m = *n->pending;
        ApplySetMode(n, m, false);
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

  NodeInfo InfoOf(const NodeState& n) const {
    NodeInfo info;
    info.node = n.spec;
    info.node.mode = n.mode;
    info.mode = n.mode;
    info.pending_mode = n.pending;
    info.cordoned = n.cordoned;
    info.draining = n.draining;
    info.gpu_memory_used = n.used_mem;
    info.gpu_allocations = n.count;
    info.cpus_used = n.cpus_used;
    info.memory_used = n.mem_used;
    for (uint64_t num : n.allocs) info.allocation_ids.push_back(AllocId(num));
    return info;
  }

  absl::Status CheckInvariants() const {
    auto fail = [](auto... parts) { return absl::InternalError(absl::StrCat(parts...)); };
    std::map<const NodeState*, std::vector<uint64_t>> mem;
    std::map<const NodeState*, std::vector<int>> count, excl;
    std::map<const NodeState*, std::pair<int64_t, uint64_t>> host;
    std::map<std::string, Usage> usage;
    for (const auto& [name, n] : by_name_) {
      mem[n].assign(n->spec.gpus.size(), 0);
      count[n].assign(n->spec.gpus.size(), 0);
      excl[n].assign(n->spec.gpus.size(), 0);
      host[n] = {0, 0};
    }
    for (const auto& [num, r] : allocs_) {
      const NodeState* n = FindNode(r.a.node);
      if (n == nullptr) return fail(r.a.id, " is on unknown node ", r.a.node);
      if (!n->allocs.count(num)) return fail(r.a.id, " missing from node ", r.a.node);
      Usage& u = usage[r.a.user];
      for (size_t i = 0; i < r.pos.size(); ++i) {
        int p = r.pos[i];
        mem[n][p] += r.a.gpus[i].memory;
        ++count[n][p];
        if (r.a.gpus[i].exclusive) {
          ++excl[n][p];
          if (r.a.gpus[i].memory != n->spec.gpus[p].memory) {
            return fail(r.a.id, ": exclusive GPU ", p, " granted with partial memory");
          }
        }
        u.gpu_memory += r.a.gpus[i].memory;
      }
      u.gpus += r.pos.size();
      u.cpus += r.a.cpus;
      u.memory += r.a.memory;
      host[n].first += r.a.cpus;
      host[n].second += r.a.memory;
    }
    std::set<std::pair<int, int>> want_excl;
    std::set<std::tuple<uint64_t, int, int>> want_shared;
    for (const auto& [name, n] : by_name_) {
      int free = 0, gpu_allocs = 0;
      for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
        if (excl[n][i] > 0 && count[n][i] != 1) {
          return fail("node ", name, " GPU ", i, " is exclusive and held by ", count[n][i],
                      " allocations");
        }
        if (mem[n][i] > n->spec.gpus[i].memory) {
          return fail("node ", name, " GPU ", i, " is overcommitted: ", mem[n][i], " > ",
                      n->spec.gpus[i].memory);
        }
        if (mem[n][i] != n->used_mem[i] || count[n][i] != n->count[i]) {
          return fail("node ", name, " GPU ", i, " counters disagree with its allocations");
        }
        free += count[n][i] == 0;
      }
      for (uint64_t num : n->allocs) gpu_allocs += !allocs_.at(num).pos.empty();
      if (free != n->free_gpus || gpu_allocs != n->gpu_allocs) {
        return fail("node ", name, " free GPU / allocation counters are wrong");
      }
      if (host[n].first != n->cpus_used || host[n].second != n->mem_used ||
          n->cpus_used > n->spec.cpus || n->mem_used > n->spec.memory) {
        return fail("node ", name, " cpu/memory accounting is wrong: cpus ", n->cpus_used, "/",
                    n->spec.cpus);
      }
      if (n->allocs.size() != static_cast<size_t>(std::count_if(
                                  allocs_.begin(), allocs_.end(),
                                  [&](const auto& kv) { return kv.second.a.node == name; }))) {
        return fail("node ", name, " allocation list is wrong");
      }
      if (n->cordoned || n->pending) continue;
      if (n->mode == Mode::kExclusive) {
        if (free > 0) want_excl.emplace(free, n->id);
        for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
          if (count[n][i] > 0 && excl[n][i] == 0) {
            return fail("node ", name, " is exclusive and GPU ", i, " is shared");
          }
        }
      } else {
        for (size_t i = 0; i < n->spec.gpus.size(); ++i) {
          uint64_t f = n->spec.gpus[i].memory - mem[n][i];
          if (f > 0) want_shared.emplace(f, n->id, static_cast<int>(i));
        }
      }
    }
    if (want_excl != excl_ || want_shared != shared_) return fail("placement index is stale");
    for (const auto& [user, u] : usage) {
      auto it = usage_.find(user);
      if (it == usage_.end() || it->second.gpus != u.gpus || it->second.cpus != u.cpus ||
          it->second.memory != u.memory || it->second.gpu_memory != u.gpu_memory) {
        return fail("usage of ", user, " is wrong");
      }
    }
    if (usage.size() != usage_.size()) return fail("usage has stale users");
    return absl::OkStatus();
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

  std::vector<std::unique_ptr<NodeState>> slots_;  // by NodeState::id
  std::map<std::string, NodeState*> by_name_;
  std::unordered_map<std::string, std::string> uuids_;  // GPU UUID -> node
  std::set<std::pair<int, int>> excl_;                  // (free GPUs, node id)
  std::set<std::tuple<uint64_t, int, int>> shared_;     // (free memory, node id, GPU)
  uint32_t try_gen_ = 0;

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
  // The head's reservation (Reserve), per node; set only while Pump or Admit
  // places the requests behind the head.
  std::unordered_map<const NodeState*, Hold> held_;
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
  DEEPNEX_RETURN_IF_ERROR(m.ValidateNode(&spec));
  auto n = std::make_unique<NodeState>();
  n->spec = std::move(spec);
  n->mode = n->spec.mode;
  NodeState* raw = n.get();
  m.ApplyAddNode(std::move(n));
  uint64_t seq = m.LogLocked(Encode(m.RecordOf(*raw)));
  m.Pump();
  lock.unlock();
  return m.Durable(seq);
}

absl::Status Allocator::RemoveNode(const std::string& name) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu_);
  NodeState* n = m.FindNode(name);
  if (n == nullptr) return NoNode(name);
  if (!n->allocs.empty()) {
    std::vector<std::string> ids;
    for (uint64_t num : n->allocs) ids.push_back(AllocId(num));
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", name, " is not empty: it holds ", NameList(ids),
        "; release or drain them first"));
  }
  m.ApplyRemoveNode(n);
  uint64_t seq = m.LogLocked(Encode(RemoveNodeRecord{name}));
  // Requests that only this node could hold can never be granted now.
  m.Pump();
  for (auto it = m.queue_.begin(); it != m.queue_.end();) {
    absl::Status why = m.Infeasible(it->second->request);
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
  NodeState* n = m.FindNode(name);
  if (n == nullptr) return NoNode(name);
  if (n->mode == mode) {
    if (!n->pending) return absl::OkStatus();
    m.ApplySetMode(n, mode, false);  // cancels the pending switch
  } else if (n->gpu_allocs == 0) {
    m.ApplySetMode(n, mode, false);
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
    m.ApplySetMode(n, mode, true);
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
  NodeState* n = m.FindNode(name);
  if (n == nullptr) return NoNode(name);
  if (keep_draining) draining = n->draining;
  uint64_t seq = 0;
  if (n->cordoned != cordoned || n->draining != draining) {
    m.ApplyNodeFlags(n, cordoned, draining);
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
  for (const auto& [name, n] : impl_->by_name_) out.push_back(impl_->InfoOf(*n));
  return out;
}

absl::StatusOr<NodeInfo> Allocator::GetNode(const std::string& name) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  NodeState* n = impl_->FindNode(name);
  if (n == nullptr) return NoNode(name);
  return impl_->InfoOf(*n);
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
