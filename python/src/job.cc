// deepnex._C.job: deepnex::job::Job. python/deepnex/job.py turns sizes and
// launcher keywords into the plain values this takes.
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
      .def("__repr__", [](const JobResult& r) {
        return "JobResult(exit_code=" + std::to_string(r.exit_code) + ", " +
               std::to_string(r.workers.size()) + " workers)";
      });

  py::class_<Job, GilFreeHolder<Job>>(m, "Job")
      .def(py::init([](std::vector<std::string> command, int workers, int nodes, int ps,
                       std::string mode, int gpus_per_worker, std::string gpu_mode,
                       uint64_t gpu_memory, double cpus, uint64_t memory, std::string user,
                       std::string central, std::string central_token,
                       std::string central_token_file, py::dict launcher,
                       std::string restart, std::string checkpoint_dir, std::string optimizer,
                       double lr, double momentum, std::string ps_binary, std::map<std::string, std::string> env,
                       std::string working_dir,
                       std::vector<std::tuple<std::string, std::string, bool>> mounts,
                       std::string name, py::object output, py::object on_event,
                       std::string advertise_address) {
             JobOptions o;
             o.command = std::move(command);
             o.workers = workers;
             o.nodes = nodes;
             o.advertise_address = std::move(advertise_address);
             o.ps = ps;
             o.mode = std::move(mode);
             o.gpus_per_worker = gpus_per_worker;
             o.gpu_mode = Unwrap(gpu::ParseMode(gpu_mode, "gpu_mode"));
             o.gpu_memory = gpu_memory;
             o.cpus = cpus;
             o.memory = memory;
             o.user = std::move(user);
             o.central = std::move(central);
             o.central_token = std::move(central_token);
             o.central_token_file = std::move(central_token_file);
             o.launcher = LauncherOptionsFromPython(launcher);
             o.restart = Unwrap(launch::RestartPolicy::Parse(restart));
             o.checkpoint_dir = std::move(checkpoint_dir);
             o.optimizer = std::move(optimizer);
             o.lr = lr;
             o.momentum = momentum;
             o.ps_binary = std::move(ps_binary);
             o.env = std::move(env);
             o.working_dir = std::move(working_dir);
             for (auto& [source, target, read_only] : mounts) {
               o.mounts.push_back({std::move(source), std::move(target), read_only});
             }
             o.name = std::move(name);
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
           py::kw_only(), py::arg("command"), py::arg("workers"), py::arg("nodes") = 0,
           py::arg("ps"), py::arg("mode"),
           py::arg("gpus_per_worker"), py::arg("gpu_mode"), py::arg("gpu_memory"),
           py::arg("cpus"), py::arg("memory"), py::arg("user"), py::arg("central"),
           py::arg("central_token"), py::arg("central_token_file"), py::arg("launcher"),
           py::arg("restart"),
           py::arg("checkpoint_dir"), py::arg("optimizer"), py::arg("lr"), py::arg("momentum"), py::arg("ps_binary"),
           py::arg("env"), py::arg("working_dir"), py::arg("mounts"), py::arg("name"),
           py::arg("output"), py::arg("on_event"), py::arg("advertise_address") = "")
      .def_property_readonly("name", &Job::name)
      .def("start", [](Job& j) { CheckStatus(j.Start()); },
           py::call_guard<py::gil_scoped_release>())
      // None while the job runs: a status exception translated while a
      // Ctrl-C is pending would come out as RuntimeError, not
      // KeyboardInterrupt.
      .def(
          "wait",
          [](Job& j, double timeout) -> std::optional<JobResult> {
            auto r = j.Wait(std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
            if (absl::IsDeadlineExceeded(r.status())) return std::nullopt;
            return Unwrap(std::move(r));
          },
          py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("stop", [](Job& j) { CheckStatus(j.Stop()); },
           py::call_guard<py::gil_scoped_release>())
      .def("containers", &Job::Containers, py::call_guard<py::gil_scoped_release>())
      .def("allocations", &Job::Allocations, py::call_guard<py::gil_scoped_release>());
}

}  // namespace deepnex::python
