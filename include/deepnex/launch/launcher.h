// deepnex::launch: start an application in its own container (or process)
// with exactly the GPUs, CPU and memory it was granted, supervise it under a
// restart policy, and report what it uses.
//
//   DEEPNEX_ASSIGN_OR_RETURN(auto launcher, Launcher::Create({.backend = "oci"}));
//   ContainerSpec spec;
//   spec.name = "w0"; spec.command = {"python3", "train.py"};
//   spec.cpus = 1; spec.memory = 256 << 20; spec.allocation = grant;
//   DEEPNEX_ASSIGN_OR_RETURN(auto h, launcher->Start(spec));
//   DEEPNEX_ASSIGN_OR_RETURN(ExitStatus e, h->Wait(std::chrono::seconds(60)));
//
// Backends: "process" (the embedded default: fork/exec with cgroup limits),
// "oci" (runc), "docker" (the Docker Engine REST API over its unix socket),
// "slurm" (sbatch/squeue/sacct/scancel), "kubernetes" (Pods through the API
// server's REST API), "central" (deepnex-central's Containers service: each
// container on its allocation's node, through that node's deepnex-agent).
// The launcher never decides placement: GPUs come from the spec's
// gpu::Allocation.
#ifndef DEEPNEX_LAUNCH_LAUNCHER_H_
#define DEEPNEX_LAUNCH_LAUNCHER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deepnex/gpu/types.h"
#include "deepnex/launch/session.h"
#include "deepnex/status.h"

namespace deepnex::launch {

// A bind mount of a host path into the container. Both paths are absolute
// without "." or ".." components; the source must exist and its real path
// (symlinks resolved) lie under one of LauncherOptions::allowed_mount_roots;
// the launcher mounts that real path. The target may not be "/" or lie
// under the runtime's /proc, /dev or /sys. The process backend, which has
// the host's file system, takes only mounts that change nothing: source and
// target the same directory, not read-only.
struct Mount {
  std::string source;
  std::string target;
  bool read_only = true;
};

// When a task that ended is started again.
struct RestartPolicy {
  enum class Kind { kNever, kOnFailure, kAlways };
  Kind kind = Kind::kNever;
  // on-failure: restarts allowed after the first run (3: up to 4 runs in
  // all); always: -1 is unlimited.
  int max_restarts = 0;
  // Delay before restart k (k = 1, 2, ...) is backoff * 2^(k-1), at most
  // max_backoff. The launcher's crash-loop backoff (LauncherOptions::
  // restart_backoff_*) bounds both from below: a policy may ask for longer
  // delays, never for shorter ones.
  std::chrono::milliseconds backoff{100};
  std::chrono::milliseconds max_backoff{10000};

  // "never", "on-failure" (unlimited), "on-failure:N", "always",
  // "always:N". Anything else is InvalidArgument naming the value.
  static absl::StatusOr<RestartPolicy> Parse(const std::string& text);
  std::string ToString() const;
};

struct RestartEvent;  // below, with ExitStatus

// The identity a container's processes run as: no capabilities, no new
// privileges, the groups `gid` only.
struct RunAs {
  uint32_t uid = 0;
  uint32_t gid = 0;
  // The name an oci container's /etc/passwd gives `uid` ([a-z_][a-z0-9_-]*,
  // at most 32 characters); empty: "user".
  std::string user;
  // Its home: HOME unless the spec's env sets it, and /etc/passwd's.
  // Absolute; empty: on the host's system (process, slurm) the uid's home in
  // the host's passwd where that directory exists, else "/".
  std::string home;
};

// The pids limit of a container whose spec sets none: a fork bomb stays in
// its container instead of taking the host's process table.
inline constexpr int64_t kDefaultPidsLimit = 4096;

// What to run and with which resources. Plain value.
struct ContainerSpec {
  // Unique among the launcher's live containers; [a-zA-Z0-9][a-zA-Z0-9_.-]*,
  // at most 63 characters (a Kubernetes name must also be lowercase: the
  // kubernetes backend lowercases it).
  std::string name;
  // "host" (the host's /usr and /opt read-only, so the host's Python runs;
  // oci gives every image a generated /etc, never the host's), a rootfs
  // directory, an OCI image layout directory (oci), an image reference
  // (docker, kubernetes), or a name in LauncherOptions::images. The process
  // backend ignores it unless it is a directory, which it refuses (it
  // cannot chroot).
  std::string image = "host";
  // argv; command[0] is looked up on PATH (the spec's env PATH, else the
  // launcher's) and must exist: a missing command is NotFound at Start.
  std::vector<std::string> command;
  std::map<std::string, std::string> env;
  // Absolute; empty: "/" in a container, the launcher's cwd for a process.
  // It must exist where the command runs (in the image, or through one of
  // the mounts): NotFound otherwise.
  std::string working_dir;
  std::vector<Mount> mounts;
  // CPU cores (fractional: a CFS quota); 0: unlimited.
  double cpus = 0;
  // Host memory limit in bytes; 0: unlimited; otherwise at least
  // LauncherOptions::min_memory.
  uint64_t memory = 0;
  // Maximum number of processes; 0: kDefaultPidsLimit where the backend
  // limits them (process with cgroups, oci, docker). Slurm refuses a limit;
  // on Kubernetes the kubelet's podPidsLimit applies.
  int64_t pids_limit = 0;
  // The grant this container runs on: its GPUs' device nodes are the only
  // ones allowed, its env (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES,
  // DEEPNEX_GPU_MEMORY_LIMIT) is applied, and cpus/memory default to it.
  std::optional<gpu::Allocation> allocation;
  // The user the container runs for; with an allocation it must be the
  // allocation's user (PermissionDenied otherwise). Empty: the allocation's.
  std::string user;
  // Free-form; the launcher adds deepnex.launcher=<launcher id> and
  // deepnex.name=<name> so that Cleanup can find what it started.
  std::map<std::string, std::string> labels;
  RestartPolicy restart;
  // Called on each restart decision, before the backoff, from the
  // container's supervisor thread; it must not block. Not sent to remote
  // launchers (deepnex-central).
  std::function<void(const RestartEvent&)> on_restart;
  // No network namespace sharing: only loopback (oci, docker).
  bool network_none = false;
  // oci, docker: the host's network namespace; otherwise the container gets
  // a private one with only its own loopback (it reaches no host port).
  // deepnex-central allows it only to the users its --allow-host-network
  // names. Contradicts network_none.
  bool host_network = false;
  // Whom the processes run as (every backend). Set by whoever
  // owns the launcher, never by a remote user: deepnex-central sets it
  // from its user map. Unset: the launcher's own uid and gid (a Launcher
  // in a user's own script runs as that user). A uid other than the
  // launcher's needs a launcher running as root (PermissionDenied), except
  // on docker and kubernetes, whose engine switches users.
  std::optional<RunAs> run_as;
  // The log rotates when it reaches this size (see LauncherOptions::
  // log_max_bytes); 0: the launcher's. At most the launcher's.
  uint64_t log_max_bytes = 0;
};

// A piece of a container's log. Offsets count every byte the container has
// written since it started; what rotated away is gone, so a read from before
// the oldest byte kept starts there (next_offset - data.size() > offset).
struct LogChunk {
  std::string data;
  uint64_t next_offset = 0;
  // The container ended for good and `data` reaches the end of its log.
  bool ended = false;
};

// How one run of a container ended.
enum class ExitReason { kExited, kSignaled, kOomKilled, kLost };
const char* ExitReasonName(ExitReason reason);  // "exited", "signaled", ...

struct ExitStatus {
  ExitReason reason = ExitReason::kExited;
  int code = 0;    // exited: the exit code
  int signal = 0;  // signaled (and oom_killed: usually 9)
  // Restarts done before this (final) status; 0 if it ran once.
  int restarts = 0;
  bool ok() const { return reason == ExitReason::kExited && code == 0; }
  // "exited(3)", "signaled(SIGKILL)", "oom_killed" or "lost", then
  // " after N restarts" when restarts > 0.
  std::string ToString() const;
};

// The supervisor's decision to start a container again, as it is taken.
struct RestartEvent {
  std::string name;       // the container's
  ExitStatus exit;        // how the run ended
  int restart = 0;        // which restart follows: 1, 2, ...
  int max_restarts = -1;  // the policy's; -1: unlimited
  std::chrono::milliseconds delay{0};  // the backoff before it
  // "exited(1); restarting (1/2) in 1.0s"; unlimited: "signaled(SIGKILL);
  // restarting (3) in 0.4s".
  std::string ToString() const;
};

enum class State { kStarting, kRunning, kRestarting, kStopped, kExited };
const char* StateName(State state);  // "starting", "running", ...

struct ContainerStatus {
  std::string name;
  std::string id;  // the backend's id (pid, runc id, docker id, job id, pod)
  State state = State::kStarting;
  int restarts = 0;
  std::optional<ExitStatus> last_exit;  // of the latest run that ended
  std::chrono::system_clock::time_point started_at{};
  // Why its engine holds it queued (state is then kStarting), in the
  // engine's words: "PENDING in Slurm's queue (Resources)". Empty: not.
  std::string queued;
};

// What a container uses now. Fields a backend cannot see stay 0.
struct Usage {
  double cpu_seconds = 0;    // every run's, a restarted container's included
  uint64_t memory = 0;       // bytes now
  uint64_t memory_peak = 0;  // bytes, highest seen
  int64_t pids = 0;
  // GPU memory in bytes by GPU index, through NVML where present.
  std::map<int, uint64_t> gpu_memory;
};

// One started container. Thread-safe.
class Handle {
 public:
  virtual ~Handle() = default;
  virtual const ContainerSpec& spec() const = 0;
  virtual ContainerStatus Status() = 0;
  // Waits until the container has ended for good (its restart policy gives
  // up, or Stop). DeadlineExceeded naming the container if it is still
  // running after `timeout`.
  virtual absl::StatusOr<ExitStatus> Wait(std::chrono::milliseconds timeout) = 0;
  // SIGTERM to every process of the container (oci: to the command, through
  // its init; the rest go with it), SIGKILL after `grace`; no restart
  // follows. Idempotent.
  virtual absl::Status Stop(std::chrono::milliseconds grace) = 0;
  // stdout and stderr so far, interleaved, across restarts: as much as the
  // log limit keeps (at most twice ContainerSpec::log_max_bytes).
  virtual absl::StatusOr<std::string> Logs() = 0;
  // The log from `offset` on (see LogChunk), at most `max_bytes` of it;
  // never reads more than that into memory.
  virtual absl::StatusOr<LogChunk> ReadLogs(uint64_t offset, uint64_t max_bytes) = 0;
  // Calls `sink` with new output as it comes until the container ends for
  // good or `sink` returns false. Output the log limit dropped before it
  // was read is a line of its own: "deepnex: N bytes of this container's
  // output were dropped before they were read (its log keeps the newest)".
  virtual absl::Status FollowLogs(const std::function<bool(const std::string&)>& sink) = 0;
  virtual absl::StatusOr<launch::Usage> Usage() = 0;
  // Starts a process in the running container, as its user, with its
  // environment and working directory (process: in its cgroup; oci: `runc
  // exec`, in its namespaces). FailedPrecondition when it is not running;
  // Unimplemented on a backend without exec.
  virtual absl::StatusOr<std::unique_ptr<ExecProcess>> Exec(const ExecOptions& /*options*/) {
    return absl::UnimplementedError("this launcher has no exec");
  }
  // Saves the running container's changes to its image's files as image
  // `image` (docker://HOST:PORT/REPO:TAG): one new layer on top of its
  // image's, pushed to that registry. Returns the new image's bytes. Only
  // an oci container whose image came from a registry; FailedPrecondition
  // naming the backend otherwise, or when it is not running.
  virtual absl::StatusOr<uint64_t> Commit(const std::string& /*image*/) {
    return absl::FailedPreconditionError("this launcher cannot commit containers");
  }
  // The running container's network namespace (a path to open for setns),
  // where it has one of its own (oci); "" where it shares the host's.
  virtual absl::StatusOr<std::string> NetworkNamespace() { return std::string(); }
};

struct OciOptions {
  std::string runc = "runc";
  // runc --root; empty: <state_dir>/runc.
  std::string root;
  // The init each container runs as its PID 1, with the command as its
  // child: it forwards Stop's SIGTERM to the command (a PID 1 without a
  // handler ignores it) and reaps orphans; what is left when the command
  // ends is killed with the container. A statically linked
  // tini, looked up on PATH and bound in read-only at /dev/init (Debian:
  // apt-get install tini). "none": the command itself is PID 1.
  std::string init = "tini-static";
};

struct DockerOptions {
  // unix socket path of the Docker Engine API (or podman's service).
  std::string socket = "/var/run/docker.sock";
  std::string api_version = "v1.41";
};

struct SlurmOptions {
  std::string partition;  // empty: the cluster's default
  std::string bin_dir;    // where sbatch etc. are; empty: PATH
  // Extra environment for the Slurm commands (e.g. SLURM_CONF).
  std::map<std::string, std::string> env;
  std::chrono::milliseconds poll{200};
};

struct KubernetesOptions {
  // A kubeconfig file; empty, unless server is set: kubectl's (the first
  // file of $KUBECONFIG that exists, else ~/.kube/config), else in-cluster
  // (service-account token and CA under
  // /var/run/secrets/kubernetes.io/serviceaccount).
  std::string kubeconfig;
  // Overrides: API server URL (http:// or https://), bearer token, CA file.
  std::string server;
  std::string token;
  std::string ca_file;
  std::string namespace_ = "default";
  // "pod" or "job".
  std::string kind = "pod";
  // Extended resource that carries shared GPU memory, in MiB.
  std::string shared_gpu_memory_resource = "deepnex.io/gpu-memory";
  std::chrono::milliseconds poll{200};
};

struct CentralOptions {
  // host:port of deepnex-central, and the token (or a file holding it) of
  // the user whose allocations the containers run on.
  std::string address;
  std::string token;
  std::string token_file;
  std::string tls_ca_file;
  // How often a container's record is read from deepnex-central (its
  // state, restarts, exit).
  std::chrono::milliseconds poll{100};
};

struct LauncherOptions {
  // "process", "oci", "docker", "slurm", "kubernetes" or "central".
  std::string backend = "process";
  // Where logs, bundles and records go; empty: a fresh directory under
  // $TMPDIR that is removed with the launcher. A relative one is made
  // absolute (against the current directory) by Launcher::Create.
  std::string state_dir;
  // Names this launcher in the labels of what it starts; Cleanup(id) sweeps
  // what a launcher with that id left behind. Empty: random.
  std::string id;
  // Mount sources must lie under one of these (PermissionDenied
  // otherwise); empty list: "/" (any).
  std::vector<std::string> allowed_mount_roots;
  // A memory limit below this is InvalidArgument.
  uint64_t min_memory = 4 << 20;
  // The crash-loop backoff, as kubelet's: the delay before a restart is
  // restart_backoff_floor, doubling per restart up to restart_backoff_cap,
  // whatever a spec's RestartPolicy asks (it may ask for longer); a run that
  // lasted restart_backoff_reset starts the doubling over. Restarts still
  // count toward max_restarts. Defaults: 1 s, 5 min, 10 min.
  std::chrono::milliseconds restart_backoff_floor{1000};
  std::chrono::milliseconds restart_backoff_cap{5 * 60 * 1000};
  std::chrono::milliseconds restart_backoff_reset{10 * 60 * 1000};
  // A container's log rotates when it reaches this size, keeping one rotated
  // file: at most twice this on disk per container. Default: 64 MiB.
  uint64_t log_max_bytes = 64 << 20;
  // Named images: a spec whose image is a name here runs the directory it
  // maps to (a rootfs or an OCI image layout; "host": the host image).
  // deepnex-central takes only these names from its users.
  std::map<std::string, std::string> images;
  // Parent of the containers' cgroups, relative to each controller's root
  // (process and oci). Empty: "deepnex".
  std::string cgroup_parent;
  // process: FailedPrecondition from Launcher::Create where it cannot make
  // cgroups (not root; a cgroup v2 tree that delegates no controllers to
  // this process), instead of running containers without their CPU, memory
  // and pids limits and GPU device rules. Daemons that run other users'
  // containers set it (deepnex-agent; deepnex-central as root). oci always
  // needs cgroups.
  bool require_cgroups = false;
  OciOptions oci;
  DockerOptions docker;
  SlurmOptions slurm;
  KubernetesOptions kubernetes;
  CentralOptions central;
};

// The crash-loop backoff before the `step`th restart since the last reset
// (1, 2, ...): `policy`'s, but never below `options`' restart_backoff_floor
// and restart_backoff_cap. An elastic job paces its replacements and its
// growth after a failed worker with the same.
std::chrono::milliseconds RestartBackoff(const RestartPolicy& policy,
                                         const LauncherOptions& options, int step);

// Starts and supervises containers on one backend. Thread-safe. Destroying
// it stops every container it still runs (grace 1 s).
class Launcher {
 public:
  // InvalidArgument for an unknown backend; FailedPrecondition when the
  // backend's engine is not usable here (runc missing, socket not there),
  // naming what is missing.
  static absl::StatusOr<std::unique_ptr<Launcher>> Create(const LauncherOptions& options);
  virtual ~Launcher() = default;

  // By value: an agent's node has its agent's, which it learns (again) as
  // the agent registers.
  virtual std::string backend() const = 0;
  virtual const std::string& id() const = 0;
  // Validates the spec (bad input: InvalidArgument naming the field and
  // value; NotFound for a command or image that does not exist;
  // PermissionDenied for another user's allocation), then starts it.
  virtual absl::StatusOr<std::shared_ptr<Handle>> Start(const ContainerSpec& spec) = 0;
  // The containers this launcher started that are not yet removed.
  virtual std::vector<std::shared_ptr<Handle>> List() = 0;
  // Looks one up by name.
  virtual absl::StatusOr<std::shared_ptr<Handle>> Get(const std::string& name) = 0;
  // Forgets a container that has ended (its logs and records go too).
  virtual absl::Status Remove(const std::string& name) = 0;
  // Kills and removes everything labelled deepnex.launcher=<launcher_id> on
  // this backend: processes, containers, cgroups, bundles, jobs. For the
  // leftovers of a launcher that crashed. Returns how many were swept.
  virtual absl::StatusOr<int> Cleanup(const std::string& launcher_id) = 0;
  // The nodes this backend places containers on, by the names a spec's
  // allocation gives in `node`, with their CPUs, memory and GPUs: Slurm's
  // nodes (of the partition) for slurm. Empty for the backends that run
  // every container on this host (process, oci, docker), and for kubernetes
  // (not listed yet: a run goes to its allocation's node, or where the
  // cluster's scheduler puts it).
  virtual absl::StatusOr<std::vector<gpu::Node>> Nodes() = 0;
};

// The backends this build and machine can use now, with the reason for each
// that cannot (for tests and `deepnex ps`): {"process": "", "oci": "runc not
// found on PATH", ...}.
std::map<std::string, std::string> ProbeBackends(const LauncherOptions& options);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_LAUNCHER_H_
