// The environment of a container whose engine exposes the allocated GPUs
// itself (Docker's DeviceRequests, a Kubernetes device plugin). Private to
// src/launch.
#ifndef DEEPNEX_LAUNCH_ENGINE_ENV_H_
#define DEEPNEX_LAUNCH_ENGINE_ENV_H_

#include <map>
#include <string>

#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// `spec.env` as such an engine should get it: inside the container the
// granted GPUs are numbered from 0, so CUDA_VISIBLE_DEVICES becomes 0..n-1
// instead of the host's indices.
inline std::map<std::string, std::string> EngineEnv(const ContainerSpec& spec) {
  std::map<std::string, std::string> env = spec.env;
  if (!spec.allocation.has_value() || spec.allocation->gpus.empty()) return env;
  std::string visible;
  for (size_t i = 0; i < spec.allocation->gpus.size(); ++i) {
    if (i > 0) visible += ',';
    visible += std::to_string(i);
  }
  env["CUDA_VISIBLE_DEVICES"] = visible;
  return env;
}

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_ENGINE_ENV_H_
