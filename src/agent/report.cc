#include "agent/report.h"

#include <thread>

#include "launch/central_wire.h"
#include "launch/util.h"

namespace deepnex::agent {

proto::ContainerReport ReportOf(launch::Handle& h, bool usage) {
  proto::ContainerReport r;
  launch::ContainerStatus st = h.Status();
  r.set_name(h.spec().name);
  r.set_id(st.id);
  r.set_state(launch::StateName(st.state));
  r.set_restarts(st.restarts);
  r.set_user(h.spec().user);
  if (h.spec().allocation) r.set_allocation_id(h.spec().allocation->id);
  r.set_cpus(h.spec().cpus);
  r.set_memory(h.spec().memory);
  r.set_started_at(std::chrono::duration<double>(st.started_at.time_since_epoch()).count());
  if (st.last_exit) {
    r.set_has_exit(true);
    r.set_exit_reason(launch::ExitReasonName(st.last_exit->reason));
    r.set_exit_code(st.last_exit->code);
    r.set_exit_signal(st.last_exit->signal);
  }
  if (!usage) return r;
  auto u = h.Usage();
  if (u.ok()) {
    r.mutable_usage()->set_cpu_seconds(u->cpu_seconds);
    r.mutable_usage()->set_memory(u->memory);
    r.mutable_usage()->set_memory_peak(u->memory_peak);
    r.mutable_usage()->set_pids(u->pids);
  }
  return r;
}

launch::ExitStatus ExitOf(const proto::ContainerReport& r) {
  launch::ExitStatus e;
  e.reason = launch::ExitReason::kLost;
  for (auto reason : {launch::ExitReason::kExited, launch::ExitReason::kSignaled,
                      launch::ExitReason::kOomKilled, launch::ExitReason::kLost}) {
    if (r.exit_reason() == launch::ExitReasonName(reason)) e.reason = reason;
  }
  e.code = r.exit_code();
  e.signal = r.exit_signal();
  e.restarts = r.restarts();
  return e;
}

launch::ContainerStatus StatusOf(const proto::ContainerReport& r) {
  launch::ContainerStatus st;
  st.name = r.name();
  st.id = r.id();
  auto state = launch::ParseState(r.state());
  st.state = state.ok() ? *state : launch::State::kExited;
  st.restarts = r.restarts();
  if (r.has_exit()) st.last_exit = ExitOf(r);
  st.started_at = std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::duration<double>(r.started_at())));
  return st;
}

launch::Usage UsageOf(const proto::ContainerReport& r) {
  launch::Usage u;
  u.cpu_seconds = r.usage().cpu_seconds();
  u.memory = r.usage().memory();
  u.memory_peak = r.usage().memory_peak();
  u.pids = r.usage().pids();
  return u;
}

bool Ended(const proto::ContainerReport& r) {
  auto state = launch::ParseState(r.state());
  return !state.ok() || *state == launch::State::kStopped || *state == launch::State::kExited;
}

absl::Status FollowByReading(launch::Handle& h,
                             const std::function<bool(const std::string&)>& sink,
                             std::chrono::milliseconds poll) {
  uint64_t offset = 0;
  launch::FollowedLog followed(sink);
  while (true) {
    DEEPNEX_ASSIGN_OR_RETURN(launch::LogChunk chunk, h.ReadLogs(offset, 1 << 20));
    if (!followed.Take(offset, chunk)) return absl::OkStatus();
    offset = chunk.next_offset;
    if (chunk.ended) return absl::OkStatus();
    if (chunk.data.empty()) std::this_thread::sleep_for(poll);
  }
}

}  // namespace deepnex::agent
