// The values of GPU allocation: GPUs and nodes as declared or discovered, a
// request for resources, the allocation that grants it, and per-user quotas.
//
// Plain structs, copyable; none of them is thread-safe to mutate while shared.
#ifndef DEEPNEX_GPU_TYPES_H_
#define DEEPNEX_GPU_TYPES_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "deepnex/status.h"

namespace deepnex::gpu {

// How a node hands out its GPUs. Exclusive: a GPU belongs to one allocation
// and is granted whole. Shared: several allocations share a GPU, each with
// the GPU memory it asked for, never more in total than the GPU has.
enum class Mode { kExclusive, kShared };

// "exclusive" / "shared".
const char* ModeName(Mode mode);
// InvalidArgument naming `field` for anything but "exclusive" or "shared".
absl::StatusOr<Mode> ParseMode(const std::string& text,
                               const std::string& field = "mode");

// One GPU of a node.
struct Gpu {
  // Index on its node (CUDA_VISIBLE_DEVICES). -1: its position in Node::gpus.
  int index = -1;
  // Empty: the allocator names it "GPU-<node>-<index>". Unique in a cluster.
  std::string uuid;
  // Product name, informational ("NVIDIA H100 80GB HBM3").
  std::string name;
  // Total memory in bytes; must be positive.
  uint64_t memory = 0;
  // "0000:1b:00.0", informational.
  std::string pci_bus_id;
  // NUMA node of the GPU; -1 unknown.
  int numa_node = -1;
  // GPUs with the same non-negative switch_id hang under one NVLink or PCIe
  // switch; -1 unknown. Placement prefers one switch, then one NUMA node.
  int switch_id = -1;
};

// A machine whose GPUs, CPU cores and memory the allocator hands out.
struct Node {
  // Unique; letters, digits, '-', '_', '.'.
  std::string name;
  std::vector<Gpu> gpus;
  // CPU cores and host memory (bytes) that allocations may take; both > 0.
  int cpus = 0;
  uint64_t memory = 0;
  Mode mode = Mode::kExclusive;
  // Matched by Request::selector.
  std::map<std::string, std::string> labels;
};

// What a user asks for. A gang (replicas > 1) is `replicas` identical parts,
// each on one node (parts may share a node), granted all together or not at
// all.
struct Request {
  std::string user;
  // The job the request is for (deepnex run's job name), carried by its
  // allocations and shown in listings; empty: none.
  std::string job;
  // GPUs per part; 0 asks for CPU cores and memory only.
  int gpus = 0;
  Mode mode = Mode::kExclusive;
  // Shared: GPU memory per GPU, bytes, required when gpus > 0. Exclusive: the
  // least memory a granted GPU must have (0: any); the whole GPU is granted.
  uint64_t gpu_memory = 0;
  // CPU cores and host memory per part.
  int cpus = 0;
  uint64_t memory = 0;
  // Every label here must be on the node, with this value.
  std::map<std::string, std::string> selector;
  // Only this node (empty: any).
  std::string node;
  // Higher first in the queue; FIFO among equals. At most the user's
  // Quota::max_priority (default 0).
  int priority = 0;
  int replicas = 1;
  // Prefer the emptiest node instead of packing (best fit).
  bool spread = false;
  // Zero: no lease. Otherwise the holder must Renew within this time or the
  // allocation is released ("lease expired" in the ledger).
  std::chrono::milliseconds lease{0};
};

// One GPU of an allocation.
struct GrantedGpu {
  int index = 0;
  std::string uuid;
  // Bytes granted: the whole GPU when exclusive.
  uint64_t memory = 0;
  bool exclusive = true;
};

// A grant, the one value that crosses from the allocator to a launcher.
struct Allocation {
  std::string id;
  std::string user;
  // Request::job; empty: none.
  std::string job;
  std::string node;
  std::vector<GrantedGpu> gpus;
  int cpus = 0;
  uint64_t memory = 0;
  int priority = 0;
  // A part of a gang: the gang's id (releasing it releases every part) and
  // this part's index; empty / 0 otherwise.
  std::string gang;
  int replica = 0;
  // Milliseconds since the Unix epoch when the lease runs out; 0: no lease.
  int64_t lease_ms = 0;
  int64_t expires_at_ms = 0;
  // CUDA_VISIBLE_DEVICES (indices), NVIDIA_VISIBLE_DEVICES (UUIDs; "void"
  // without GPUs) and, for shared GPUs, DEEPNEX_GPU_MEMORY_LIMIT (bytes).
  std::map<std::string, std::string> env;

  std::string ToString() const;
};

// Limits on what one user holds at once (unset: unlimited), and the highest
// priority the user may ask for.
struct Quota {
  std::optional<int64_t> gpus;
  std::optional<uint64_t> gpu_memory;
  std::optional<int64_t> cpus;
  std::optional<uint64_t> memory;
  // A request with Request::priority above this is refused with
  // PermissionDenied; lower and negative priorities are always allowed.
  // Priority is the admin's policy, not the user's wish.
  // Default: 0
  int max_priority = 0;

  std::string ToString() const;
  bool operator==(const Quota& o) const {
    return gpus == o.gpus && gpu_memory == o.gpu_memory && cpus == o.cpus &&
           memory == o.memory && max_priority == o.max_priority;
  }
};

// What a user holds.
struct Usage {
  int64_t gpus = 0;
  uint64_t gpu_memory = 0;
  int64_t cpus = 0;
  uint64_t memory = 0;
};

// A node as the allocator sees it now.
struct NodeInfo {
  Node node;  // GPUs with their index and UUID filled in
  Mode mode = Mode::kExclusive;
  // Set while a switch waits for the node's allocations of the other kind.
  std::optional<Mode> pending_mode;
  bool cordoned = false;
  bool draining = false;
  // False while the node's deepnex-agent has not been heard from within
  // deepnex-central's --node-timeout: it takes no new grants.
  bool ready = true;
  // When central last heard the node's agent (ms since the epoch); 0 for a
  // node without an agent (declared by an admin).
  int64_t last_heartbeat_ms = 0;
  // What the node uses now (all processes, not grants), as its agent last
  // measured: cores busy and memory in use in bytes. 0 without an agent.
  double cpus_busy = 0;
  uint64_t memory_in_use = 0;
  // The host that peers dial on this node (its agent's --advertise, by
  // default its address towards central); empty without an agent.
  std::string address;
  // Per GPU (same order as node.gpus): memory granted and allocations on it.
  std::vector<uint64_t> gpu_memory_used;
  std::vector<int> gpu_allocations;
  int cpus_used = 0;
  uint64_t memory_used = 0;
  std::vector<std::string> allocation_ids;

  int gpus_free() const;  // GPUs with no allocation
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_TYPES_H_
