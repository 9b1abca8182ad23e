// A container's report between deepnex-agent and deepnex-central: made from
// a launcher's Handle on the agent, read back into launch's types on
// central. Private to libdeepnex.
#ifndef DEEPNEX_AGENT_REPORT_H_
#define DEEPNEX_AGENT_REPORT_H_

#include <chrono>
#include <functional>
#include <string>

#include "deepnex/agent.pb.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::agent {

// Status of `h` now, and its usage when `usage` (which may read cgroups:
// heartbeats carry it, a start's reply need not wait for it).
proto::ContainerReport ReportOf(launch::Handle& h, bool usage = true);

// Unknown states and reasons read as ended and lost: a report that central
// cannot read must not keep a grant alive.
launch::ContainerStatus StatusOf(const proto::ContainerReport& r);
launch::ExitStatus ExitOf(const proto::ContainerReport& r);
launch::Usage UsageOf(const proto::ContainerReport& r);
// Stopped or exited: ended for good.
bool Ended(const proto::ContainerReport& r);

// Handle::FollowLogs for a handle that can only read its log by offset
// (an agent's, an adopted one): reads 1 MiB at a time, polling every `poll`
// while nothing new came.
absl::Status FollowByReading(launch::Handle& h,
                             const std::function<bool(const std::string&)>& sink,
                             std::chrono::milliseconds poll);

}  // namespace deepnex::agent

#endif  // DEEPNEX_AGENT_REPORT_H_
