// The record a Launcher keeps per container, for `deepnex ps` and for the
// orphan sweep of deepnex-central: <state_dir>/containers/<name>/record.json,
// rewritten atomically at each change of state. Its reader in Python is
// read_records in python/deepnex/_cli_launch.py; a key renamed here is
// renamed there.
//
// The JSON object's keys (each always present unless said otherwise):
//   name          spec.name
//   launcher_id   the id of the launcher that runs it
//   launcher_pid  that launcher's pid: a live container whose launcher is
//                 gone is orphaned
//   backend       "process", "oci", "docker", "slurm" or "kubernetes"
//   state         StateName: starting, running, restarting, stopped, exited
//   restarts      restarts so far
//   id            the current run's backend id (pid, runc id, job id, ...)
//   run_name      the current run's name (RunContext::run_name)
//   start_time    the kernel start time of the current run's process
//                 (ProcessStartTime of the pid in id); only for the process
//                 backend while it runs: a re-attach adopts the pid only
//                 while it still names that process
//   cgroup        "<cgroup parent>/<run name>"; only for the backends whose
//                 runs are cgrouped by that name (process, oci)
//   image, command, user, cpus, memory (bytes), pids_limit
//                 the resolved spec's
//   restart       RestartPolicy::ToString
//   allocation    the grant's id; only for a spec with an allocation
//   gpus          the grant's GPU indices ([] without one)
//   started_at    seconds since the epoch, when the first run started
//   last_exit     ExitStatus::ToString of the latest run that ended; only
//                 once one has
//   usage         {cpu_seconds, memory, memory_peak, pids} as last measured
#ifndef DEEPNEX_LAUNCH_RECORD_H_
#define DEEPNEX_LAUNCH_RECORD_H_

#include <string>

#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// The file name of the record in a container's directory.
inline constexpr char kRecordFile[] = "record.json";

// What a record holds besides the container's spec.
struct ContainerRecord {
  std::string launcher_id;
  std::string backend;
  std::string run_name;
  std::string cgroup;  // empty: not cgrouped by run name (no "cgroup" key)
  ContainerStatus status;
  Usage usage;
};

// The record.json text for a container of (resolved) `spec`.
std::string ContainerRecordJson(const ContainerSpec& spec, const ContainerRecord& record);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_RECORD_H_
