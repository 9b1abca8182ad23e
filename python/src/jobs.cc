// deepnex._C.jobs: deepnex-central's job records (include/deepnex/gpu/jobs.h).
// Jobs come back as dicts; python/deepnex/gpu.py's CentralClient wraps them.
#include <chrono>
#include <memory>

#include "common.h"
#include "deepnex/gpu/central.h"
#include "deepnex/gpu/jobs.h"

namespace deepnex::python {
namespace {

using gpu::JobRecord;

int64_t Ms(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

py::dict JobDict(const JobRecord& j) {
  py::dict d;
  d["name"] = j.name;
  d["user"] = j.user;
  d["command"] = j.command;
  d["mode"] = j.mode;
  d["workers"] = j.workers;
  d["min_workers"] = j.min_workers;
  d["max_workers"] = j.max_workers;
  d["resizes"] = j.resizes;
  d["last_resize"] = j.last_resize;
  d["ps"] = j.ps;
  py::list allocations;
  for (const auto& a : j.allocations) {
    py::dict x;
    x["id"] = a.id;
    x["node"] = a.node;
    x["gpus"] = a.gpus;
    x["cpus"] = a.cpus;
    x["memory"] = a.memory;
    allocations.append(x);
  }
  d["allocations"] = allocations;
  d["nodes"] = j.nodes;
  d["state"] = gpu::JobStateName(j.state);
  // Milliseconds since the epoch, central's clock; 0: not yet.
  d["submitted_ms"] = Ms(j.submitted);
  d["started_ms"] = Ms(j.started);
  d["ended_ms"] = Ms(j.ended);
  d["exit_code"] = j.exit_code;
  d["restarts"] = j.restarts;
  py::list containers;
  for (const auto& c : j.containers) {
    py::dict x;
    x["name"] = c.name;
    x["node"] = c.node;
    x["role"] = c.role;
    x["state"] = c.state;
    x["restarts"] = c.restarts;
    x["last_exit"] = c.last_exit;
    x["cpu_seconds"] = c.cpu_seconds;
    x["memory_peak"] = c.memory_peak;
    containers.append(x);
  }
  d["containers"] = containers;
  d["message"] = j.message;
  d["cancelled_by"] = j.cancelled_by;
  d["lost"] = j.lost;
  d["elapsed"] = j.elapsed_seconds;
  d["gpu_hours"] = j.gpu_hours;
  d["cpu_hours"] = j.cpu_hours;
  d["peak_memory"] = j.peak_memory;
  // Rank 0's last deepnex.report(): {"step", "metrics", "time_ms" (the
  // runner's clock)}; None before the first.
  if (Ms(j.report.time) != 0) {
    py::dict report;
    report["step"] = j.report.step;
    report["metrics"] = j.report.metrics;
    report["time_ms"] = Ms(j.report.time);
    d["report"] = report;
  } else {
    d["report"] = py::none();
  }
  d["notify_every_minutes"] = j.notify_every.count() / 60000.0;
  d["notify_when"] = j.notify_when;
  return d;
}

}  // namespace

void RegisterJobs(py::module_& parent) {
  py::module_ m = parent.def_submodule("jobs", "deepnex-central's job records (C++ core)");
  py::class_<gpu::JobsClient>(m, "JobsClient")
      .def(py::init([](const gpu::CentralClientOptions& o) {
             py::gil_scoped_release release;
             return Unwrap(gpu::JobsClient::Create(o));
           }),
           py::arg("options"))
      .def(
          "list",
          [](gpu::JobsClient& c, bool all, const std::string& user, const std::string& state,
             int64_t since_ms) {
            gpu::JobFilter f;
            f.all = all;
            f.user = user;
            f.state = state;
            f.since = std::chrono::system_clock::time_point(
                std::chrono::duration_cast<std::chrono::system_clock::duration>(
                    std::chrono::milliseconds(since_ms)));
            std::vector<JobRecord> jobs;
            {
              py::gil_scoped_release release;
              jobs = Unwrap(c.List(f));
            }
            py::list out;
            for (const auto& j : jobs) out.append(JobDict(j));
            return out;
          },
          py::arg("all"), py::arg("user"), py::arg("state"), py::arg("since_ms"))
      .def(
          "get",
          [](gpu::JobsClient& c, const std::string& name) {
            JobRecord j;
            {
              py::gil_scoped_release release;
              j = Unwrap(c.Get(name));
            }
            return JobDict(j);
          },
          py::arg("name"))
      .def(
          "cancel",
          [](gpu::JobsClient& c, const std::string& name) {
            JobRecord j;
            {
              py::gil_scoped_release release;
              j = Unwrap(c.Cancel(name));
            }
            return JobDict(j);
          },
          py::arg("name"));
}

}  // namespace deepnex::python
