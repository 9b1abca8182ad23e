// The oci backend's images (private to src/launch): where a container's
// root file system comes from ("host", a rootfs directory, an OCI image
// layout unpacked once), and whether a command exists in it.
#ifndef DEEPNEX_LAUNCH_OCI_IMAGE_H_
#define DEEPNEX_LAUNCH_OCI_IMAGE_H_

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// The PATH inside a container whose spec sets none (runc spec's).
inline constexpr char kContainerPath[] =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

// The host directories the "host" image shows read-only. Not /etc: every
// container gets a generated one (see EtcEntry).
inline const char* const kHostDirs[] = {"/usr", "/opt"};

// An entry of the host's /etc that the host image shows: only what
// programs need to run (the dynamic linker's cache, alternatives,
// certificates, time zone, ...), never the host's users, groups, secrets
// or configuration.
struct EtcEntry {
  std::string name;    // in /etc
  std::string source;  // the host directory or file, bound in read-only
};

// Where a container's files come from.
struct Image {
  std::string rootfs;  // absolute
  bool host = false;   // the "host" image: kHostDirs are bound in
  std::vector<EtcEntry> etc;  // host image: what it shows of the host's /etc
  // A registry image: its pulled OCI image layout and the tag there, on
  // which a commit adds a layer; "" otherwise.
  std::string layout;
  std::string tag;
};

// The files generated for every container, bound read-only over its
// image's /etc (the host image's is empty but for its EtcEntries).
inline const char* const kGeneratedEtc[] = {"passwd", "group",         "hosts",
                                            "hostname", "resolv.conf", "nsswitch.conf"};

// NotFound unless `spec.command[0]` is an executable file in the container
// (the image's rootfs under the bundle's `mounts`), looked up on the spec's
// PATH (runc's default without one) as runc would, and the working
// directory is a directory there.
absl::Status CheckInImage(const Image& image, const nlohmann::json& mounts,
                          const ContainerSpec& spec);

// Packs the changes in overlayfs upper directory `upper` (a container's
// writes over `base`'s files) as one OCI layer, whiteouts in the OCI
// format, adds it to a copy of `base`'s layout made under `scratch` and
// pushes the result to registry image `target` (docker://HOST:PORT/REPO:TAG):
// the registry is sent only the blobs it lacks. Returns the new image's
// bytes (its blobs). FailedPrecondition unless `base` came from a registry.
absl::StatusOr<uint64_t> CommitChanges(const Image& base, const std::string& upper,
                                       const std::string& scratch, const std::string& target);

// Resolves a spec's image to a rootfs, preparing it on first use: the
// "host" image's empty root, an OCI layout's unpacked layers (cached under
// <state_dir>/oci). Thread-safe.
class ImageStore {
 public:
  explicit ImageStore(std::string state_dir) : state_dir_(std::move(state_dir)) {}

  // The rootfs of `image`: NotFound naming it when it does not exist. An
  // image in a registry (docker://HOST:PORT/REPO:TAG) is pulled into
  // <state_dir>/oci/pulled once per manifest digest; a registry that cannot
  // be reached is Unavailable naming it.
  absl::StatusOr<Image> Resolve(const std::string& image);

 private:
  // The OCI layout of registry image `image`, pulled unless it is here.
  absl::StatusOr<std::string> PullLocked(const std::string& image);

  const std::string state_dir_;
  std::mutex mu_;  // guards the state below
  bool host_ready_ = false;
  std::vector<EtcEntry> host_etc_;
  std::map<std::string, std::string> layouts_;  // layout dir -> unpacked rootfs
};

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_OCI_IMAGE_H_
