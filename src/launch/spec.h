// Spec validation: the one place a ContainerSpec meets its gpu::Allocation.
// Private to src/launch; the Launcher resolves every spec here before a
// backend sees it. Stateless functions, safe from any thread.
#ifndef DEEPNEX_LAUNCH_SPEC_H_
#define DEEPNEX_LAUNCH_SPEC_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// The labels the launcher sets on every container (a spec may not): which
// launcher started it and under which container name.
inline constexpr char kLauncherLabel[] = "deepnex.launcher";
inline constexpr char kNameLabel[] = "deepnex.name";

// `name` is [a-zA-Z0-9][a-zA-Z0-9_.-]* and at most `max` characters;
// InvalidArgument naming `field` and the value otherwise.
absl::Status CheckName(const std::string& field, const std::string& name, size_t max);

// `path` is absolute and has no "." or ".." component.
absl::Status CheckAbsoluteNormal(const std::string& field, const std::string& path);

// Checks a spec and resolves it against its allocation: the user, cpus and
// memory default to the grant's and may not exceed it, its env is the grant's
// plus the spec's, the launcher's labels are added, a named image becomes its
// directory and each mount's source its checked real path.
absl::StatusOr<ContainerSpec> Resolve(const LauncherOptions& options,
                                      const std::string& launcher_id, ContainerSpec spec);

// PermissionDenied unless `user` is the allocation's.
absl::Status CheckSpecUser(const std::string& user, const gpu::Allocation& a);

// The mounts of `spec` checked against `roots` as a launcher checks them
// against its allowed_mount_roots (each source set to its checked real
// path), except that no roots allow no mount: an agent checks central's
// roots on its own node, where the paths are.
absl::Status CheckMounts(const std::vector<std::string>& roots, ContainerSpec& spec);

// For the backends that run a spec on this host's files (process, slurm):
// its working_dir is a directory here and its program is found on its PATH.
absl::Status CheckRunsOnHost(const ContainerSpec& spec);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_SPEC_H_
