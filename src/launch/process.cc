// PLACEHOLDER until the process backend is written.
#include "launch/backend.h"

namespace deepnex::launch {

absl::StatusOr<std::unique_ptr<Backend>> MakeProcessBackend(const LauncherOptions&) {
  return absl::UnimplementedError("the process backend is not written yet");
}

}  // namespace deepnex::launch
