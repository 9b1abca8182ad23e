// deepnex._C.job: deepnex::job::Job. python/deepnex/job.py turns sizes and
// launcher keywords into the plain values of the bound JobOptions, whose
// defaults are C++'s.
#include <chrono>
#include <memory>

#include "common.h"
#include "deepnex/job/job.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::python {
namespace {

// A Python callable the job calls from its own threads (log followers,
// supervisors): it takes the GIL, and a failing callable cannot kill those
// threads. The job (and so this) may be destroyed without the GIL
// (GilFreeHolder): dropping the callable takes it. REQUIRES: constructed
// with the GIL held.
class Callback {
 public:
  Callback(py::object callable, const char* what)
      : fn_(new py::object(std::move(callable)),
            [](py::object* f) {
              py::gil_scoped_acquire gil;
              delete f;
            }),
        what_(what) {}

  template <typename... Args>
  void operator()(const Args&... args) const {
    py::gil_scoped_acquire gil;
    try {
      (*fn_)(args...);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable(what_);
    }
  }

 private:
  std::shared_ptr<py::object> fn_;
  const char* what_;
};

}  // namespace

void RegisterJob(py::module_& parent) {
  py::module_ m = parent.def_submodule("job", "jobs: allocate, launch, supervise (C++ core)");
  using job::Job;
  using job::JobOptions;
  using job::JobResult;

  py::class_<JobResult>(m, "JobResult")
      .def_readonly("exit_code", &JobResult::exit_code)
      .def_readonly("workers", &JobResult::workers)
      .def_readonly("seconds", &JobResult::seconds)
      .def_readonly("stopped", &JobResult::stopped)
      .def("__repr__", [](const JobResult& r) {
        return "JobResult(exit_code=" + std::to_string(r.exit_code) + ", " +
               std::to_string(r.workers.size()) + " workers)";
      });

  // JobOptions, bound so that its defaults live only in C++
  // (deepnex.job.Job's keyword defaults are a fresh one's). The launcher's
  // options other than its backend, and the callbacks, go to Job itself.
  py::class_<JobOptions>(m, "JobOptions")
      .def(py::init<>())
      .def_readwrite("name", &JobOptions::name)
      .def_readwrite("command", &JobOptions::command)
      .def_readwrite("workers", &JobOptions::workers)
      .def_readwrite("min_workers", &JobOptions::min_workers)
      .def_readwrite("nodes", &JobOptions::nodes)
      .def_readwrite("advertise_address", &JobOptions::advertise_address)
      .def_readwrite("ps", &JobOptions::ps)
      .def_readwrite("mode", &JobOptions::mode)
      .def_readwrite("gpus_per_worker", &JobOptions::gpus_per_worker)
      .def_property(
          "gpu_mode", [](const JobOptions& o) { return gpu::ModeName(o.gpu_mode); },
          [](JobOptions& o, const std::string& mode) {
            o.gpu_mode = Unwrap(gpu::ParseMode(mode, "gpu_mode"));
          })
      .def_readwrite("gpu_memory", &JobOptions::gpu_memory)
      .def_readwrite("cpus", &JobOptions::cpus)
      .def_readwrite("memory", &JobOptions::memory)
      .def_readwrite("user", &JobOptions::user)
      .def_readwrite("central", &JobOptions::central)
      .def_readwrite("central_token", &JobOptions::central_token)
      .def_readwrite("central_token_file", &JobOptions::central_token_file)
      .def_readwrite("notify", &JobOptions::notify)
      .def_property(
          "notify_every_minutes",
          [](const JobOptions& o) { return o.notify_every.count() / 60000.0; },
          [](JobOptions& o, double minutes) {
            o.notify_every = MillisOrZero(minutes * 60, "notify_every (seconds)");
          })
      .def_readwrite("notify_when", &JobOptions::notify_when)
      .def_property(
          "backend", [](const JobOptions& o) { return o.launcher.backend; },
          [](JobOptions& o, const std::string& backend) { o.launcher.backend = backend; })
      .def_property(
          "restart", [](const JobOptions& o) { return o.restart.ToString(); },
          [](JobOptions& o, const std::string& text) {
            o.restart = Unwrap(launch::RestartPolicy::Parse(text));
          })
      .def_readwrite("checkpoint_dir", &JobOptions::checkpoint_dir)
      .def_readwrite("optimizer", &JobOptions::optimizer)
      .def_readwrite("lr", &JobOptions::lr)
      .def_readwrite("momentum", &JobOptions::momentum)
      .def_readwrite("ps_binary", &JobOptions::ps_binary)
      .def_readwrite("image", &JobOptions::image)
      .def_readwrite("env", &JobOptions::env)
      .def_readwrite("working_dir", &JobOptions::working_dir)
      // deepnex._C.launch.Mount values.
      .def_readwrite("mounts", &JobOptions::mounts);

  py::class_<Job, GilFreeHolder<Job>>(m, "Job")
      .def(py::init([](JobOptions o, const py::dict& launcher, py::object output,
                       py::object on_event) {
             std::string backend = o.launcher.backend;
             o.launcher = LauncherOptionsFromPython(launcher);
             o.launcher.backend = backend;
             if (!output.is_none()) {
               o.output = [fn = Callback(output, "deepnex job output")](
                              const std::string& who, const std::string& line) { fn(who, line); };
             }
             if (!on_event.is_none()) {
               o.on_event = [fn = Callback(on_event, "deepnex job on_event")](
                                const std::string& message) { fn(message); };
             }
             return GilFree(Unwrap(Job::Create(o)));
           }),
           py::arg("options"), py::arg("launcher"), py::arg("output"), py::arg("on_event"))
      .def_property_readonly("name", &Job::name)
      .def_property_readonly("backend", &Job::backend)
      .def("start", [](Job& j) { CheckStatus(j.Start()); },
           py::call_guard<py::gil_scoped_release>())
      // None while the job runs: a status exception translated while a
      // Ctrl-C is pending would come out as RuntimeError, not
      // KeyboardInterrupt.
      .def(
          "wait",
          [](Job& j, double timeout) -> std::optional<JobResult> {
            auto r = j.Wait(MillisOrZero(timeout, "timeout"));
            if (absl::IsDeadlineExceeded(r.status())) return std::nullopt;
            return Unwrap(std::move(r));
          },
          py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("stop", [](Job& j, int signal) { CheckStatus(j.Stop(signal)); },
           py::arg("signal") = 0, py::call_guard<py::gil_scoped_release>())
      .def("unstopped", &Job::Unstopped, py::call_guard<py::gil_scoped_release>())
      .def("containers", &Job::Containers, py::call_guard<py::gil_scoped_release>())
      .def("allocations", &Job::Allocations, py::call_guard<py::gil_scoped_release>());
}

}  // namespace deepnex::python
