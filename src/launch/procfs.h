// This host's processes as /proc shows them: found by environment or
// process group, alive or not, their start time and what they use
// (private to src/launch).
#ifndef DEEPNEX_LAUNCH_PROCFS_H_
#define DEEPNEX_LAUNCH_PROCFS_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// The value of `key` in the environment `pid` started with; nullopt when it
// has none, or the process is gone or unreadable to this one.
std::optional<std::string> EnvOf(pid_t pid, const std::string& key);

// The pids of the processes whose environment holds `key`=`value` (those
// this process may read).
std::vector<pid_t> ProcessesWithEnv(const std::string& key, const std::string& value);

// CPU time, resident memory and count of the processes in `pids`, from
// /proc (a process that vanished counts 0). memory_peak is the largest of
// their VmHWM.
launch::Usage ProcUsage(const std::vector<pid_t>& pids);

// Whether `pid` exists and is not a zombie (PID 1 here may never reap
// orphans, so a killed process can linger as one).
bool ProcessAlive(pid_t pid);

// The kernel start time of `pid` (field 22 of /proc/<pid>/stat, clock ticks
// since boot): with the pid, it names one process, as a reused pid does not.
// nullopt when there is no such process.
std::optional<uint64_t> ProcessStartTime(pid_t pid);

// GPU memory of `pids`, by GPU index, through NVML; empty without a driver.
std::map<int, uint64_t> GpuMemoryOf(const std::vector<pid_t>& pids);

// The live processes whose process group is `pgid`.
std::vector<pid_t> ProcessGroupMembers(pid_t pgid);

// The parent of `pid` (field 4 of /proc/<pid>/stat); nullopt when there is
// no such process.
std::optional<pid_t> ParentOf(pid_t pid);

// The arguments `pid` runs with (/proc/<pid>/cmdline); empty when it is gone.
std::vector<std::string> ArgumentsOf(pid_t pid);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_PROCFS_H_
