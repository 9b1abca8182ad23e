// deepnex._C.launch: container launch and supervision. The Python layer
// (python/deepnex/launch.py) turns byte sizes and Mount values into the plain
// values of the bound ContainerSpec, whose defaults are C++'s.
#include <chrono>
#include <memory>

#include "common.h"
#include "deepnex/gpu/types.h"
#include "deepnex/launch/central.h"
#include "deepnex/launch/launcher.h"
#include "launch/cgroup.h"
#include "launch/procfs.h"

namespace deepnex::python {
namespace {

using launch::ContainerSpec;
using launch::ExitStatus;
using launch::Handle;
using launch::Launcher;
using launch::LauncherOptions;
using StrMap = std::map<std::string, std::string>;


// ContainerSpec, bound so that its defaults live only in C++
// (deepnex.launch.ContainerSpec's fields default to a fresh one's). The
// restart policy is its text ("on-failure:3"), its backoffs seconds.
void RegisterContainerSpec(py::module_& m) {
  py::class_<launch::Mount>(m, "Mount")
      .def(py::init([](std::string source, std::string target, bool read_only) {
             return launch::Mount{std::move(source), std::move(target), read_only};
           }),
           py::arg("source"), py::arg("target"), py::arg("read_only"))
      .def_readwrite("source", &launch::Mount::source)
      .def_readwrite("target", &launch::Mount::target)
      .def_readwrite("read_only", &launch::Mount::read_only);

  py::class_<ContainerSpec>(m, "ContainerSpec")
      .def(py::init<>())
      .def_readwrite("name", &ContainerSpec::name)
      .def_readwrite("image", &ContainerSpec::image)
      .def_readwrite("command", &ContainerSpec::command)
      .def_readwrite("env", &ContainerSpec::env)
      .def_readwrite("working_dir", &ContainerSpec::working_dir)
      .def_readwrite("mounts", &ContainerSpec::mounts)
      .def_readwrite("cpus", &ContainerSpec::cpus)
      .def_readwrite("memory", &ContainerSpec::memory)
      .def_readwrite("pids_limit", &ContainerSpec::pids_limit)
      .def_readwrite("allocation", &ContainerSpec::allocation)
      .def_readwrite("user", &ContainerSpec::user)
      .def_readwrite("labels", &ContainerSpec::labels)
      .def_property(
          "restart", [](const ContainerSpec& s) { return s.restart.ToString(); },
          [](ContainerSpec& s, const std::string& text) {
            launch::RestartPolicy policy = Unwrap(launch::RestartPolicy::Parse(text));
            policy.backoff = s.restart.backoff;
            policy.max_backoff = s.restart.max_backoff;
            s.restart = policy;
          })
      .def_property(
          "backoff", [](const ContainerSpec& s) { return s.restart.backoff.count() / 1000.0; },
          [](ContainerSpec& s, double seconds) { s.restart.backoff = MillisOrZero(seconds, "backoff"); })
      .def_property(
          "max_backoff",
          [](const ContainerSpec& s) { return s.restart.max_backoff.count() / 1000.0; },
          [](ContainerSpec& s, double seconds) { s.restart.max_backoff = MillisOrZero(seconds, "max_backoff"); })
      .def_readwrite("network_none", &ContainerSpec::network_none)
      .def_readwrite("host_network", &ContainerSpec::host_network);
}

py::dict UsageDict(const launch::Usage& u) {
  py::dict d;
  d["cpu_seconds"] = u.cpu_seconds;
  d["memory"] = u.memory;
  d["memory_peak"] = u.memory_peak;
  d["pids"] = u.pids;
  d["gpu_memory"] = u.gpu_memory;
  return d;
}

// What `deepnex ps` shows for a container of a record: its cgroup's usage
// where it has one, else its process group's from /proc.
py::object RecordedUsage(const std::string& cgroup, int64_t pid) {
  std::optional<launch::Usage> u;
  {
    py::gil_scoped_release release;
    if (!cgroup.empty()) {
      auto cg = launch::Cgroup::Open(cgroup);
      if (cg.ok()) u = (*cg)->ReadUsage();
    }
    if (!u && pid > 0 && launch::ProcessAlive(static_cast<pid_t>(pid))) {
      u = launch::ProcUsage(launch::ProcessGroupMembers(static_cast<pid_t>(pid)));
    }
  }
  if (!u) return py::none();
  return UsageDict(*u);
}

// A container deepnex-central reports, shaped as a launcher's record (see
// python/deepnex/_cli_launch.py) so that `deepnex ps` shows both alike.
py::dict CentralRecord(const launch::CentralContainer& c) {
  py::dict d;
  d["name"] = c.name;
  d["user"] = c.user;
  d["allocation"] = c.allocation_id;
  d["backend"] = c.backend;
  d["id"] = c.id;
  d["state"] = launch::StateName(c.state);
  d["restarts"] = c.restarts;
  if (!c.last_exit.empty()) d["last_exit"] = c.last_exit;
  d["gpus"] = c.gpus;
  d["cpus"] = c.cpus;
  d["memory"] = c.memory;
  d["usage"] = UsageDict(c.usage);
  d["started_at"] = std::chrono::duration<double>(c.started_at.time_since_epoch()).count();
  d["allocation_released"] = c.allocation_released;
  d["node"] = c.node;
  return d;
}

py::dict ImageRecord(const launch::CentralImage& i) {
  py::dict d;
  d["name"] = i.name;
  d["tag"] = i.tag;
  d["owner"] = i.owner;
  d["visibility"] = i.visibility;
  d["shared_with"] = i.shared_with;
  d["size"] = i.size;
  d["created"] = std::chrono::duration<double>(i.created.time_since_epoch()).count();
  return d;
}

// Runs a catalog call without the GIL; its image as a dict.
template <class Fn>
py::dict ImageCall(Fn fn) {
  launch::CentralImage got;
  {
    py::gil_scoped_release release;
    got = Unwrap(fn());
  }
  return ImageRecord(got);
}

void RegisterCentralClient(py::module_& m) {
  py::class_<launch::CentralClient>(m, "CentralClient")
      // deepnex._C.gpu.CentralClientOptions, as deepnex.gpu.CentralClient
      // dials both services with the same options.
      .def(py::init([](const gpu::CentralClientOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(launch::CentralClient::Create(o));
           }),
           py::arg("options"))
      .def(
          "start",
          [](launch::CentralClient& c, const std::string& allocation_id,
             const ContainerSpec& spec) {
            launch::CentralContainer got;
            {
              py::gil_scoped_release release;
              got = Unwrap(c.StartContainer(spec, allocation_id));
            }
            return CentralRecord(got);
          },
          py::arg("allocation_id"), py::arg("spec"))
      .def(
          "list",
          [](launch::CentralClient& c, const std::string& user) {
            std::vector<launch::CentralContainer> got;
            {
              py::gil_scoped_release release;
              got = Unwrap(c.ListContainers(user));
            }
            py::list out;
            for (const auto& x : got) out.append(CentralRecord(x));
            return out;
          },
          py::arg("user") = "")
      .def(
          "stop",
          [](launch::CentralClient& c, const std::string& name, double grace,
             const std::string& user) {
            auto d = MillisOrZero(grace, "grace");
            launch::CentralContainer got;
            {
              py::gil_scoped_release release;
              got = Unwrap(c.StopContainer(name, d, user));
            }
            return CentralRecord(got);
          },
          py::arg("name"), py::arg("grace") = 10.0, py::arg("user") = "")
      .def(
          "logs",
          [](launch::CentralClient& c, const std::string& name, uint64_t offset,
             const std::string& user) {
            launch::LogChunk chunk;
            {
              py::gil_scoped_release release;
              chunk = Unwrap(c.ContainerLogs(name, offset, user));
            }
            return py::make_tuple(py::bytes(chunk.data), chunk.next_offset, chunk.ended);
          },
          py::arg("name"), py::arg("offset") = 0, py::arg("user") = "")
      .def(
          "follow_logs",
          [](launch::CentralClient& c, const std::string& name, py::function sink, double poll,
             const std::string& user) {
            auto every = MillisOrZero(poll, "poll");
            py::gil_scoped_release release;
            CheckStatus(c.FollowContainerLogs(
                name,
                [&](const std::string& chunk) {
                  py::gil_scoped_acquire acquire;
                  py::object more = sink(py::bytes(chunk));
                  return more.is_none() || more.cast<bool>();
                },
                every, user));
          },
          py::arg("name"), py::arg("sink"), py::arg("poll") = 0.2, py::arg("user") = "")
      .def("images",
           [](launch::CentralClient& c) {
             std::vector<launch::CentralImage> got;
             {
               py::gil_scoped_release release;
               got = Unwrap(c.ListImages());
             }
             py::list out;
             for (const auto& i : got) out.append(ImageRecord(i));
             return out;
           })
      .def(
          "register_image",
          [](launch::CentralClient& c, const std::string& name, const std::string& source,
             const std::string& owner, bool force) {
            return ImageCall([&] { return c.RegisterImage(name, source, owner, force); });
          },
          py::arg("name"), py::arg("source"), py::arg("owner") = "", py::arg("force") = false)
      .def(
          "share_image",
          [](launch::CentralClient& c, const std::string& name,
             const std::vector<std::string>& users, bool make_public) {
            return ImageCall([&] { return c.ShareImage(name, users, make_public); });
          },
          py::arg("name"), py::arg("users"), py::arg("public") = false)
      .def(
          "unshare_image",
          [](launch::CentralClient& c, const std::string& name,
             const std::vector<std::string>& users) {
            return ImageCall([&] { return c.UnshareImage(name, users); });
          },
          py::arg("name"), py::arg("users"))
      .def(
          "remove_image",
          [](launch::CentralClient& c, const std::string& name) {
            return ImageCall([&] { return c.RemoveImage(name); });
          },
          py::arg("name"))
      .def(
          "commit",
          [](launch::CentralClient& c, const std::string& container, const std::string& name) {
            return ImageCall([&] { return c.Commit(container, name); });
          },
          py::arg("container"), py::arg("name"));
}

}  // namespace

launch::LauncherOptions LauncherOptionsFromPython(const py::dict& kw) {
  using launch::LauncherOptions;
  LauncherOptions o;
  for (auto item : kw) {
    const std::string key = py::str(item.first);
    py::handle v = item.second;
    if (v.is_none()) continue;
    if (key == "backend") o.backend = v.cast<std::string>();
    else if (key == "state_dir") o.state_dir = v.cast<std::string>();
    else if (key == "id") o.id = v.cast<std::string>();
    else if (key == "allowed_mount_roots") o.allowed_mount_roots = v.cast<std::vector<std::string>>();
    else if (key == "min_memory") o.min_memory = v.cast<uint64_t>();
    else if (key == "cgroup_parent") o.cgroup_parent = v.cast<std::string>();
    else if (key == "require_cgroups") o.require_cgroups = v.cast<bool>();
    else if (key == "runc") o.oci.runc = v.cast<std::string>();
    else if (key == "runc_root") o.oci.root = v.cast<std::string>();
    else if (key == "oci_init") o.oci.init = v.cast<std::string>();
    else if (key == "docker_socket") o.docker.socket = v.cast<std::string>();
    else if (key == "docker_api_version") o.docker.api_version = v.cast<std::string>();
    else if (key == "slurm_partition") o.slurm.partition = v.cast<std::string>();
    else if (key == "slurm_bin_dir") o.slurm.bin_dir = v.cast<std::string>();
    else if (key == "slurm_env") o.slurm.env = v.cast<StrMap>();
    else if (key == "kubeconfig") o.kubernetes.kubeconfig = v.cast<std::string>();
    else if (key == "server") o.kubernetes.server = v.cast<std::string>();
    else if (key == "token") o.kubernetes.token = v.cast<std::string>();
    else if (key == "ca_file") o.kubernetes.ca_file = v.cast<std::string>();
    else if (key == "namespace") o.kubernetes.namespace_ = v.cast<std::string>();
    else if (key == "kind") o.kubernetes.kind = v.cast<std::string>();
    else if (key == "shared_gpu_memory_resource") o.kubernetes.shared_gpu_memory_resource = v.cast<std::string>();
    else ThrowStatus(absl::InvalidArgumentError("Launcher: unknown option \"" + key + "\""));
  }
  return o;
}

void RegisterLaunch(py::module_& parent) {
  py::module_ m = parent.def_submodule("launch", "container launch and supervision (C++ core)");
  RegisterContainerSpec(m);

  py::class_<ExitStatus>(m, "ExitStatus")
      .def_property_readonly("reason",
                             [](const ExitStatus& e) { return launch::ExitReasonName(e.reason); })
      .def_readonly("code", &ExitStatus::code)
      .def_readonly("signal", &ExitStatus::signal)
      .def_readonly("restarts", &ExitStatus::restarts)
      .def_property_readonly("ok", &ExitStatus::ok)
      .def("__str__", &ExitStatus::ToString)
      .def("__repr__", [](const ExitStatus& e) { return "ExitStatus(" + e.ToString() + ")"; });

  py::class_<launch::ContainerStatus>(m, "ContainerStatus")
      .def_readonly("name", &launch::ContainerStatus::name)
      .def_readonly("id", &launch::ContainerStatus::id)
      .def_property_readonly("state", [](const launch::ContainerStatus& s) {
        return launch::StateName(s.state);
      })
      .def_readonly("restarts", &launch::ContainerStatus::restarts)
      .def_readonly("last_exit", &launch::ContainerStatus::last_exit)
      .def_property_readonly("started_at", [](const launch::ContainerStatus& s) {
        return std::chrono::duration<double>(s.started_at.time_since_epoch()).count();
      })
      .def_readonly("queued", &launch::ContainerStatus::queued)
      .def("__repr__", [](const launch::ContainerStatus& s) {
        return "ContainerStatus(" + s.name + ", " + launch::StateName(s.state) + ", restarts " +
               std::to_string(s.restarts) + ")";
      });

  py::class_<Handle, std::shared_ptr<Handle>>(m, "Handle")
      .def_property_readonly("name", [](const Handle& h) { return h.spec().name; })
      .def_property_readonly("user", [](const Handle& h) { return h.spec().user; })
      .def_property_readonly("cpus", [](const Handle& h) { return h.spec().cpus; })
      .def_property_readonly("memory", [](const Handle& h) { return h.spec().memory; })
      .def_property_readonly("env", [](const Handle& h) { return h.spec().env; })
      .def_property_readonly("labels", [](const Handle& h) { return h.spec().labels; })
      .def("status", &Handle::Status, py::call_guard<py::gil_scoped_release>())
      .def(
          "wait",
          [](Handle& h, double timeout) {
            auto d = MillisOrZero(timeout, "timeout");
            py::gil_scoped_release release;
            return Unwrap(h.Wait(d));
          },
          py::arg("timeout"))
      .def(
          "stop",
          [](Handle& h, double grace) {
            auto d = MillisOrZero(grace, "grace");
            py::gil_scoped_release release;
            CheckStatus(h.Stop(d));
          },
          py::arg("grace") = 10.0)
      .def(
          "logs",
          [](Handle& h) {
            std::string logs;
            {
              py::gil_scoped_release release;
              logs = Unwrap(h.Logs());
            }
            return py::bytes(logs);
          })
      .def(
          "follow_logs",
          [](Handle& h, py::function sink) {
            py::gil_scoped_release release;
            CheckStatus(h.FollowLogs([&](const std::string& chunk) {
              py::gil_scoped_acquire acquire;
              py::object more = sink(py::bytes(chunk));
              return more.is_none() || more.cast<bool>();
            }));
          },
          py::arg("sink"))
      .def("usage", [](Handle& h) {
        launch::Usage u;
        {
          py::gil_scoped_release release;
          u = Unwrap(h.Usage());
        }
        return UsageDict(u);
      });

  py::class_<Launcher, GilFreeHolder<Launcher>>(m, "Launcher")
      .def(py::init([](py::kwargs kw) {
        LauncherOptions o = LauncherOptionsFromPython(kw);
        py::gil_scoped_release release;
        return GilFree(Unwrap(Launcher::Create(o)));
      }))
      .def_property_readonly("backend", &Launcher::backend)
      .def_property_readonly("id", &Launcher::id)
      .def(
          "start",
          [](Launcher& l, const ContainerSpec& spec) { return Unwrap(l.Start(spec)); },
          py::arg("spec"), py::call_guard<py::gil_scoped_release>())
      .def("list", &Launcher::List, py::call_guard<py::gil_scoped_release>())
      .def(
          "get", [](Launcher& l, const std::string& name) { return Unwrap(l.Get(name)); },
          py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def(
          "remove", [](Launcher& l, const std::string& name) { CheckStatus(l.Remove(name)); },
          py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def(
          "cleanup", [](Launcher& l, const std::string& id) { return Unwrap(l.Cleanup(id)); },
          py::arg("launcher_id"), py::call_guard<py::gil_scoped_release>());

  m.def("probe_backends", [](py::kwargs kw) {
    LauncherOptions o = LauncherOptionsFromPython(kw);
    py::gil_scoped_release release;
    return launch::ProbeBackends(o);
  });
  m.def("recorded_usage", &RecordedUsage, py::arg("cgroup"), py::arg("pid"));
  RegisterCentralClient(m);
  RegisterSession(m);
}

}  // namespace deepnex::python
