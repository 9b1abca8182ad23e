// PLACEHOLDER until the slurm backend is written.
#include "launch/backend.h"

namespace deepnex::launch {

absl::StatusOr<std::unique_ptr<Backend>> MakeSlurmBackend(const LauncherOptions&) {
  return absl::UnimplementedError("the slurm backend is not written yet");
}

}  // namespace deepnex::launch
