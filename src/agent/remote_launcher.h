// A launch::Launcher whose containers run on one agent's node: deepnex-
// central's Containers service starts a container through the launcher of
// its allocation's node, this one for a node with a deepnex-agent. Private
// to libdeepnex.
#ifndef DEEPNEX_AGENT_REMOTE_LAUNCHER_H_
#define DEEPNEX_AGENT_REMOTE_LAUNCHER_H_

#include <memory>
#include <string>
#include <vector>

#include "agent/hub.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::agent {

// Commands travel through `hub`, which outlives the launcher; status and
// usage come from the agent's latest report. A start carries
// `allowed_mount_roots` (central's), which the agent enforces. Thread-safe.
std::unique_ptr<launch::Launcher> NewRemoteLauncher(
    Hub& hub, const std::string& node, const std::vector<std::string>& allowed_mount_roots);
// A handle on container spec.name, which runs on `node` already: what a
// restarted central takes back from the agent's registration.
std::shared_ptr<launch::Handle> NewRemoteHandle(Hub& hub, const std::string& node,
                                                const launch::ContainerSpec& spec);

}  // namespace deepnex::agent

#endif  // DEEPNEX_AGENT_REMOTE_LAUNCHER_H_
