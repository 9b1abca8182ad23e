// PLACEHOLDER until the docker backend is written.
#include "launch/backend.h"

namespace deepnex::launch {

absl::StatusOr<std::unique_ptr<Backend>> MakeDockerBackend(const LauncherOptions&) {
  return absl::UnimplementedError("the docker backend is not written yet");
}

}  // namespace deepnex::launch
