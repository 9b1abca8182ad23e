// The docker backend's request bodies, exposed to tests so that what would
// be sent can be checked without an engine (GPUs, where none exist here).
// Private to src/launch.
#ifndef DEEPNEX_LAUNCH_DOCKER_H_
#define DEEPNEX_LAUNCH_DOCKER_H_

#include <string>

#include "launch/backend.h"

namespace deepnex::launch {

// The JSON body of POST /containers/create for one run of `spec`.
std::string DockerCreateBody(const ContainerSpec& spec, const RunContext& context);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_DOCKER_H_
