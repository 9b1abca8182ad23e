// GPU discovery through NVML, loaded with dlopen: libdeepnex has no link-time
// dependency on the driver. The few NVML types used are declared here with
// NVML's layouts (nvml.h is not needed to build).
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <functional>
#include <mutex>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/net.h"
#include "deepnex/gpu/discovery.h"

namespace deepnex::gpu {
namespace {

using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr unsigned kNvLinkMaxLinks = 18;

struct NvmlMemory {
  unsigned long long total, free, used;
};
struct NvmlPciInfo {
  char bus_id_legacy[16];
  unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};

struct Nvml {
  void* lib = nullptr;
  nvmlReturn_t (*Init)() = nullptr;
  nvmlReturn_t (*Shutdown)() = nullptr;
  const char* (*ErrorString)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*GetDriverVersion)(char*, unsigned) = nullptr;
  nvmlReturn_t (*GetCount)(unsigned*) = nullptr;
  nvmlReturn_t (*GetHandle)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*GetName)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*GetUuid)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*GetMemory)(nvmlDevice_t, NvmlMemory*) = nullptr;
  nvmlReturn_t (*GetPci)(nvmlDevice_t, NvmlPciInfo*) = nullptr;
  nvmlReturn_t (*GetAncestor)(nvmlDevice_t, nvmlDevice_t, int*) = nullptr;
  nvmlReturn_t (*GetNvLinkState)(nvmlDevice_t, unsigned, int*) = nullptr;
  nvmlReturn_t (*GetNvLinkRemotePci)(nvmlDevice_t, unsigned, NvmlPciInfo*) = nullptr;

  template <class F>
  bool Load(F* fn, const char* name) {
    *fn = reinterpret_cast<F>(dlsym(lib, name));
    return *fn != nullptr;
  }
  std::string Error(nvmlReturn_t rc) const {
    return ErrorString ? ErrorString(rc) : absl::StrCat("NVML error ", rc);
  }
};

// NVML's "00000000:1B:00.0" as sysfs writes it: "0000:1b:00.0".
std::string SysfsBusId(const std::string& nvml) {
  std::string s = nvml;
  if (s.size() > 12 && s.find(':') == 8) s = s.substr(4);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

int NumaNodeOf(const std::string& bus_id) {
  std::ifstream f("/sys/bus/pci/devices/" + bus_id + "/numa_node");
  int n = -1;
  if (f >> n) return n < 0 ? -1 : n;
  return -1;
}

GpuLink FromTopologyLevel(int level) {
  switch (level) {
    case 0: return GpuLink::kSelf;            // NVML_TOPOLOGY_INTERNAL
    case 10:                                  // NVML_TOPOLOGY_SINGLE
    case 20: return GpuLink::kPcieSwitch;     // NVML_TOPOLOGY_MULTIPLE
    case 30: return GpuLink::kHostBridge;     // NVML_TOPOLOGY_HOSTBRIDGE
    case 40: return GpuLink::kNuma;           // NVML_TOPOLOGY_NODE
    case 50: return GpuLink::kSystem;         // NVML_TOPOLOGY_SYSTEM
    default: return GpuLink::kUnknown;
  }
}

// nvmlProcessInfo_t as nvmlDeviceGetComputeRunningProcesses_v3 fills it.
struct NvmlProcessInfo {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id, compute_instance_id;
};
constexpr nvmlReturn_t kNvmlInsufficientSize = 7;

// nvmlUtilization_t: percent of the last sample period.
struct NvmlUtilization {
  unsigned int gpu, memory;
};

// NVML for sampling, loaded and initialised once per library and never
// unloaded: an agent samples every heartbeat, a launcher per container.
struct Sampler {
  Nvml nvml;
  nvmlReturn_t (*GetProcesses)(nvmlDevice_t, unsigned*, NvmlProcessInfo*) = nullptr;
  nvmlReturn_t (*GetUtilization)(nvmlDevice_t, NvmlUtilization*) = nullptr;
  bool ok = false;
};

// The sampler of `library` (ok false without a driver), under `lock`.
Sampler& SamplerOf(const std::string& library, std::unique_lock<std::mutex>* lock) {
  static std::mutex mu;
  static std::map<std::string, Sampler> loaded;
  *lock = std::unique_lock<std::mutex>(mu);
  auto [it, fresh] = loaded.try_emplace(library);
  Sampler& l = it->second;
  if (fresh) {
    l.nvml.lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    l.ok = l.nvml.lib != nullptr && l.nvml.Load(&l.nvml.Init, "nvmlInit_v2") &&
           l.nvml.Load(&l.nvml.GetCount, "nvmlDeviceGetCount_v2") &&
           l.nvml.Load(&l.nvml.GetHandle, "nvmlDeviceGetHandleByIndex_v2") &&
           l.nvml.Init() == kNvmlSuccess;
    if (l.ok) {
      // Either may be missing from an old driver: its figures are then left out.
      l.nvml.Load(&l.GetProcesses, "nvmlDeviceGetComputeRunningProcesses_v3");
      l.nvml.Load(&l.GetUtilization, "nvmlDeviceGetUtilizationRates");
      l.nvml.Load(&l.nvml.GetMemory, "nvmlDeviceGetMemoryInfo");
    }
  }
  return l;
}

}  // namespace

std::map<int, std::map<int64_t, uint64_t>> GpuMemoryByProcess(const std::string& library) {
  std::unique_lock<std::mutex> lock;
  Sampler& l = SamplerOf(library, &lock);
  std::map<int, std::map<int64_t, uint64_t>> out;
  unsigned count = 0;
  if (!l.ok || l.GetProcesses == nullptr || l.nvml.GetCount(&count) != kNvmlSuccess) return out;
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev;
    if (l.nvml.GetHandle(i, &dev) != kNvmlSuccess) continue;
    std::vector<NvmlProcessInfo> procs(16);
    unsigned n = static_cast<unsigned>(procs.size());
    nvmlReturn_t rc;
    // The list may grow between the calls; ask again with what NVML said.
    while ((rc = l.GetProcesses(dev, &n, procs.data())) == kNvmlInsufficientSize) {
      procs.resize(n + 8);
      n = static_cast<unsigned>(procs.size());
    }
    if (rc != kNvmlSuccess) continue;
    for (unsigned k = 0; k < n; ++k) {
      out[static_cast<int>(i)][procs[k].pid] += procs[k].used_gpu_memory;
    }
  }
  return out;
}

std::vector<GpuUsage> MeasureLocalGpus(const std::string& library) {
  std::unique_lock<std::mutex> lock;
  Sampler& l = SamplerOf(library, &lock);
  std::vector<GpuUsage> out;
  unsigned count = 0;
  if (!l.ok || l.nvml.GetCount(&count) != kNvmlSuccess) return out;
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev;
    if (l.nvml.GetHandle(i, &dev) != kNvmlSuccess) continue;
    GpuUsage u;
    u.index = static_cast<int>(i);
    NvmlMemory mem{};
    NvmlUtilization util{};
    // A GPU that answers neither (lost off the bus) is left out, not zero.
    const bool has_memory = l.nvml.GetMemory && l.nvml.GetMemory(dev, &mem) == kNvmlSuccess;
    const bool has_util = l.GetUtilization && l.GetUtilization(dev, &util) == kNvmlSuccess;
    if (!has_memory && !has_util) continue;
    u.memory_used = mem.used;
    u.utilization = static_cast<int>(util.gpu);
    out.push_back(u);
  }
  return out;
}

const char* GpuLinkName(GpuLink link) {
  switch (link) {
    case GpuLink::kSelf: return "self";
    case GpuLink::kNvLink: return "nvlink";
    case GpuLink::kPcieSwitch: return "pcie-switch";
    case GpuLink::kHostBridge: return "host-bridge";
    case GpuLink::kNuma: return "numa";
    case GpuLink::kSystem: return "system";
    case GpuLink::kUnknown: break;
  }
  return "unknown";
}

LocalGpus DiscoverLocalGpus(const std::string& library) {
  LocalGpus out;
  Nvml nvml;
  nvml.lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (nvml.lib == nullptr) {
    out.summary = "0 GPUs (NVML not found)";
    return out;
  }
  bool ok = nvml.Load(&nvml.Init, "nvmlInit_v2") && nvml.Load(&nvml.Shutdown, "nvmlShutdown") &&
            nvml.Load(&nvml.GetCount, "nvmlDeviceGetCount_v2") &&
            nvml.Load(&nvml.GetHandle, "nvmlDeviceGetHandleByIndex_v2") &&
            nvml.Load(&nvml.GetName, "nvmlDeviceGetName") &&
            nvml.Load(&nvml.GetUuid, "nvmlDeviceGetUUID") &&
            nvml.Load(&nvml.GetMemory, "nvmlDeviceGetMemoryInfo") &&
            nvml.Load(&nvml.GetPci, "nvmlDeviceGetPciInfo_v3");
  nvml.Load(&nvml.ErrorString, "nvmlErrorString");
  nvml.Load(&nvml.GetDriverVersion, "nvmlSystemGetDriverVersion");
  nvml.Load(&nvml.GetAncestor, "nvmlDeviceGetTopologyCommonAncestor");
  nvml.Load(&nvml.GetNvLinkState, "nvmlDeviceGetNvLinkState");
  nvml.Load(&nvml.GetNvLinkRemotePci, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
  if (!ok) {
    out.summary = absl::StrCat("0 GPUs (", library, " lacks NVML functions)");
    dlclose(nvml.lib);
    return out;
  }
  nvmlReturn_t rc = nvml.Init();
  if (rc != kNvmlSuccess) {
    out.summary = absl::StrCat("0 GPUs (NVML init failed: ", nvml.Error(rc), ")");
    dlclose(nvml.lib);
    return out;
  }
  char text[96] = {0};
  if (nvml.GetDriverVersion && nvml.GetDriverVersion(text, sizeof(text)) == kNvmlSuccess) {
    out.driver_version = text;
  }
  unsigned count = 0;
  std::vector<nvmlDevice_t> handles;
  std::string problem;
  if ((rc = nvml.GetCount(&count)) != kNvmlSuccess) {
    problem = absl::StrCat("device count: ", nvml.Error(rc));
    count = 0;
  }
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev;
    if ((rc = nvml.GetHandle(i, &dev)) != kNvmlSuccess) {
      problem = absl::StrCat("GPU ", i, ": ", nvml.Error(rc));
      break;
    }
    Gpu g;
    g.index = static_cast<int>(i);
    if (nvml.GetName(dev, text, sizeof(text)) == kNvmlSuccess) g.name = text;
    if (nvml.GetUuid(dev, text, sizeof(text)) == kNvmlSuccess) g.uuid = text;
    NvmlMemory mem{};
    if (nvml.GetMemory(dev, &mem) == kNvmlSuccess) g.memory = mem.total;
    NvmlPciInfo pci{};
    if (nvml.GetPci(dev, &pci) == kNvmlSuccess) {
      g.pci_bus_id = SysfsBusId(pci.bus_id);
      g.numa_node = NumaNodeOf(g.pci_bus_id);
    }
    handles.push_back(dev);
    out.gpus.push_back(std::move(g));
  }
  const size_t n = out.gpus.size();
  out.links.assign(n, std::vector<GpuLink>(n, GpuLink::kUnknown));
  std::vector<std::set<std::string>> switch_buses(n);
  for (size_t i = 0; i < n; ++i) {
    out.links[i][i] = GpuLink::kSelf;
    for (size_t j = i + 1; j < n; ++j) {
      int level = -1;
      if (nvml.GetAncestor && nvml.GetAncestor(handles[i], handles[j], &level) == kNvmlSuccess) {
        out.links[i][j] = out.links[j][i] = FromTopologyLevel(level);
      }
    }
    if (nvml.GetNvLinkState && nvml.GetNvLinkRemotePci) {
      for (unsigned l = 0; l < kNvLinkMaxLinks; ++l) {
        int active = 0;
        NvmlPciInfo remote{};
        if (nvml.GetNvLinkState(handles[i], l, &active) != kNvmlSuccess || !active) continue;
        if (nvml.GetNvLinkRemotePci(handles[i], l, &remote) != kNvmlSuccess) continue;
        std::string bus = SysfsBusId(remote.bus_id);
        for (size_t j = 0; j < n; ++j) {
          if (j != i && out.gpus[j].pci_bus_id == bus) {
            out.links[i][j] = out.links[j][i] = GpuLink::kNvLink;
          }
        }
        // A link to an NVSwitch, not a GPU: GPUs on one switch are NVLinked.
        if (std::none_of(out.gpus.begin(), out.gpus.end(),
                         [&](const Gpu& g) { return g.pci_bus_id == bus; })) {
          switch_buses[i].insert(bus);
        }
      }
    }
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      for (const auto& bus : switch_buses[i]) {
        if (switch_buses[j].count(bus)) out.links[i][j] = out.links[j][i] = GpuLink::kNvLink;
      }
    }
  }
  // switch_id: connected components of NVLink / PCIe-switch pairs.
  std::vector<size_t> parent(n);
  std::iota(parent.begin(), parent.end(), 0);
  std::function<size_t(size_t)> find = [&](size_t x) {
    return parent[x] == x ? x : parent[x] = find(parent[x]);
  };
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      if (out.links[i][j] == GpuLink::kNvLink || out.links[i][j] == GpuLink::kPcieSwitch) {
        parent[find(i)] = find(j);
      }
    }
  }
  std::vector<int> ids(n, -1);
  int next = 0;
  for (size_t i = 0; i < n; ++i) {
    size_t root = find(i);
    if (ids[root] < 0) ids[root] = next++;
    bool grouped = false;
    for (size_t j = 0; j < n; ++j) grouped |= j != i && find(j) == root;
    if (grouped) out.gpus[i].switch_id = ids[root];
  }
  nvml.Shutdown();
  dlclose(nvml.lib);
  out.summary = absl::StrCat(n, n == 1 ? " GPU" : " GPUs", " (NVML",
                             out.driver_version.empty() ? "" : ", driver " + out.driver_version,
                             problem.empty() ? "" : "; " + problem, ")");
  return out;
}

absl::StatusOr<Node> LocalNode(const std::string& name, Mode mode, const std::string& library) {
  Node node;
  node.name = name;
  // This host's name, as deepnex run and the kubernetes backend take it.
  if (node.name.empty()) node.name = HostName();
  if (node.name.empty()) return absl::InternalError("gethostname failed; give the node a name");
  node.mode = mode;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  node.cpus = cpus > 0 ? static_cast<int>(cpus) : 1;
  node.memory = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * page : 1;
  node.gpus = DiscoverLocalGpus(library).gpus;
  return node;
}

}  // namespace deepnex::gpu
