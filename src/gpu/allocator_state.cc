#include "gpu/allocator_state.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "deepnex/units.h"
#include "gpu/invariants.h"

namespace deepnex::gpu {
namespace {

// a * b, or 2^64-1 past it: a request's total, compared with a quota.
uint64_t Times(uint64_t a, uint64_t b) {
  uint64_t p;
  return __builtin_mul_overflow(a, b, &p) ? UINT64_MAX : p;
}

}  // namespace

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

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

// ---- records (replay; live changes call the same Apply* functions)

absl::Status AllocatorState::Apply(const std::string& record) {
  Record decoded;
  DEEPNEX_RETURN_IF_ERROR(DecodeRecord(record, &decoded));
  return std::visit([this](auto&& r) { return Replay(std::move(r)); }, std::move(decoded));
}

absl::Status AllocatorState::Replay(NodeRecord r) {
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

absl::Status AllocatorState::Replay(RemoveNodeRecord r) {
  NodeState* n = placement_.Find(r.name);
  if (n == nullptr || !n->allocs.empty()) {
    return absl::DataLossError(absl::StrCat("remove of unknown or busy node ", r.name));
  }
  placement_.Remove(n);
  return absl::OkStatus();
}

absl::Status AllocatorState::Replay(ModeRecord r) {
  NodeState* n = placement_.Find(r.name);
  if (n == nullptr) return absl::DataLossError(absl::StrCat("mode of unknown node ", r.name));
  placement_.SetMode(n, r.mode, r.pending);
  return absl::OkStatus();
}

absl::Status AllocatorState::Replay(FlagsRecord r) {
  NodeState* n = placement_.Find(r.name);
  if (n == nullptr) return absl::DataLossError(absl::StrCat("flags of unknown node ", r.name));
  placement_.SetFlags(n, r.cordoned, r.draining);
  return absl::OkStatus();
}

absl::Status AllocatorState::Replay(QuotaRecord r) {
  if (r.is_default) {
    default_quota_ = r.quota;
  } else {
    quotas_[r.user] = r.quota;
  }
  return absl::OkStatus();
}

absl::Status AllocatorState::Replay(ClearQuotaRecord r) {
  quotas_.erase(r.user);
  return absl::OkStatus();
}

absl::Status AllocatorState::Replay(GrantRecord grant) {
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

absl::Status AllocatorState::Replay(ReleaseRecord r) {
  for (uint64_t num : r.nums) ApplyRelease(num);
  return absl::OkStatus();
}

absl::Status AllocatorState::Replay(RenewRecord r) {
  ApplyRenew(r.num, r.expires_at_ms);
  return absl::OkStatus();
}

absl::Status AllocatorState::Replay(NextIdsRecord r) {
  next_id_ = std::max(next_id_, r.next_id);
  next_gang_ = std::max(next_gang_, r.next_gang);
  return absl::OkStatus();
}

void AllocatorState::ApplyGrant(AllocRec r) {
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

void AllocatorState::ApplyRelease(uint64_t num) {
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

void AllocatorState::ApplyRenew(uint64_t num, int64_t expires_at_ms) {
  auto it = allocs_.find(num);
  if (it == allocs_.end()) return;
  Allocation& a = it->second.a;
  if (a.expires_at_ms > 0) leases_.erase({a.expires_at_ms, num});
  a.expires_at_ms = expires_at_ms;
  leases_.emplace(expires_at_ms, num);
}

void AllocatorState::Clear() {
  placement_.Clear();
  allocs_.clear();
  gangs_.clear();
  usage_.clear();
  quotas_.clear();
  default_quota_ = Quota{};
  next_id_ = next_gang_ = 1;
  leases_.clear();
}

std::vector<std::string> AllocatorState::SnapshotRecords() const {
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

NodeRecord AllocatorState::RecordOf(const NodeState& n) {
  NodeRecord r;
  r.spec = n.spec;
  r.spec.mode = n.mode;
  r.pending = n.pending;
  r.cordoned = n.cordoned;
  r.draining = n.draining;
  return r;
}

Outcome AllocatorState::Grant(const Request& r, std::vector<uint64_t>* granted,
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
                              shared ? Times(r.gpu_memory, uint64_t(r.gpus) * parts) : 0,
                              int64_t{r.cpus} * parts, Times(r.memory, parts));
  if (!q.ok()) {
    *status = q;
    return Outcome::kFailed;
  }
  const uint64_t saved_id = next_id_, saved_gang = next_gang_;
  std::string gang = parts > 1 ? GangId(next_gang_) : "";
  const int64_t now = r.lease.count() > 0 ? NowMs() : 0;
  std::vector<uint64_t>& placed = *granted;
  placed.clear();
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
  return Outcome::kGranted;
}

// ---- quotas

Quota AllocatorState::QuotaFor(const std::string& user) const {
  auto it = quotas_.find(user);
  return it == quotas_.end() ? default_quota_ : it->second;
}

UserQuota AllocatorState::QuotaEntry(const std::string& user) const {
  UserQuota q;
  q.user = user;
  q.own = quotas_.count(user) > 0;
  q.quota = QuotaFor(user);
  auto it = usage_.find(user);
  if (it != usage_.end()) q.usage = it->second;
  return q;
}

absl::Status AllocatorState::CheckQuota(const std::string& user, int64_t gpus,
                                        uint64_t gpu_memory, int64_t cpus,
                                        uint64_t memory) const {
  if (quotas_.empty() && default_quota_ == Quota{}) return absl::OkStatus();
  const Quota q = QuotaFor(user);
  Usage u;
  auto it = usage_.find(user);
  if (it != usage_.end()) u = it->second;
  // alone: the request itself is over the quota, and no release of the
  // user's grants will ever let it in (tune's runner stops retrying on
  // these words, as on placement's for a request no node could hold).
  auto refuse = [&](const char* field, const std::string& used, const std::string& asked,
                    const std::string& limit, bool below, bool alone) {
    const char* which = quotas_.count(user) ? "quota" : "default quota";
    std::string s = absl::StrCat(which, " of ", user, ": ", field, " ", used,
                                 " in use + ", asked, " requested > quota ", limit);
    if (alone) {
      absl::StrAppend(&s, " (the request alone is over the quota: no grant can ever hold this "
                          "request until the quota is raised)");
    } else if (below) {
      absl::StrAppend(&s, " (the quota is below current use; new grants are refused "
                          "until use drops under it)");
    }
    return absl::ResourceExhaustedError(s);
  };
  if (gpus > 0 && q.gpus && u.gpus + gpus > *q.gpus) {
    return refuse("gpus", std::to_string(u.gpus), std::to_string(gpus),
                  std::to_string(*q.gpus), u.gpus > *q.gpus, gpus > *q.gpus);
  }
  // Use is at most Placement::kMaxTotalBytes; what is asked may be near
  // 2^64 (Times): compared so that neither wraps.
  auto over = [](uint64_t used, uint64_t asked, uint64_t limit) {
    return asked > limit || used > limit - asked;
  };
  if (gpu_memory > 0 && q.gpu_memory && over(u.gpu_memory, gpu_memory, *q.gpu_memory)) {
    return refuse("gpu_memory", FormatByteSize(u.gpu_memory), FormatByteSize(gpu_memory),
                  FormatByteSize(*q.gpu_memory), u.gpu_memory > *q.gpu_memory,
                  gpu_memory > *q.gpu_memory);
  }
  if (cpus > 0 && q.cpus && u.cpus + cpus > *q.cpus) {
    return refuse("cpus", std::to_string(u.cpus), std::to_string(cpus),
                  std::to_string(*q.cpus), u.cpus > *q.cpus, cpus > *q.cpus);
  }
  if (memory > 0 && q.memory && over(u.memory, memory, *q.memory)) {
    return refuse("memory", FormatByteSize(u.memory), FormatByteSize(memory),
                  FormatByteSize(*q.memory), u.memory > *q.memory, memory > *q.memory);
  }
  return absl::OkStatus();
}

Usage AllocatorState::UsageOf(const std::string& user) const {
  auto it = usage_.find(user);
  return it == usage_.end() ? Usage{} : it->second;
}

std::vector<UserQuota> AllocatorState::Quotas(const std::string& user) const {
  if (!user.empty()) return {QuotaEntry(user)};
  std::vector<UserQuota> out;
  UserQuota d;
  d.quota = default_quota_;
  out.push_back(d);
  std::set<std::string> users;
  for (const auto& [u, q] : quotas_) users.insert(u);
  for (const auto& [u, usage] : usage_) users.insert(u);
  for (const auto& u : users) out.push_back(QuotaEntry(u));
  return out;
}

bool AllocatorState::SetQuota(const std::string& user, const Quota& quota) {
  auto it = quotas_.find(user);
  if (it != quotas_.end() && it->second == quota) return false;
  quotas_[user] = quota;
  return true;
}

bool AllocatorState::SetDefaultQuota(const Quota& quota) {
  if (default_quota_ == quota) return false;
  default_quota_ = quota;
  return true;
}

bool AllocatorState::ClearQuota(const std::string& user) { return quotas_.erase(user) > 0; }

std::vector<std::string> AllocatorState::DefaultQuotaNotes(const Quota& quota) const {
  std::vector<std::string> notes;
  for (const auto& [user, u] : usage_) {
    if (quotas_.count(user)) continue;
    std::string note = BelowUseNote(user, quota, u);
    if (!note.empty()) notes.push_back(note);
  }
  std::sort(notes.begin(), notes.end());
  return notes;
}

// ---- views

std::vector<uint64_t> AllocatorState::GangParts(const std::string& id) const {
  auto it = gangs_.find(id);
  return it == gangs_.end() ? std::vector<uint64_t>{} : it->second;
}

absl::Status AllocatorState::CheckInvariants() const {
  return gpu::CheckInvariants(placement_, allocs_, usage_);
}

}  // namespace deepnex::gpu
