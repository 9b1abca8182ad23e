// Where nodes come from: the local machine's GPUs through NVML (loaded with
// dlopen, so libdeepnex runs without the NVIDIA driver), and node
// declarations in a JSON file.
#ifndef DEEPNEX_GPU_DISCOVERY_H_
#define DEEPNEX_GPU_DISCOVERY_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "deepnex/gpu/types.h"
#include "deepnex/status.h"

namespace deepnex::gpu {

// How two GPUs of a node are connected, best first (NVML's topology levels).
enum class GpuLink {
  kSelf,
  kNvLink,       // at least one active NVLink between them
  kPcieSwitch,   // under one or several PCIe switches, no host bridge
  kHostBridge,   // through one PCIe host bridge
  kNuma,         // through the interconnect of one NUMA node
  kSystem,       // across NUMA nodes
  kUnknown,
};
const char* GpuLinkName(GpuLink link);

struct LocalGpus {
  // Index, UUID, name, memory, PCI bus id, NUMA node; GPUs joined by NVLink
  // or a PCIe switch share a switch_id.
  std::vector<Gpu> gpus;
  // links[i][j] for every pair; empty without GPUs.
  std::vector<std::vector<GpuLink>> links;
  std::string driver_version;
  // "8 GPUs (NVML 12.550.54.15)", or "0 GPUs (NVML not found)" / "0 GPUs
  // (NVML init failed: ...)" on a machine without the driver.
  std::string summary;
};

// The GPUs of this machine. Never an error for a missing driver: then no
// GPUs and a summary that says why. `library` is the NVML to dlopen.
LocalGpus DiscoverLocalGpus(const std::string& library = "libnvidia-ml.so.1");

// The GPU memory each process uses now, by GPU index then pid, through NVML
// (its compute processes). Empty without a driver. NVML is loaded and
// initialised once per process and kept, as this is called per usage sample.
std::map<int, std::map<int64_t, uint64_t>> GpuMemoryByProcess(
    const std::string& library = "libnvidia-ml.so.1");

// What each GPU of this machine does now (memory used, utilisation),
// through NVML, loaded once as for GpuMemoryByProcess. Empty without a
// driver: never an error.
std::vector<GpuUsage> MeasureLocalGpus(const std::string& library = "libnvidia-ml.so.1");

// This machine as a node: `name` (empty: the host name), its discovered
// GPUs, its online CPU cores and physical memory.
absl::StatusOr<Node> LocalNode(const std::string& name = "",
                               Mode mode = Mode::kExclusive,
                               const std::string& library = "libnvidia-ml.so.1");

// Node declarations, JSON:
//   {"nodes": [{"name": "n1", "cpus": 64, "memory": "512GiB",
//               "mode": "shared", "labels": {"gpu": "h100"},
//               "gpus": [{"memory": "80GiB", "uuid": "GPU-...", "name": "...",
//                         "index": 0, "numa_node": 0, "switch_id": 0,
//                         "pci_bus_id": "0000:1b:00.0"}]}]}
// "gpus" may also be {"count": 8, "memory": "80GiB"}. Sizes are strings
// ("80GiB") or integers (bytes). InvalidArgument naming `source` and the
// line and column of a syntax error, or the field path
// (nodes[1].gpus[0].memory) and the value of a bad field; unknown keys are
// errors too. NotFound when the file cannot be read.
absl::StatusOr<std::vector<Node>> ParseNodesJson(const std::string& text,
                                                 const std::string& source = "<string>");
absl::StatusOr<std::vector<Node>> LoadNodesFile(const std::string& path);

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_DISCOVERY_H_
