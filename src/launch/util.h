// Small helpers shared by the launch backends (private to src/launch):
// file descriptors, PATH and environments, run names, exit statuses and
// signals. /proc lookups are in procfs.h.
#ifndef DEEPNEX_LAUNCH_UTIL_H_
#define DEEPNEX_LAUNCH_UTIL_H_

#include <sys/types.h>
#include <unistd.h>

#include <utility>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "deepnex/launch/launcher.h"
#include "deepnex/metrics.h"

namespace deepnex::launch {

// The variable every process a launcher starts carries, so that the
// leftovers of a launcher that crashed can be found through /proc.
inline constexpr char kLauncherIdEnv[] = "DEEPNEX_LAUNCHER_ID";

// Owns a file descriptor: closes it when destroyed or reset.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    reset(o.release());
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

// This process's environment, for the engine commands it runs.
std::vector<std::string> OwnEnv();

// Whether `name` can be a user's name in an /etc/passwd:
// [a-z_][a-z0-9_-]*, at most 32 characters.
bool IsPasswdName(const std::string& name);

// The executable `command` names: itself if it contains a '/', else the first
// executable regular file in the ':'-separated `path_env`. NotFound:
//   command "foo" not found on PATH=/usr/bin:/bin
absl::StatusOr<std::string> FindOnPath(const std::string& command,
                                       const std::string& path_env);

// The PATH a spec's processes search: its env's, else this process's, else
// a default.
std::string PathOf(const std::map<std::string, std::string>& env);

// A user's home on this host: run_as.home, else the uid's in this host's
// passwd where that directory exists (central maps users to uids and names
// no home), else "/".
std::string HomeOf(const RunAs& run_as);

// The environment of a spec's processes on this host's own system (process,
// slurm): its env, with PATH (PathOf) and, when it runs as another user,
// that user's HOME (HomeOf) and USER, unless its env sets them.
std::map<std::string, std::string> HostEnv(const ContainerSpec& spec);

// Where a spec's processes start on this host's own system (process,
// slurm): its working_dir; else, run as a user, that user's home (HomeOf),
// as a login would, not the daemon's directory; else "" (the launcher's
// own, for a launcher in the user's own program).
std::string HostWorkingDir(const ContainerSpec& spec);

// `s` with each pair's first (what a backend was given: a launcher's run
// name, an image's directory on the host) replaced in its message by the second
// (what the user named), so that an error speaks the user's names and
// shows no admin's paths: where it stands whole, not inside a longer path or
// name. OK stays OK; a pair with an empty or an unchanged first is skipped.
absl::Status AsNamed(const absl::Status& s,
                     const std::vector<std::pair<std::string, std::string>>& names);

// Whom a container's processes run as in an image (oci, docker, kubernetes):
// spec.run_as, else this launcher's own effective uid and gid, as
// ContainerSpec::run_as promises. An engine left to choose runs the image's
// user, root in most images, with its default capabilities.
RunAs ContainerRunAs(const ContainerSpec& spec);

// HOME in a container's image (oci, docker, kubernetes) for `uid`: the
// spec's run_as.home, else "/root" for root and "/" for any other uid (an
// image has no passwd entry for it).
std::string ContainerHome(const ContainerSpec& spec, uint32_t uid);

// The capabilities, without "CAP_", that a container's processes keep (oci,
// docker, kubernetes): runc's default set for root, none for any other uid
// (an engine would otherwise hand it its defaults).
std::vector<std::string> ContainerCapabilities(uint32_t uid);

// The most processes a spec's container may have: its pids_limit, else
// kDefaultPidsLimit (process, oci, docker).
int64_t PidsLimitOf(const ContainerSpec& spec);

// Host bind mounts staged by PinMountSources, undone when destroyed (once
// the engine has made its own: the container keeps those).
struct StagedMounts {
  StagedMounts() = default;
  StagedMounts(const StagedMounts&) = delete;
  StagedMounts& operator=(const StagedMounts&) = delete;
  ~StagedMounts();
  std::vector<std::string> paths;
};

// `spec` with each mount's source pinned, for an engine that binds it later
// (oci's runc, docker's engine). Resolve checked a source by its path (under
// an allowed root, no symlink); a directory on that path that the user can
// write may become a symlink before the engine binds it, pointing anywhere
// on the host (a race seen to bind the host's / writable). So each source
// is opened now by the checked path, following no symlink
// (FailedPrecondition naming it when one is there now), and the object
// opened is bound (private) at <dir>/mount-<i>, in the daemon's own state
// where no user reaches, which the engine binds instead: no rename can
// redirect that.
absl::StatusOr<ContainerSpec> PinMountSources(const ContainerSpec& spec, const std::string& dir,
                                              StagedMounts* staged);

// The mode of a launcher's state_dir (every user's container logs and
// records): its owner's alone (0700), but passable (0711) for the slurm
// backend, whose slurmstepd opens a job's output file as the job's user.
// What is inside is then its owner's alone all the same: records and job
// scripts are 0600, a job's output its user's, 0600.
mode_t StateDirMode(const std::string& backend);

// options.cgroup_parent, or "deepnex" when empty.
std::string CgroupParent(const LauncherOptions& options);

// "<launcher_id>-<name>-<attempt>" (see RunContext::run_name).
std::string RunName(const std::string& launcher_id, const std::string& name, int attempt);

// A status from waitpid(2): exited(code) or signaled(signal).
ExitStatus ExitStatusFromWait(int wait_status);

// "SIGKILL" for 9; "signal 99" for one without a name.
std::string SignalName(int signal);

// The series of a container that runs, as deepnex-central exports those on
// its own launcher and its agents' (and an agent its own): counter
// deepnex_container_cpu_seconds_total and gauge
// deepnex_container_memory_bytes, labelled by node, user and container (the
// launcher's name).
void ExportContainerUsage(MetricsRegistry& registry, const std::string& node,
                          const std::string& user, const std::string& container,
                          const Usage& usage);

// Hands a follower's chunks to its sink as Handle::FollowLogs promises: what
// the log limit dropped before it was read is said in a line of its own,
// not skipped in silence (a probe's slow reader lost 64 MiB unawares).
class FollowedLog {
 public:
  explicit FollowedLog(const std::function<bool(const std::string&)>& sink) : sink_(sink) {}
  // `chunk`, read from `offset`; false once the sink wants no more.
  bool Take(uint64_t offset, const LogChunk& chunk);

 private:
  const std::function<bool(const std::string&)>& sink_;
  bool line_start_ = true;  // what the sink got last ended a line
};

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_UTIL_H_
