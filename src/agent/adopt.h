// Re-attaching a restarted deepnex-agent to the containers that the agent
// before it (killed, so it stopped nothing) left running. The launcher has no
// re-attach of its own, so the agent reads the launcher's records in its
// state directory. Process backend only: a container is its process group,
// found by the pid in its record. Private to libdeepnex.
#ifndef DEEPNEX_AGENT_ADOPT_H_
#define DEEPNEX_AGENT_ADOPT_H_

#include <memory>
#include <string>
#include <vector>

#include "deepnex/launch/launcher.h"

namespace deepnex::agent {

// Handles on the live containers recorded under `state_dir` by a process
// launcher other than `own_launcher_id` whose process is gone. Each reads its
// current run's log, stops its process group, and ends "lost" when the
// process is gone (its exit code went with its parent). Thread-safe.
std::vector<std::shared_ptr<launch::Handle>> AdoptOrphans(const std::string& state_dir,
                                                          const std::string& own_launcher_id);

}  // namespace deepnex::agent

#endif  // DEEPNEX_AGENT_ADOPT_H_
