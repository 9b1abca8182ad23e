// What the allocator's ledger records, and the rules that change it: the
// nodes (Placement), the allocations, gangs and leases, the quotas and each
// user's usage, and the next ids. Every change is one Apply* call, made the
// same way live and on replay, so a replayed state equals the live one (as
// leveldb's VersionSet applies a VersionEdit). Private to libdeepnex.
#ifndef DEEPNEX_GPU_ALLOCATOR_STATE_H_
#define DEEPNEX_GPU_ALLOCATOR_STATE_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/types.h"
#include "deepnex/status.h"
#include "gpu/allocator_records.h"
#include "gpu/placement.h"

namespace deepnex::gpu {

// Milliseconds since the Unix epoch: the clock of leases.
int64_t NowMs();

// InvalidArgument naming the field of a quota for `who` with a negative limit.
absl::Status ValidateQuota(const std::string& who, const Quota& q);

// The note SetQuota returns when `who`'s usage `u` is over `q`: what is over
// and that new grants are refused until use drops; empty when nothing is.
std::string BelowUseNote(const std::string& who, const Quota& q, const Usage& u);

// What became of a request offered to AllocatorState::Grant.
enum class Outcome { kGranted, kBusy, kFailed };

// Thread-compatible: the Allocator calls it under its mutex.
class AllocatorState {
 public:
  // ---- records
  // Decodes and applies one ledger record (replay): DataLoss for a record
  // that does not decode or does not fit the state (a node added twice, a
  // grant that overbooks a GPU, ...).
  absl::Status Apply(const std::string& record);
  void ApplyGrant(AllocRec r);
  // Unknown numbers are ignored (releases are idempotent).
  void ApplyRelease(uint64_t num);
  void ApplyRenew(uint64_t num, int64_t expires_at_ms);
  // Forgets everything, to replay the durable records again.
  void Clear();
  // The records that rebuild this state from nothing: a snapshot.
  std::vector<std::string> SnapshotRecords() const;
  // The record that adds `n` as it is now.
  static NodeRecord RecordOf(const NodeState& n);

  // ---- grants
  // Checks `r` against its user's priority cap and quota, places every
  // part and applies the grants (*placed: their numbers), or changes
  // nothing: kBusy when it does not fit now, kFailed (*status) when it is
  // refused or could never fit.
  Outcome Grant(const Request& r, std::vector<uint64_t>* placed, absl::Status* status);

  // ---- quotas
  // The quota that applies to `user`: theirs, else the default.
  Quota QuotaFor(const std::string& user) const;
  Usage UsageOf(const std::string& user) const;
  // See Allocator::Quotas.
  std::vector<UserQuota> Quotas(const std::string& user) const;
  // Each returns whether it changed anything (and so is to be logged).
  bool SetQuota(const std::string& user, const Quota& quota);
  bool SetDefaultQuota(const Quota& quota);
  bool ClearQuota(const std::string& user);
  // Why each user without a quota of their own is over `quota` now, sorted;
  // empty when none is.
  std::vector<std::string> DefaultQuotaNotes(const Quota& quota) const;

  // ---- views
  Placement& placement() { return placement_; }
  const Placement& placement() const { return placement_; }
  const std::map<uint64_t, AllocRec>& allocs() const { return allocs_; }
  // Whether allocation (kind 'a') or gang ('g') number `num` was ever
  // issued: released ones were, and a release of them is a no-op.
  bool Issued(char kind, uint64_t num) const {
    return num > 0 && num < (kind == 'a' ? next_id_ : next_gang_);
  }
  // The numbers of the parts of gang `id`; empty when none is held.
  std::vector<uint64_t> GangParts(const std::string& id) const;
  // Leases in order of expiry: (expires at, allocation number).
  const std::set<std::pair<int64_t, uint64_t>>& leases() const { return leases_; }
  // See Allocator::CheckInvariants.
  absl::Status CheckInvariants() const;

 private:
  // Apply's, per record type.
  absl::Status Replay(NodeRecord r);
  absl::Status Replay(RemoveNodeRecord r);
  absl::Status Replay(ModeRecord r);
  absl::Status Replay(FlagsRecord r);
  absl::Status Replay(QuotaRecord r);
  absl::Status Replay(ClearQuotaRecord r);
  absl::Status Replay(GrantRecord grant);
  absl::Status Replay(ReleaseRecord r);
  absl::Status Replay(RenewRecord r);
  absl::Status Replay(NextIdsRecord r);
  UserQuota QuotaEntry(const std::string& user) const;
  absl::Status CheckQuota(const std::string& user, int64_t gpus, uint64_t gpu_memory,
                          int64_t cpus, uint64_t memory) const;

  Placement placement_;
  std::map<uint64_t, AllocRec> allocs_;
  std::map<std::string, std::vector<uint64_t>> gangs_;
  std::unordered_map<std::string, Usage> usage_;
  std::map<std::string, Quota> quotas_;
  Quota default_quota_;
  uint64_t next_id_ = 1;
  uint64_t next_gang_ = 1;
  std::set<std::pair<int64_t, uint64_t>> leases_;  // (expires at, allocation)
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_ALLOCATOR_STATE_H_
