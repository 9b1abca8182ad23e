// The interface every launch backend implements (private to src/launch).
// The generic Launcher (launcher.cc) validates specs, composes the
// environment, supervises restarts and keeps logs across runs; a backend
// only starts one run of a fully resolved spec and watches it.
#ifndef DEEPNEX_LAUNCH_BACKEND_H_
#define DEEPNEX_LAUNCH_BACKEND_H_

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <vector>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// Where and as what one run starts.
struct RunContext {
  std::string launcher_id;
  // Unique per run: "<launcher_id>-<name>-<attempt>", usable as a runc id,
  // container name, job name or (lowercased) pod name.
  std::string run_name;
  // A private directory for this run (bundle, log files); exists.
  std::string dir;
  int attempt = 0;  // 0 for the first run
  // The spec's labels plus deepnex.launcher and deepnex.name.
  std::map<std::string, std::string> labels;
};

// How a run's Wait treats an engine whose API (slurmctld, the Kubernetes
// API server) fails to answer: a busy or restarting controller answers again
// soon, so only a silence of kFor makes the run lost. Not thread-safe.
class EngineSilence {
 public:
  static constexpr std::chrono::seconds kFor{30};
  // Whether a failed call at `now` still falls within the allowed silence.
  bool Tolerates(std::chrono::steady_clock::time_point now) {
    if (!since_.has_value()) since_ = now;
    return now - *since_ < kFor;
  }
  // A call answered.
  void Answered() { since_.reset(); }

 private:
  std::optional<std::chrono::steady_clock::time_point> since_;
};

// One run of a container. Thread-safe: Wait runs on the supervisor thread
// while Stop, Logs and Usage come from users' threads.
class Run {
 public:
  virtual ~Run() = default;
  // The backend's id for the run (pid, runc id, container id, job id, pod).
  virtual std::string id() const = 0;
  // Blocks until the run has ended or `timeout` passed (nullopt). An error
  // only when the backend cannot tell (then the supervisor reports "lost").
  virtual absl::StatusOr<std::optional<ExitStatus>> Wait(std::chrono::milliseconds timeout) = 0;
  // SIGTERM (or the engine's graceful stop) to every process of the run,
  // SIGKILL after `grace`. Returns without waiting for the end.
  virtual absl::Status Stop(std::chrono::milliseconds grace) = 0;
  // Why the engine, as last polled by Wait, holds the run queued, not yet
  // started, in its words (a Slurm job PENDING, with squeue's reason): its
  // container shows as starting. Empty: not queued.
  virtual std::string Queued() { return ""; }
  // This run's stdout and stderr so far.
  virtual absl::StatusOr<std::string> Logs() = 0;
  virtual absl::StatusOr<launch::Usage> Usage() = 0;
  // After the run ended: deletes what it holds (cgroup, container, bundle,
  // job record). Idempotent.
  virtual absl::Status Remove() = 0;
  // See Handle::Exec. Default: the backend has none.
  virtual absl::StatusOr<std::unique_ptr<ExecProcess>> Exec(const ExecOptions& options) {
    return absl::UnimplementedError("this backend has no exec");
  }
  // See Handle::Commit; called while the run runs.
  virtual absl::StatusOr<uint64_t> Commit(const std::string& image) {
    return absl::FailedPreconditionError("this backend cannot commit containers");
  }
  // See Handle::NetworkNamespace.
  virtual absl::StatusOr<std::string> NetworkNamespace() { return std::string(); }
};

// The terminal type of a process exec'd on a tty whose container's
// environment names none, as docker exec -t gives it: less, vi and top
// draw nothing sensible without one.
inline constexpr char kExecTtyTerm[] = "TERM=xterm";

// How to start an exec'd process (session_exec.cc spawns it).
struct ExecPlan {
  std::vector<std::string> argv;  // argv[0]: a path
  std::vector<std::string> env;   // "K=V"
  std::string working_dir;        // empty: the caller's
  // A working_dir that cannot be entered: "/" (a home, as login(1) does),
  // else the exec fails (126).
  bool or_root = false;
  std::optional<RunAs> run_as;
  // Called with the child's pid before it runs anything (e.g. to put it in
  // the container's cgroup); an error kills it.
  std::function<absl::Status(pid_t)> join;
  // Files the child writes "0" to itself before it runs anything
  // (Cgroup::SelfJoinFiles); one it cannot write ends it with 126.
  std::vector<std::string> join_files;
};
absl::StatusOr<std::unique_ptr<ExecProcess>> SpawnExec(const ExecPlan& plan,
                                                       const ExecOptions& options);

class Backend {
 public:
  virtual ~Backend() = default;
  // Backend-specific checks of a spec that already passed the generic ones
  // (image exists, command found in the image, resources expressible).
  virtual absl::Status Check(const ContainerSpec& spec) = 0;
  // Starts one run. `spec.env` is complete (allocation env and job env
  // merged), spec.cpus/memory are resolved against the allocation.
  virtual absl::StatusOr<std::unique_ptr<Run>> Start(const ContainerSpec& spec,
                                                     const RunContext& context) = 0;
  // Kills and removes everything labelled deepnex.launcher=`launcher_id`.
  virtual absl::StatusOr<int> Cleanup(const std::string& launcher_id) = 0;
  // See Launcher::Nodes. Default: none, the backend runs on this host.
  virtual absl::StatusOr<std::vector<gpu::Node>> Nodes() { return std::vector<gpu::Node>{}; }
};

// FailedPrecondition naming what is missing when the engine is unusable.
absl::StatusOr<std::unique_ptr<Backend>> MakeProcessBackend(const LauncherOptions& options);
absl::StatusOr<std::unique_ptr<Backend>> MakeOciBackend(const LauncherOptions& options);
absl::StatusOr<std::unique_ptr<Backend>> MakeDockerBackend(const LauncherOptions& options);
absl::StatusOr<std::unique_ptr<Backend>> MakeSlurmBackend(const LauncherOptions& options);
absl::StatusOr<std::unique_ptr<Backend>> MakeKubernetesBackend(const LauncherOptions& options);
// The "central" backend is a whole Launcher (central_launcher.cc): its
// containers' runs are supervised where they run, not here.
absl::StatusOr<std::unique_ptr<Launcher>> MakeCentralLauncher(const LauncherOptions& options);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_BACKEND_H_
