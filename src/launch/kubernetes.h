// The kubernetes backend's manifests, exposed to tests so that what would be
// sent can be checked without an API server. Private to src/launch.
#ifndef DEEPNEX_LAUNCH_KUBERNETES_H_
#define DEEPNEX_LAUNCH_KUBERNETES_H_

#include <string>

#include "launch/backend.h"

namespace deepnex::launch {

// The JSON of the Pod (or Job, options.kind "job") named `name` in
// namespace `namespace_` that runs `spec` once.
std::string KubernetesManifest(const ContainerSpec& spec, const RunContext& context,
                               const KubernetesOptions& options, const std::string& name,
                               const std::string& namespace_);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_KUBERNETES_H_
