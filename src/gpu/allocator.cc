// Allocator: forwards each public method to Allocator::Impl
// (allocator_impl.h), which holds the lock, the two states, the ledger and
// the threads; this file adds the checks and conversions of the public API.
#include "deepnex/gpu/allocator.h"

#include "absl/strings/str_cat.h"
#include "deepnex/units.h"
#include "gpu/allocator_impl.h"

namespace deepnex::gpu {

Allocator::Allocator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Allocator::~Allocator() = default;

absl::StatusOr<std::unique_ptr<Allocator>> Allocator::Create(const AllocatorOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(options.lease_check_interval, "lease_check_interval"));
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(options.reservation_after, "reservation_after", true));
  auto impl = std::make_unique<Impl>(options);
  DEEPNEX_RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<Allocator>(new Allocator(std::move(impl)));
}

absl::Status Allocator::AddNode(const Node& node) { return impl_->AddNode(node); }

absl::Status Allocator::RemoveNode(const std::string& name) { return impl_->RemoveNode(name); }

absl::Status Allocator::SetNodeMode(const std::string& name, Mode mode, ModeSwitch when) {
  return impl_->SetNodeMode(name, mode, when);
}

absl::Status Allocator::Cordon(const std::string& name) {
  return impl_->SetFlags(name, true, false, false, /*keep_draining=*/true);
}

absl::Status Allocator::Uncordon(const std::string& name) {
  return impl_->SetFlags(name, false, false, false);
}

absl::Status Allocator::SetNodeReady(const std::string& name, bool ready) {
  return impl_->SetReady(name, ready);
}

absl::Status Allocator::Drain(const std::string& name, bool release) {
  return impl_->SetFlags(name, true, true, release);
}

absl::StatusOr<std::string> Allocator::SetQuota(const std::string& user, const Quota& quota) {
  return impl_->SetQuota(user, quota);
}

absl::StatusOr<std::string> Allocator::SetDefaultQuota(const Quota& quota) {
  return impl_->SetDefaultQuota(quota);
}

absl::Status Allocator::ClearQuota(const std::string& user) { return impl_->ClearQuota(user); }

Quota Allocator::GetQuota(const std::string& user) const {
  return impl_->Locked([&](const AllocatorState& s) { return s.QuotaFor(user); });
}

Usage Allocator::GetUsage(const std::string& user) const {
  return impl_->Locked([&](const AllocatorState& s) { return s.UsageOf(user); });
}

std::vector<UserQuota> Allocator::Quotas(const std::string& user) const {
  return impl_->Locked([&](const AllocatorState& s) { return s.Quotas(user); });
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

absl::Status Allocator::Release(const std::string& id, const Permit& permit) {
  return impl_->Release(id, permit);
}

absl::StatusOr<Allocation> Allocator::Renew(const std::string& id, const Permit& permit) {
  return impl_->Renew(id, permit);
}

uint64_t Allocator::AllocateGangAsync(const Request& request, const AllocateOptions& options,
                                      AllocateDone done) {
  return impl_->AllocateAsync(request, options, std::move(done));
}

bool Allocator::Withdraw(uint64_t ticket) { return impl_->Withdraw(ticket); }

void Allocator::ReleaseAsync(const std::string& id, Done done, const Permit& permit) {
  impl_->ReleaseAsync(id, std::move(done), permit);
}

std::vector<NodeInfo> Allocator::Nodes() const {
  return impl_->Locked([](const AllocatorState& s) {
    std::vector<NodeInfo> out;
    for (const auto& [name, n] : s.placement().nodes()) out.push_back(s.placement().Info(*n));
    return out;
  });
}

absl::StatusOr<NodeInfo> Allocator::GetNode(const std::string& name) const {
  return impl_->Locked([&](const AllocatorState& s) -> absl::StatusOr<NodeInfo> {
    const NodeState* n = s.placement().Find(name);
    if (n == nullptr) return Impl::NoNode(name);
    return s.placement().Info(*n);
  });
}

std::vector<Allocation> Allocator::Allocations(const std::string& user) const {
  return impl_->Locked([&](const AllocatorState& s) {
    std::vector<Allocation> out;
    for (const auto& [num, r] : s.allocs()) {
      if (user.empty() || r.a.user == user) out.push_back(r.a);
    }
    return out;
  });
}

absl::StatusOr<Allocation> Allocator::GetAllocation(const std::string& id) const {
  return impl_->Locked([&](const AllocatorState& s) -> absl::StatusOr<Allocation> {
    uint64_t num;
    auto it = ParseId(id, 'a', &num) ? s.allocs().find(num) : s.allocs().end();
    if (it == s.allocs().end()) {
      return absl::NotFoundError(absl::StrCat("allocation \"", id, "\" does not exist"));
    }
    return it->second.a;
  });
}

size_t Allocator::QueueLength() const { return impl_->QueueLength(); }

std::vector<PendingRequest> Allocator::Pending(const std::string& user) const {
  return impl_->Pending(user);
}

void Allocator::Shutdown() { impl_->Shutdown(); }

absl::Status Allocator::Compact() { return impl_->Compact(); }

uint64_t Allocator::LedgerRecords() const { return impl_->LedgerRecords(); }

LedgerReport Allocator::Recovered() const {
  const LedgerRecovery& r = impl_->recovery();
  return {r.snapshot_records, r.log_records, r.torn_records, r.torn_bytes};
}

std::string Allocator::StateDigest() const {
  return impl_->Locked([](const AllocatorState& s) {
    std::string out;
    Encoder e(&out);
    for (const auto& r : s.SnapshotRecords()) e.Str(r);
    return out;
  });
}

absl::Status Allocator::CheckInvariants() const { return impl_->CheckInvariants(); }

}  // namespace deepnex::gpu
