// Re-attaching a restarted deepnex-agent to the containers that the agent
// before it (killed, so it stopped nothing) left running. The launcher has no
// re-attach of its own, so the agent reads the launcher's records in its
// state directory. Process backend: a container is its process group, found
// by the pid in its record while that pid's kernel start time is the one
// recorded with it (a pid reused since is another process: its record is
// rewritten as ended, "lost", and nothing signals it). Oci backend: a container is runc's, found by the
// run name in its record (`runc state`: running, and its init's pid); its
// `runc run` outlived the agent, and its output still goes to its log.
// Private to libdeepnex.
#ifndef DEEPNEX_AGENT_ADOPT_H_
#define DEEPNEX_AGENT_ADOPT_H_

#include <memory>
#include <string>
#include <vector>

#include "deepnex/launch/launcher.h"

namespace deepnex::agent {

// Handles on the live containers recorded under `options.state_dir` by a
// launcher of `options.backend` (process or oci) other than
// `own_launcher_id` whose process is gone. Each reads its current run's log
// and usage (its cgroup), stops its process group (oci: `runc kill`), and
// ends "lost" when its process is gone (its exit code went with its
// parent); an ended oci container is deleted from runc's state then.
// Thread-safe.
std::vector<std::shared_ptr<launch::Handle>> AdoptOrphans(const launch::LauncherOptions& options,
                                                          const std::string& own_launcher_id);

}  // namespace deepnex::agent

#endif  // DEEPNEX_AGENT_ADOPT_H_
