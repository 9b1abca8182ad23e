// Control groups for the process and oci backends: create one per container
// with CPU, memory and pids limits, read its usage and OOM kills, kill every
// process in it, remove it. cgroup v1 (cpu, cpuacct, memory, pids
// controllers, each its own hierarchy) and v2 (the unified tree).
#ifndef DEEPNEX_LAUNCH_CGROUP_H_
#define DEEPNEX_LAUNCH_CGROUP_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

struct CgroupLimits {
  double cpus = 0;          // 0: unlimited
  uint64_t memory = 0;      // bytes; 0: unlimited (swap is limited alike)
  int64_t pids = 0;         // 0: unlimited
  // Set: of the NVIDIA GPU device nodes (/dev/nvidiaN, major 195) only
  // these minors may be opened, besides nvidiactl; unset: no restriction.
  // v1 through the devices controller, v2 through a device program
  // (launch/gpu_devices.h).
  std::optional<std::vector<int>> gpu_minors;
};

// One container's cgroup, `path` relative to each controller's root as this
// process sees it (the first line of /proc/self/cgroup for each controller
// is the base), e.g. "deepnex/<run_name>". Thread-safe for reads.
class Cgroup {
 public:
  // Whether cgroups can be created here at all, and why not.
  static absl::Status Usable();
  // Creates the cgroup (and parents) with `limits`. FailedPrecondition when
  // the tree is not writable.
  static absl::StatusOr<std::unique_ptr<Cgroup>> Create(const std::string& path,
                                                        const CgroupLimits& limits);
  // Wraps one that exists (e.g. made by runc from cgroupsPath). NotFound.
  static absl::StatusOr<std::unique_ptr<Cgroup>> Open(const std::string& path);
  // The child cgroup names under `parent` (for Cleanup), on any controller.
  static std::vector<std::string> Children(const std::string& parent);

  // Relative to the controllers' roots, as runc's linux.cgroupsPath takes it.
  const std::string& path() const { return path_; }
  absl::Status AddProcess(pid_t pid);
  // The files a new process joins this cgroup through itself, writing "0"
  // to each (JoinCgroupSelf, between fork and exec): v1's `tasks`, where the
  // kernel then takes no global lock. AddProcess's write of another pid
  // takes it: a synchronize_rcu, 5-10 ms after an idle spell, on every
  // container start and exec (issue #16's time to a prompt). Empty on v2:
  // there AddProcess.
  std::vector<std::string> SelfJoinFiles() const;
  std::vector<pid_t> Processes();
  launch::Usage ReadUsage();
  // Whether the kernel's OOM killer killed a process in it (v1:
  // memory.oom_control oom_kill, else memory.failcnt at the limit; v2:
  // memory.events oom_kill).
  bool OomKilled();
  // SIGKILL to every process in it until it is empty (freezer where present).
  absl::Status KillAll();
  // Kills what is left, then removes the directories. Idempotent.
  absl::Status Remove();

 private:
  explicit Cgroup(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Writes "0" to each of `files` (Cgroup::SelfJoinFiles): the calling
// single-threaded process joins that cgroup. Async-signal-safe; false, with
// errno set, at the first that fails.
bool JoinCgroupSelf(const std::vector<const char*>& files);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_CGROUP_H_
