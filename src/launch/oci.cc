// PLACEHOLDER until the oci backend is written.
#include "launch/backend.h"

namespace deepnex::launch {

absl::StatusOr<std::unique_ptr<Backend>> MakeOciBackend(const LauncherOptions&) {
  return absl::UnimplementedError("the oci backend is not written yet");
}

}  // namespace deepnex::launch
