// The oci backend's bundle (private to src/launch): the config.json of the
// OCI runtime spec that runc runs a ContainerSpec from. A function of its
// inputs (and of the host's device nodes and file limits), so that it can be
// checked without root or runc.
#ifndef DEEPNEX_LAUNCH_OCI_CONFIG_H_
#define DEEPNEX_LAUNCH_OCI_CONFIG_H_

#include <string>

#include <nlohmann/json.hpp>

#include "deepnex/launch/launcher.h"
#include "launch/backend.h"
#include "launch/oci_image.h"

namespace deepnex::launch {

// Where the init (OciOptions::init) is bound in: the runtime's tmpfs, so
// that no image gets a mount point written into it.
inline constexpr char kInitPath[] = "/dev/init";

// The bundle's "mounts": the runtime's file systems, the init (`init`: its
// host path, "" for none), the host image's directories, the spec's mounts.
nlohmann::json Mounts(const Image& image, const ContainerSpec& spec, const std::string& init);

// The whole config.json for one run of `spec` in cgroup `cgroup_path`.
nlohmann::json MakeConfig(const Image& image, const ContainerSpec& spec,
                          const RunContext& context, const std::string& cgroup_path,
                          const std::string& init);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_OCI_CONFIG_H_
