// The allocator's nodes and where requests fit on them: per-node state, the
// indexes that find a node without scanning them all, fit (best fit, one
// switch or NUMA node first), the head of the queue's reservation, and why a
// request can never fit or does not fit now. Private to libdeepnex; pure (no
// clock, no lock, no ledger), so it is tested on its own (placement_test).
#ifndef DEEPNEX_GPU_PLACEMENT_H_
#define DEEPNEX_GPU_PLACEMENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "deepnex/gpu/types.h"
#include "deepnex/status.h"
#include "gpu/allocator_records.h"

namespace deepnex::gpu {

// A node and what is booked on it.
struct NodeState {
  int id = 0;
  Node spec;  // GPU indices and UUIDs filled in
  Mode mode = Mode::kExclusive;
  std::optional<Mode> pending;
  bool cordoned = false;
  bool draining = false;
  // False while the node's agent is not heard from (deepnex-central's
  // --node-timeout): like a cordon, it takes no new grants. Not in the
  // ledger: it is what central sees now, not a decision.
  bool ready = true;
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

// Capacity of one node kept for the head of the queue (Placement::Reserve).
struct Hold {
  int cpus = 0;
  uint64_t memory = 0;
  // Per GPU position (empty: none): memory held; a held exclusive GPU is
  // held whole.
  std::vector<uint64_t> gpu;
};

// Node, user and job names: 1-253 letters, digits, '-', '_', '.', '@'.
bool ValidName(const std::string& s);
// A node label or selector entry: InvalidArgument naming `where`, the key
// and (escaped, cut at 64 bytes) the offending text.
absl::Status CheckLabel(const std::string& where, const std::string& key,
                        const std::string& value);
// InvalidArgument naming the field of a request that no node could make
// sense of (a bad name, a negative or absurd count, a shared request without
// its GPU memory, a request for nothing, a selector no label could match).
absl::Status ValidateRequest(const Request& r);

// InvalidArgument naming `field` for a value that is no Mode (a C++
// caller's cast, Mode(9)).
absl::Status CheckMode(Mode mode, const std::string& field);
// "a1, a2, ... (12 in all)": at most `max` names.
std::string NameList(const std::vector<std::string>& names, size_t max = 8);
// "alice asks 2 x (1 exclusive GPUs, 4 cpus, 8GiB memory)", for messages.
std::string Describe(const Request& r);

// Thread-compatible: the Allocator calls it under its mutex.
class Placement {
 public:
  // The most GPU memory, and the most memory, of all nodes together: a
  // node past it is refused (a probe's GPUs of 2^64-1 bytes wrapped a
  // user's use past her quota to 0).
  static constexpr uint64_t kMaxTotalBytes = uint64_t{1} << 62;
  using ExclusiveIndex = std::set<std::pair<int, int>>;             // (free GPUs, node id)
  using SharedIndex = std::set<std::tuple<uint64_t, int, int>>;    // (free memory, node id, GPU)

  // ---- nodes
  NodeState* Find(const std::string& name) const;
  // By name.
  const std::map<std::string, NodeState*>& nodes() const { return by_name_; }
  // Checks a node that AddNode is given, filling in GPU indices and UUIDs:
  // InvalidArgument naming the field, AlreadyExists for a name or UUID taken.
  absl::Status Validate(Node* node) const;
  // `n`'s spec, mode and flags set; the rest is set here.
  void Add(std::unique_ptr<NodeState> n);
  // REQUIRES: nothing booked on `n`.
  void Remove(NodeState* n);
  // `pending`: the switch waits for the node's GPU allocations to go.
  void SetMode(NodeState* n, Mode mode, bool pending);
  void SetFlags(NodeState* n, bool cordoned, bool draining);
  void SetReady(NodeState* n, bool ready);
  // Forgets every node.
  void Clear();

  // ---- what is booked
  // Books allocation `r` on `n` and fills in its id, GPU indices and UUIDs
  // and env from `n`.
  void Book(NodeState* n, AllocRec* r);
  // Takes booked allocation `r` off `n`.
  void Unbook(NodeState* n, const AllocRec& r);
  NodeInfo Info(const NodeState& n) const;

  // ---- placing
  // A node where one part of `r` fits now, beside what Reserve holds, and
  // the GPU positions there (*pos); nullptr when none.
  NodeState* Place(const Request& r, std::vector<int>* pos);
  // Keeps the capacity that `r`, the head of the queue, needs on its best
  // node out of Place's reach until ClearReservations.
  void Reserve(const Request& r);
  void ClearReservations() { held_.clear(); }
  // Why `r` can never be granted, or OK when it could be once capacity frees.
  absl::Status Infeasible(const Request& r) const;
  // Why one part of `r` does not fit now, naming the resource that is short
  // on the nodes that could take it; empty when one part fits.
  std::string Shortage(const Request& r) const;

  // ---- for the invariant checker
  const ExclusiveIndex& exclusive_index() const { return excl_; }
  const SharedIndex& shared_index() const { return shared_; }

 private:
  void Unindex(NodeState* n);
  void Index(NodeState* n);
  // A booking on a shared node that stays schedulable only moves the keys
  // of the GPUs it touched (the hot path; Unindex/Index move them all).
  static bool FastReindex(const NodeState* n);
  void ReindexGpu(NodeState* n, int i);
  // What Reserve holds on `n`, or nullptr.
  const Hold* HoldOn(const NodeState* n) const;
  bool FitOnNode(NodeState* n, const Request& r, std::vector<int>* pos) const;

  std::vector<std::unique_ptr<NodeState>> slots_;  // by NodeState::id
  std::map<std::string, NodeState*> by_name_;
  std::unordered_map<std::string, std::string> uuids_;  // GPU UUID -> node
  // Every node's GPU memory and memory, which bound any user's use, and so
  // the sums of usage and quotas: at most kMaxTotalBytes each.
  uint64_t gpu_memory_ = 0;
  uint64_t memory_ = 0;
  ExclusiveIndex excl_;
  SharedIndex shared_;
  uint32_t try_gen_ = 0;
  // The head's reservation (Reserve), per node; set only while the queue
  // places the requests behind the head.
  std::unordered_map<const NodeState*, Hold> held_;
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_PLACEMENT_H_
