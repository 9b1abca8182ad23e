// deepnex::gpu::Allocator: hands out GPUs, CPU cores and host memory of a set
// of nodes to users, with exclusive and shared node modes, quotas, a priority
// queue, gangs and leases; optionally persistent through a crash-safe ledger.
//
//   AllocatorOptions options;
//   options.state_dir = "/var/lib/x";
//   DEEPNEX_ASSIGN_OR_RETURN(auto alloc, Allocator::Create(options));
//   alloc->AddNode(node);
//   DEEPNEX_ASSIGN_OR_RETURN(Allocation a, alloc->Allocate(request));
//   ... launch with a.env ...
//   alloc->Release(a.id);
#ifndef DEEPNEX_GPU_ALLOCATOR_H_
#define DEEPNEX_GPU_ALLOCATOR_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/gpu/types.h"
#include "deepnex/status.h"

namespace deepnex::gpu {

struct AllocatorOptions {
  // Empty: state lives in memory only. Otherwise the directory (created if
  // missing) of the ledger: every change is in a write-ahead log, fsynced
  // before the call returns, and Create replays it. One Allocator per
  // directory at a time (a second is refused with FailedPrecondition).
  std::string state_dir;
  // fsync before acknowledging. Turning it off keeps the log but loses the
  // last changes on a machine crash (not on a process crash).
  // Default: true
  bool fsync = true;
  // Write a snapshot and drop the log behind it every this many records;
  // 0 never (Compact() still works).
  // Default: 100000
  uint64_t snapshot_every = 100000;
  // How often the lease reaper looks at leases at least.
  // Default: 100ms
  std::chrono::milliseconds lease_check_interval{100};
  // How long the head of the queue waits before its capacity is reserved
  // (see "The queue" below); 0 reserves at once.
  // Default: 5min
  std::chrono::milliseconds reservation_after{std::chrono::minutes(5)};
};

// What Allocator::Create replayed from state_dir, and what it dropped: a
// torn tail of the newest log file, a write that a crash cut short and that
// was never acknowledged. All zero in memory. Logged to stderr when a tail
// was dropped, and served as metrics by deepnex-central.
struct LedgerReport {
  uint64_t snapshot_records = 0;
  uint64_t log_records = 0;   // replayed after the snapshot
  uint64_t torn_records = 0;  // frames, whole or cut short
  uint64_t torn_bytes = 0;
};

// The queue. A request over free capacity waits (AllocateOptions::wait) in
// order of priority, then arrival; its head is the first waiting request.
// Allocations have no known end (leases aside), so whether a request delays
// the head cannot be computed; the rule instead is backfill with a
// reservation, as in Slurm:
//  - A request that fits now is granted even with others waiting ahead of it
//    (backfill), as long as the head has waited less than
//    AllocatorOptions::reservation_after.
//  - Once the head has waited longer, the capacity it needs on its best node
//    (the eligible node where least of it is missing now) is reserved: a
//    request behind it is granted only in what remains beyond that
//    reservation. Exclusive GPUs are reserved whole, free ones first; shared
//    ones by the head's gpu_memory; cpus and memory by amount.
//  - Only the head reserves; when it is granted the next one becomes head.
//  - A request refused by its quota or priority cap leaves the queue with
//    the error, so it never blocks others.
// Priority is policy: Request::priority may be at most the user's
// Quota::max_priority (default 0), else PermissionDenied. The cap applies to
// every caller of Allocate, admins included: the Allocator does not know who
// calls, and deepnex-central passes every token's requests through it; an
// admin who wants a user's work ahead raises that user's max_priority.

// Per call of Allocate. See "The queue" above for the order and backfill.
struct AllocateOptions {
  // true: a request within quota but over free capacity (or the head's
  // reservation) waits in the queue. false: it is refused with
  // ResourceExhausted.
  // Default: true
  bool wait = true;
  // How long to wait in the queue; zero waits until granted.
  // Default: 0
  std::chrono::milliseconds timeout{0};
};

// How SetNodeMode treats a node that holds GPU allocations of its current mode.
enum class ModeSwitch {
  // FailedPrecondition naming the allocations.
  kRefuse,
  // The node takes no new GPU allocations and switches when they are gone.
  kWhenDrained,
};

// A user's quota beside what the user holds (Allocator::Quotas).
struct UserQuota {
  // Empty: the default quota (usage is then zero).
  std::string user;
  // The quota that applies: the user's own, else the default.
  Quota quota;
  // True when the user has a quota of their own (SetQuota).
  bool own = false;
  Usage usage;
};

// A request waiting in the queue (Allocator::Pending).
struct PendingRequest {
  // 1-based place in the queue (priority, then arrival).
  size_t position = 0;
  // The queue's ticket for it ("q<N>"); stable while it waits.
  std::string id;
  Request request;
  // How long it has waited so far.
  std::chrono::milliseconds waited{0};
  // Why it waits, a short phrase: the resource that is short ("waiting for 2
  // exclusive GPUs (at most 1 free on an eligible node)") and/or the requests
  // queued ahead of it ("behind 3 requests").
  std::string reason;
};

// Thread-safe: any thread may call any method at any time. Allocate may block
// (the queue); every other call returns after its ledger record is durable.
// AllocateGangAsync and ReleaseAsync never block.
class Allocator {
 public:
  static absl::StatusOr<std::unique_ptr<Allocator>> Create(
      const AllocatorOptions& options = {});
  // Wakes queued requests (they fail with Cancelled) and closes the ledger.
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // ---- nodes (admin)
  // InvalidArgument naming the field for a bad node; AlreadyExists for a
  // duplicate name or GPU UUID.
  absl::Status AddNode(const Node& node);
  // FailedPrecondition naming the allocations when the node is not empty.
  absl::Status RemoveNode(const std::string& name);
  // See ModeSwitch. Setting the mode a node has is a no-op (and cancels a
  // pending switch).
  absl::Status SetNodeMode(const std::string& name, Mode mode,
                           ModeSwitch when = ModeSwitch::kRefuse);
  // A cordoned node keeps its allocations and takes no new ones.
  absl::Status Cordon(const std::string& name);
  absl::Status Uncordon(const std::string& name);
  // Cordons the node and marks it draining; with `release`, also releases
  // every allocation on it (reason "node drained").
  absl::Status Drain(const std::string& name, bool release = false);
  // A node that is not ready (its agent is not heard from) keeps its
  // allocations and takes no new ones, as if cordoned; unlike a cordon it is
  // not in the ledger, and every node is ready after Create. NotFound for
  // an unknown node.
  absl::Status SetNodeReady(const std::string& name, bool ready);

  // ---- quotas (admin)
  // Sets `user`'s quota. Allowed below what the user holds now: then the
  // returned note says so (new grants are refused until usage drops);
  // otherwise the note is empty.
  absl::StatusOr<std::string> SetQuota(const std::string& user,
                                       const Quota& quota);
  // The quota of users without their own; default: unlimited.
  absl::StatusOr<std::string> SetDefaultQuota(const Quota& quota);
  absl::Status ClearQuota(const std::string& user);
  // The quota that applies to `user` (theirs, else the default).
  Quota GetQuota(const std::string& user) const;
  Usage GetUsage(const std::string& user) const;
  // `user` empty: the default quota first (user ""), then every user with a
  // quota of their own or holding something, by name. Otherwise that user's
  // entry alone (the default quota when they have none).
  std::vector<UserQuota> Quotas(const std::string& user = "") const;

  // ---- allocations
  // A request with replicas == 1. InvalidArgument for a bad request (and for
  // replicas > 1: use AllocateGang); PermissionDenied for a priority above
  // the user's max_priority; NotFound for an unknown node or a
  // selector no node matches; ResourceExhausted over quota (naming it),
  // when no node could ever hold it, or with wait=false over free capacity;
  // FailedPrecondition for a shared request that only exclusive nodes could
  // hold (and vice versa); DeadlineExceeded when the timeout ran out.
  absl::StatusOr<Allocation> Allocate(const Request& request,
                                      const AllocateOptions& options = {});
  // All `request.replicas` parts, or an error and nothing: the errors of
  // Allocate, and ResourceExhausted when no set of nodes, empty, could hold
  // all the parts at once.
  absl::StatusOr<std::vector<Allocation>> AllocateGang(
      const Request& request, const AllocateOptions& options = {});
  // Whether the caller may act on allocation `a`: asked, under the
  // allocator's lock, of each part an id names before Release or Renew
  // changes anything, and its error returned. A server's owner check
  // (central's): asked beforehand of the views, it missed a grant not yet
  // durable, and another user's release took that grant.
  using Permit = std::function<absl::Status(const Allocation& a)>;

  // Releases an allocation, or every part of a gang given the gang id.
  // Idempotent: an id that was released is OK. NotFound for one never
  // issued, InvalidArgument for one that is not an id.
  absl::Status Release(const std::string& id, const Permit& permit = nullptr);
  // Extends the lease by its length from now. NotFound for an unknown id,
  // FailedPrecondition for an allocation without a lease.
  absl::StatusOr<Allocation> Renew(const std::string& id, const Permit& permit = nullptr);

  // ---- asynchronous forms, for a server that keeps many calls in flight
  // without a thread each: with the ledger on, their fsyncs are shared
  // (group commit). `done` runs exactly once, with what the blocking form
  // would return, and no lock held: on this thread when the answer is known
  // at once (a refusal; any answer in memory), else on the ledger's thread
  // (once the change is durable) or the allocator's lease thread (a request
  // that waited in the queue). It should be quick; it may call any method.
  using AllocateDone = std::function<void(absl::StatusOr<std::vector<Allocation>>)>;
  using Done = std::function<void(absl::Status)>;
  // Returns a ticket for Withdraw while the request waits in the queue; 0
  // when it was answered at once.
  uint64_t AllocateGangAsync(const Request& request, const AllocateOptions& options,
                             AllocateDone done);
  // Takes a request that AllocateGangAsync left waiting out of the queue
  // (its caller is gone, say); it is answered Cancelled. False when it waits
  // no more (granted, refused, timed out or withdrawn already).
  bool Withdraw(uint64_t ticket);
  void ReleaseAsync(const std::string& id, Done done, const Permit& permit = nullptr);

  // ---- views
  std::vector<NodeInfo> Nodes() const;
  absl::StatusOr<NodeInfo> GetNode(const std::string& name) const;
  // Every allocation, or `user`'s; ordered by id.
  std::vector<Allocation> Allocations(const std::string& user = "") const;
  absl::StatusOr<Allocation> GetAllocation(const std::string& id) const;
  // Requests waiting in the queue.
  size_t QueueLength() const;
  // The queue in order, with why each entry waits; `user` filters (the
  // positions stay those in the whole queue).
  std::vector<PendingRequest> Pending(const std::string& user = "") const;
  // Fails every queued request with Cancelled and returns once their calls
  // have left; later Allocate calls fail with Cancelled and leases stop
  // expiring. Other calls keep working. The destructor does this too.
  void Shutdown();

  // ---- persistence and checks
  // Writes a snapshot and drops the log behind it (no-op in memory).
  absl::Status Compact();
  // Records written to the ledger since this Allocator was created (0 in
  // memory); a call that changes nothing writes none.
  uint64_t LedgerRecords() const;
  // What Create recovered from state_dir.
  LedgerReport Recovered() const;
  // A canonical serialization of the whole state: equal strings, equal state.
  std::string StateDigest() const;
  // Recomputes every counter from the allocations; Internal naming the first
  // inconsistency (double-booked exclusive GPU, overcommitted memory, ...).
  absl::Status CheckInvariants() const;

 private:
  class Impl;
  explicit Allocator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_ALLOCATOR_H_
