// deepnex._C.gpu: the GPU allocator. The Python layer (python/deepnex/gpu.py)
// turns byte sizes such as "80GiB" into the plain values these take, and
// fills the bound option structs, whose defaults are C++'s.
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>

#include "common.h"
#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/central.h"
#include "deepnex/gpu/discovery.h"
#include "deepnex/units.h"

namespace deepnex::python {
namespace {

using gpu::Allocation;
using gpu::Allocator;
using gpu::GrantedGpu;
using gpu::Mode;
using gpu::NodeInfo;

using Labels = std::map<std::string, std::string>;
// (memory, uuid, name, index, numa_node, switch_id, pci_bus_id)
using GpuArgs = std::tuple<uint64_t, std::string, std::string, int, int, int, std::string>;

Mode ModeOf(const std::string& mode, const char* field) { return Unwrap(gpu::ParseMode(mode, field)); }

gpu::Node MakeNode(const std::string& name, const std::vector<GpuArgs>& gpus, int cpus,
                   uint64_t memory, const std::string& mode, const Labels& labels) {
  gpu::Node n;
  n.name = name;
  for (const auto& [mem, uuid, gname, index, numa, sw, pci] : gpus) {
    gpu::Gpu g;
    g.memory = mem;
    g.uuid = uuid;
    g.name = gname;
    g.index = index;
    g.numa_node = numa;
    g.switch_id = sw;
    g.pci_bus_id = pci;
    n.gpus.push_back(std::move(g));
  }
  n.cpus = cpus;
  n.memory = memory;
  n.mode = ModeOf(mode, "mode");
  n.labels = labels;
  return n;
}

py::dict GpuDict(const gpu::Gpu& g) {
  py::dict d;
  d["index"] = g.index;
  d["uuid"] = g.uuid;
  d["name"] = g.name;
  d["memory"] = g.memory;
  d["pci_bus_id"] = g.pci_bus_id;
  d["numa_node"] = g.numa_node;
  d["switch_id"] = g.switch_id;
  return d;
}

py::dict NodeDict(const gpu::Node& n) {
  py::dict d;
  d["name"] = n.name;
  py::list gpus;
  for (const auto& g : n.gpus) gpus.append(GpuDict(g));
  d["gpus"] = gpus;
  d["cpus"] = n.cpus;
  d["memory"] = n.memory;
  d["mode"] = gpu::ModeName(n.mode);
  d["labels"] = n.labels;
  return d;
}

py::dict QuotaDict(const gpu::Quota& q) {
  py::dict d;
  d["gpus"] = q.gpus;
  d["gpu_memory"] = q.gpu_memory;
  d["cpus"] = q.cpus;
  d["memory"] = q.memory;
  d["max_priority"] = q.max_priority;
  return d;
}

py::dict UsageDict(const gpu::Usage& u) {
  py::dict d;
  d["gpus"] = u.gpus;
  d["gpu_memory"] = u.gpu_memory;
  d["cpus"] = u.cpus;
  d["memory"] = u.memory;
  return d;
}

py::list QuotaList(const std::vector<gpu::UserQuota>& quotas) {
  py::list out;
  for (const auto& q : quotas) {
    py::dict d;
    d["user"] = q.user;
    d["own"] = q.own;
    d["quota"] = QuotaDict(q.quota);
    d["usage"] = UsageDict(q.usage);
    out.append(d);
  }
  return out;
}

py::list PendingList(const std::vector<gpu::PendingRequest>& pending) {
  py::list out;
  for (const auto& p : pending) {
    const gpu::Request& r = p.request;
    py::dict d;
    d["position"] = p.position;
    d["id"] = p.id;
    d["user"] = r.user;
    d["gpus"] = r.gpus;
    d["mode"] = gpu::ModeName(r.mode);
    d["gpu_memory"] = r.gpu_memory;
    d["cpus"] = r.cpus;
    d["memory"] = r.memory;
    d["replicas"] = r.replicas;
    d["priority"] = r.priority;
    d["node"] = r.node;
    d["selector"] = r.selector;
    d["waited"] = p.waited.count() / 1000.0;
    d["reason"] = p.reason;
    out.append(d);
  }
  return out;
}

gpu::Quota MakeQuota(std::optional<int64_t> gpus, std::optional<uint64_t> gpu_memory,
                     std::optional<int64_t> cpus, std::optional<uint64_t> memory,
                     int max_priority) {
  gpu::Quota q;
  q.gpus = gpus;
  q.gpu_memory = gpu_memory;
  q.cpus = cpus;
  q.memory = memory;
  q.max_priority = max_priority;
  return q;
}

template <class T>
T Val(T v) {
  return v;
}
template <class T>
T Val(absl::StatusOr<T> v) {
  return Unwrap(std::move(v));
}

// A request that may wait in the queue, waited for in slices with Python's
// signal handlers run between them, so that Ctrl-C is not held off until a
// grant: the request is then withdrawn, a grant that crossed the withdrawal
// released, and the KeyboardInterrupt raised.
template <class Api>
std::vector<gpu::Allocation> AllocateInterruptibly(Api& a, const gpu::Request& r,
                                                   const gpu::AllocateOptions& o) {
  struct Result {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<absl::StatusOr<std::vector<gpu::Allocation>>> value;
  };
  auto result = std::make_shared<Result>();
  uint64_t ticket;
  {
    py::gil_scoped_release release;
    ticket = a.AllocateGangAsync(r, o, [result](absl::StatusOr<std::vector<gpu::Allocation>> v) {
      std::lock_guard<std::mutex> lock(result->mu);
      result->value = std::move(v);
      result->cv.notify_all();
    });
  }
  // Whether the answer came within `slice` (forever: none).
  auto answered = [&result](std::optional<std::chrono::milliseconds> slice) {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(result->mu);
    auto ready = [&result] { return result->value.has_value(); };
    if (!slice) {
      result->cv.wait(lock, ready);
      return true;
    }
    return result->cv.wait_for(lock, *slice, ready);
  };
  while (!answered(std::chrono::milliseconds(100))) {
    if (PyErr_CheckSignals() == 0) continue;
    py::error_already_set interrupted;  // takes the handler's exception
    {
      py::gil_scoped_release release;
      a.Withdraw(ticket);
    }
    answered(std::nullopt);
    if (result->value->ok()) {
      py::gil_scoped_release release;
      for (const gpu::Allocation& granted : **result->value) (void)a.Release(granted.id);
    }
    throw interrupted;
  }
  return Unwrap(std::move(*result->value));
}

// The methods Allocator and CentralClient share, with the same signatures.
template <class Api, class Class>
void BindApi(Class& c) {
  c.def(
       "add_node",
       [](Api& a, const std::string& name, const std::vector<GpuArgs>& gpus, int cpus,
          uint64_t memory, const std::string& mode, const Labels& labels) {
         gpu::Node n = MakeNode(name, gpus, cpus, memory, mode, labels);
         py::gil_scoped_release release;
         CheckStatus(a.AddNode(n));
       },
       py::arg("name"), py::arg("gpus"), py::arg("cpus"), py::arg("memory"), py::arg("mode"),
       py::arg("labels"))
      .def(
          "remove_node",
          [](Api& a, const std::string& name) { CheckStatus(a.RemoveNode(name)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "set_node_mode",
          [](Api& a, const std::string& name, const std::string& mode, bool when_drained) {
            Mode m = ModeOf(mode, "mode");
            py::gil_scoped_release release;
            CheckStatus(a.SetNodeMode(
                name, m, when_drained ? gpu::ModeSwitch::kWhenDrained : gpu::ModeSwitch::kRefuse));
          },
          py::arg("name"), py::arg("mode"), py::arg("when_drained"))
      .def(
          "cordon", [](Api& a, const std::string& name) { CheckStatus(a.Cordon(name)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "uncordon", [](Api& a, const std::string& name) { CheckStatus(a.Uncordon(name)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "drain",
          [](Api& a, const std::string& name, bool release) {
            CheckStatus(a.Drain(name, release));
          },
          py::arg("name"), py::arg("release"), py::call_guard<py::gil_scoped_release>())
      .def(
          "allocate",
          [](Api& a, const gpu::Request& r, bool wait, double timeout) {
            gpu::AllocateOptions o;
            o.wait = wait;
            o.timeout = MillisOrZero(timeout, "timeout");
            if (wait) return AllocateInterruptibly(a, r, o);
            py::gil_scoped_release release;
            return Unwrap(a.AllocateGang(r, o));
          },
          py::arg("request"), py::arg("wait"), py::arg("timeout"))
      .def(
          "release", [](Api& a, const std::string& id) { CheckStatus(a.Release(id)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "renew", [](Api& a, const std::string& id) { return Unwrap(a.Renew(id)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "nodes", [](Api& a) { return Val(a.Nodes()); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "allocations", [](Api& a, const std::string& user) { return Val(a.Allocations(user)); },
          py::arg("user"), py::call_guard<py::gil_scoped_release>())
      .def(
          "quotas",
          [](Api& a, const std::string& user) {
            std::vector<gpu::UserQuota> quotas;
            {
              py::gil_scoped_release release;
              quotas = Val(a.Quotas(user));
            }
            return QuotaList(quotas);
          },
          py::arg("user"))
      .def(
          "pending",
          [](Api& a, const std::string& user) {
            std::vector<gpu::PendingRequest> pending;
            {
              py::gil_scoped_release release;
              pending = Val(a.Pending(user));
            }
            return PendingList(pending);
          },
          py::arg("user"));
}

}  // namespace

void RegisterGpu(py::module_& parent) {
  py::module_ m = parent.def_submodule("gpu", "GPU allocation (C++ core)");

  py::class_<GrantedGpu>(m, "GrantedGpu")
      .def_readonly("index", &GrantedGpu::index)
      .def_readonly("uuid", &GrantedGpu::uuid)
      .def_readonly("memory", &GrantedGpu::memory)
      .def_readonly("exclusive", &GrantedGpu::exclusive)
      .def("__repr__", [](const GrantedGpu& g) {
        return "GrantedGpu(index=" + std::to_string(g.index) + ", uuid='" + g.uuid +
               "', memory=" + FormatByteSize(g.memory) +
               (g.exclusive ? ", exclusive)" : ", shared)");
      });

  py::class_<Allocation>(m, "Allocation")
      .def_readonly("id", &Allocation::id)
      .def_readonly("user", &Allocation::user)
      .def_readonly("job", &Allocation::job)
      .def_readonly("node", &Allocation::node)
      .def_readonly("gpus", &Allocation::gpus)
      .def_readonly("cpus", &Allocation::cpus)
      .def_readonly("memory", &Allocation::memory)
      .def_readonly("priority", &Allocation::priority)
      .def_readonly("gang", &Allocation::gang)
      .def_readonly("replica", &Allocation::replica)
      .def_property_readonly("lease", [](const Allocation& a) -> std::optional<double> {
        if (a.lease_ms == 0) return std::nullopt;
        return a.lease_ms / 1000.0;
      })
      .def_property_readonly("expires_at", [](const Allocation& a) -> std::optional<double> {
        if (a.expires_at_ms == 0) return std::nullopt;
        return a.expires_at_ms / 1000.0;
      })
      .def_readonly("env", &Allocation::env)
      .def("__repr__", [](const Allocation& a) { return "Allocation(" + a.ToString() + ")"; });

  py::class_<NodeInfo>(m, "NodeInfo")
      .def_property_readonly("name", [](const NodeInfo& n) { return n.node.name; })
      .def_property_readonly("node", [](const NodeInfo& n) { return NodeDict(n.node); })
      .def_property_readonly("mode", [](const NodeInfo& n) { return gpu::ModeName(n.mode); })
      .def_property_readonly("pending_mode", [](const NodeInfo& n) -> std::optional<std::string> {
        if (!n.pending_mode) return std::nullopt;
        return std::string(gpu::ModeName(*n.pending_mode));
      })
      .def_readonly("cordoned", &NodeInfo::cordoned)
      .def_readonly("draining", &NodeInfo::draining)
      .def_readonly("ready", &NodeInfo::ready)
      .def_readonly("cpus_busy", &NodeInfo::cpus_busy)
      .def_readonly("memory_in_use", &NodeInfo::memory_in_use)
      .def_readonly("address", &NodeInfo::address)
      .def_property_readonly("gpu_usage", [](const NodeInfo& n) {
        // As the node's agent measures through NVML; [] without a driver.
        py::list out;
        for (const gpu::GpuUsage& u : n.gpu_usage) {
          py::dict d;
          d["index"] = u.index;
          d["memory_used"] = u.memory_used;
          d["utilization"] = u.utilization;
          out.append(d);
        }
        return out;
      })
      .def_property_readonly("last_heartbeat", [](const NodeInfo& n) -> std::optional<double> {
        // Seconds since the epoch; None for a node without an agent.
        if (n.last_heartbeat_ms == 0) return std::nullopt;
        return n.last_heartbeat_ms / 1000.0;
      })
      .def_property_readonly("gpus", [](const NodeInfo& n) {
        py::list out;
        for (size_t i = 0; i < n.node.gpus.size(); ++i) {
          py::dict d = GpuDict(n.node.gpus[i]);
          d["memory_used"] = n.gpu_memory_used[i];
          d["allocations"] = n.gpu_allocations[i];
          out.append(d);
        }
        return out;
      })
      .def_property_readonly("gpus_free", &NodeInfo::gpus_free)
      .def_property_readonly("cpus", [](const NodeInfo& n) { return n.node.cpus; })
      .def_property_readonly("memory", [](const NodeInfo& n) { return n.node.memory; })
      .def_readonly("cpus_used", &NodeInfo::cpus_used)
      .def_readonly("memory_used", &NodeInfo::memory_used)
      .def_property_readonly("labels", [](const NodeInfo& n) { return n.node.labels; })
      .def_readonly("allocation_ids", &NodeInfo::allocation_ids)
      .def("__repr__", [](const NodeInfo& n) {
        return "NodeInfo(name='" + n.node.name + "', mode=" + gpu::ModeName(n.mode) +
               ", gpus_free=" + std::to_string(n.gpus_free()) + "/" +
               std::to_string(n.node.gpus.size()) + ", cpus_used=" +
               std::to_string(n.cpus_used) + "/" + std::to_string(n.node.cpus) +
               (n.cordoned ? ", cordoned" : "") + (n.ready ? "" : ", not ready") + ")";
      });

  // The option structs, bound so that their defaults live only in C++:
  // deepnex/gpu.py reads its keyword defaults from fresh ones.
  py::class_<gpu::AllocatorOptions> allocator_options(m, "AllocatorOptions");
  allocator_options.def(py::init<>())
      .def_readwrite("state_dir", &gpu::AllocatorOptions::state_dir)
      .def_readwrite("fsync", &gpu::AllocatorOptions::fsync)
      .def_readwrite("snapshot_every", &gpu::AllocatorOptions::snapshot_every);
  DefSeconds(allocator_options, "lease_check_interval",
             &gpu::AllocatorOptions::lease_check_interval, MillisOrZero);
  DefSeconds(allocator_options, "reservation_after", &gpu::AllocatorOptions::reservation_after,
             MillisOrZero);

  py::class_<gpu::Request> request(m, "Request");
  request.def(py::init<>())
      .def_readwrite("user", &gpu::Request::user)
      .def_readwrite("job", &gpu::Request::job)
      .def_readwrite("gpus", &gpu::Request::gpus)
      .def_property(
          "mode", [](const gpu::Request& r) { return gpu::ModeName(r.mode); },
          [](gpu::Request& r, const std::string& mode) { r.mode = ModeOf(mode, "mode"); })
      .def_readwrite("gpu_memory", &gpu::Request::gpu_memory)
      .def_readwrite("cpus", &gpu::Request::cpus)
      .def_readwrite("memory", &gpu::Request::memory)
      .def_readwrite("selector", &gpu::Request::selector)
      .def_readwrite("node", &gpu::Request::node)
      .def_readwrite("priority", &gpu::Request::priority)
      .def_readwrite("replicas", &gpu::Request::replicas)
      .def_readwrite("spread", &gpu::Request::spread);
  // 0: no lease.
  DefSeconds(request, "lease", &gpu::Request::lease, MillisOrZero);

  py::class_<gpu::CentralClientOptions> central_options(m, "CentralClientOptions");
  central_options.def(py::init<>())
      .def_readwrite("address", &gpu::CentralClientOptions::address)
      .def_readwrite("token", &gpu::CentralClientOptions::token)
      .def_readwrite("token_file", &gpu::CentralClientOptions::token_file)
      .def_readwrite("tls_ca_file", &gpu::CentralClientOptions::tls_ca_file);
  DefSeconds(central_options, "timeout", &gpu::CentralClientOptions::timeout, MillisOrZero);

  py::class_<Allocator> allocator(m, "Allocator");
  allocator
      .def(py::init([](const gpu::AllocatorOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(Allocator::Create(o));
           }),
           py::arg("options"))
      .def(
          "set_quota",
          [](Allocator& a, const std::string& user, std::optional<int64_t> gpus,
             std::optional<uint64_t> gpu_memory, std::optional<int64_t> cpus,
             std::optional<uint64_t> memory, int max_priority) {
            gpu::Quota q = MakeQuota(gpus, gpu_memory, cpus, memory, max_priority);
            py::gil_scoped_release release;
            return user.empty() ? Unwrap(a.SetDefaultQuota(q)) : Unwrap(a.SetQuota(user, q));
          },
          py::arg("user"), py::arg("gpus"), py::arg("gpu_memory"), py::arg("cpus"),
          py::arg("memory"), py::arg("max_priority"))
      .def(
          "clear_quota",
          [](Allocator& a, const std::string& user) { CheckStatus(a.ClearQuota(user)); },
          py::call_guard<py::gil_scoped_release>())
      .def("quota",
           [](const Allocator& a, const std::string& user) { return QuotaDict(a.GetQuota(user)); })
      .def("usage",
           [](const Allocator& a, const std::string& user) { return UsageDict(a.GetUsage(user)); })
      .def(
          "node", [](const Allocator& a, const std::string& name) { return Unwrap(a.GetNode(name)); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "allocation",
          [](const Allocator& a, const std::string& id) { return Unwrap(a.GetAllocation(id)); },
          py::call_guard<py::gil_scoped_release>())
      .def("queue_length", &Allocator::QueueLength)
      .def(
          "compact", [](Allocator& a) { CheckStatus(a.Compact()); },
          py::call_guard<py::gil_scoped_release>())
      .def("ledger_records", &Allocator::LedgerRecords)
      .def("state_digest", [](const Allocator& a) { return py::bytes(a.StateDigest()); })
      .def(
          "check_invariants", [](const Allocator& a) { CheckStatus(a.CheckInvariants()); },
          py::call_guard<py::gil_scoped_release>());
  BindApi<Allocator>(allocator);

  py::class_<gpu::CentralClient> central(m, "CentralClient");
  central
      .def(py::init([](const gpu::CentralClientOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(gpu::CentralClient::Create(o));
           }),
           py::arg("options"))
      .def(
          "set_quota",
          [](gpu::CentralClient& a, const std::string& user, std::optional<int64_t> gpus,
             std::optional<uint64_t> gpu_memory, std::optional<int64_t> cpus,
             std::optional<uint64_t> memory, int max_priority) {
            gpu::Quota q = MakeQuota(gpus, gpu_memory, cpus, memory, max_priority);
            py::gil_scoped_release release;
            return Unwrap(a.SetQuota(user, q));
          },
          py::arg("user"), py::arg("gpus"), py::arg("gpu_memory"), py::arg("cpus"),
          py::arg("memory"), py::arg("max_priority"))
      .def(
          "metrics", [](gpu::CentralClient& a) { return Unwrap(a.Metrics()); },
          py::call_guard<py::gil_scoped_release>());
  BindApi<gpu::CentralClient>(central);

  m.def(
      "discover",
      [](const std::string& library) {
        gpu::LocalGpus local;
        {
          py::gil_scoped_release release;
          local = gpu::DiscoverLocalGpus(library);
        }
        py::dict d;
        py::list gpus;
        for (const auto& g : local.gpus) gpus.append(GpuDict(g));
        d["gpus"] = gpus;
        py::list links;
        for (const auto& row : local.links) {
          py::list r;
          for (auto l : row) r.append(gpu::GpuLinkName(l));
          links.append(r);
        }
        d["links"] = links;
        d["driver_version"] = local.driver_version;
        d["summary"] = local.summary;
        return d;
      },
      py::arg("library"));
  m.def(
      "local_node",
      [](const std::string& name, const std::string& mode) {
        Mode md = ModeOf(mode, "mode");
        gpu::Node n;
        {
          py::gil_scoped_release release;
          n = Unwrap(gpu::LocalNode(name, md));
        }
        return NodeDict(n);
      },
      py::arg("name"), py::arg("mode"));
  m.def(
      "load_nodes",
      [](const std::string& path) {
        std::vector<gpu::Node> nodes;
        {
          py::gil_scoped_release release;
          nodes = Unwrap(gpu::LoadNodesFile(path));
        }
        py::list out;
        for (const auto& n : nodes) out.append(NodeDict(n));
        return out;
      },
      py::arg("path"));
  m.def(
      "parse_nodes",
      [](const std::string& text, const std::string& source) {
        py::list out;
        for (const auto& n : Unwrap(gpu::ParseNodesJson(text, source))) out.append(NodeDict(n));
        return out;
      },
      py::arg("text"), py::arg("source"));
}

}  // namespace deepnex::python
