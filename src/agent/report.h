// A container's report between deepnex-agent and deepnex-central: made from
// a launcher's Handle on the agent, read back into launch's types on
// central. Private to libdeepnex.
#ifndef DEEPNEX_AGENT_REPORT_H_
#define DEEPNEX_AGENT_REPORT_H_

#include <chrono>
#include <string>

#include "deepnex/agent.pb.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::agent {

// Status and usage of `h` now (Usage may read cgroups).
proto::ContainerReport ReportOf(launch::Handle& h);

// Unknown states and reasons read as ended and lost: a report that central
// cannot read must not keep a grant alive.
launch::ContainerStatus StatusOf(const proto::ContainerReport& r);
launch::ExitStatus ExitOf(const proto::ContainerReport& r);
launch::Usage UsageOf(const proto::ContainerReport& r);
// Stopped or exited: ended for good.
bool Ended(const proto::ContainerReport& r);

}  // namespace deepnex::agent

#endif  // DEEPNEX_AGENT_REPORT_H_
