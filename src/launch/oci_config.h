// The oci backend's bundle (private to src/launch): the config.json of the
// OCI runtime spec that runc runs a ContainerSpec from. A function of its
// inputs (and of the host's device nodes and file limits), so that it can be
// checked without root or runc.
#ifndef DEEPNEX_LAUNCH_OCI_CONFIG_H_
#define DEEPNEX_LAUNCH_OCI_CONFIG_H_

#include <cstdint>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "deepnex/launch/launcher.h"
#include "launch/backend.h"
#include "launch/oci_image.h"

namespace deepnex::launch {

// Where the init (OciOptions::init) is bound in: the runtime's tmpfs, so
// that no image gets a mount point written into it.
inline constexpr char kInitPath[] = "/dev/init";

// What one run's bundle is made of besides its spec and image.
struct Bundle {
  std::string cgroup_path;
  // The init's host path (bound in at kInitPath); "" for none.
  std::string init;
  // The generated /etc files' host directory (see WriteEtc), bound in
  // read-only over the image's; "" while a spec is only checked.
  std::string etc_dir;
  // Whom the command runs as (RunAs, else the launcher's own ids). Any uid
  // but 0 runs with no capabilities at all.
  uint32_t uid = 0;
  uint32_t gid = 0;
  // The run's writable root: an overlayfs mount of the image's rootfs
  // (read-only, shared by every container of the image) under an upper
  // directory of the run's own; "": the image's rootfs, read-only.
  std::string root;
};

// The bundle's "mounts": the runtime's file systems, the init, the host
// image's directories and /etc entries, the generated /etc files, then the
// spec's mounts.
nlohmann::json Mounts(const Image& image, const ContainerSpec& spec, const Bundle& bundle);

// The whole config.json for one run of `spec`.
nlohmann::json MakeConfig(const Image& image, const ContainerSpec& spec,
                          const RunContext& context, const Bundle& bundle);

// The files of a container's generated /etc (kGeneratedEtc), by name:
// passwd and group with root, nobody and the user the command runs as,
// hosts with localhost and the container's hostname, `resolv_conf` (the
// host's with the host network, else empty: a private network has no
// DNS server to reach).
std::map<std::string, std::string> EtcFiles(const ContainerSpec& spec, const Bundle& bundle,
                                            const std::string& resolv_conf);

// Writes `files` (EtcFiles) into directory `dir`, made if missing.
absl::Status WriteEtc(const std::string& dir, const std::map<std::string, std::string>& files);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_OCI_CONFIG_H_
