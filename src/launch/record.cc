// Writes the container record whose schema record.h describes.
#include "launch/record.h"

#include <unistd.h>

#include <vector>

#include "absl/strings/numbers.h"
#include "launch/procfs.h"
#include "nlohmann/json.hpp"

namespace deepnex::launch {

std::string ContainerRecordJson(const ContainerSpec& spec, const ContainerRecord& record) {
  const ContainerStatus& s = record.status;
  nlohmann::json r;
  r["name"] = spec.name;
  r["launcher_id"] = record.launcher_id;
  r["launcher_pid"] = getpid();
  r["backend"] = record.backend;
  r["state"] = StateName(s.state);
  r["restarts"] = s.restarts;
  r["id"] = s.id;
  r["run_name"] = record.run_name;
  // While it runs, its launcher has not reaped it, so the pid is still its.
  int pid = 0;
  if (record.backend == "process" && s.state == State::kRunning && absl::SimpleAtoi(s.id, &pid)) {
    if (std::optional<uint64_t> start = ProcessStartTime(pid)) r["start_time"] = *start;
  }
  if (!record.cgroup.empty()) r["cgroup"] = record.cgroup;
  r["image"] = spec.image;
  r["command"] = spec.command;
  r["user"] = spec.user;
  r["cpus"] = spec.cpus;
  r["memory"] = spec.memory;
  r["pids_limit"] = spec.pids_limit;
  r["restart"] = spec.restart.ToString();
  std::vector<int> gpus;
  if (spec.allocation) {
    r["allocation"] = spec.allocation->id;
    for (const gpu::GrantedGpu& g : spec.allocation->gpus) gpus.push_back(g.index);
  }
  r["gpus"] = gpus;
  r["started_at"] = std::chrono::duration<double>(s.started_at.time_since_epoch()).count();
  if (s.last_exit) r["last_exit"] = s.last_exit->ToString();
  r["usage"] = {{"cpu_seconds", record.usage.cpu_seconds},
                {"memory", record.usage.memory},
                {"memory_peak", record.usage.memory_peak},
                {"pids", record.usage.pids}};
  return r.dump(1) + "\n";
}

}  // namespace deepnex::launch
