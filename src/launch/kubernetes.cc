// PLACEHOLDER until the kubernetes backend is written.
#include "launch/backend.h"

namespace deepnex::launch {

absl::StatusOr<std::unique_ptr<Backend>> MakeKubernetesBackend(const LauncherOptions&) {
  return absl::UnimplementedError("the kubernetes backend is not written yet");
}

}  // namespace deepnex::launch
