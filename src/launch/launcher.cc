// PLACEHOLDER until the generic launcher is written.
#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

absl::StatusOr<std::unique_ptr<Launcher>> Launcher::Create(const LauncherOptions&) {
  return absl::UnimplementedError("the launcher is not written yet");
}

}  // namespace deepnex::launch
