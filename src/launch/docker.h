// The docker backend's request bodies, exposed to tests so that what would
// be sent can be checked without an engine (GPUs, where none exist here),
// and its re-attach. Private to libdeepnex.
#ifndef DEEPNEX_LAUNCH_DOCKER_H_
#define DEEPNEX_LAUNCH_DOCKER_H_

#include <string>

#include "launch/backend.h"

namespace deepnex::launch {

// The JSON body of POST /containers/create for one run of `spec`.
std::string DockerCreateBody(const ContainerSpec& spec, const RunContext& context);

// The running run of the container `name` that the launcher `launcher_id`
// started on the engine of `options`, found by the labels it set
// (kLauncherLabel, kNameLabel): for a restarted agent to re-attach to it.
// NotFound when none runs; FailedPrecondition without an engine.
absl::StatusOr<std::unique_ptr<Run>> FindDockerRun(const LauncherOptions& options,
                                                   const std::string& launcher_id,
                                                   const std::string& name);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_DOCKER_H_
