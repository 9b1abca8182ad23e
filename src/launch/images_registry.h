// Images in an OCI registry (private to src/launch): a site's own
// distribution registry (Debian's docker-registry), reached over plain HTTP,
// with skopeo moving images between it and OCI image layouts. References
// are "docker://HOST:PORT/REPO:TAG", as skopeo takes them.
#ifndef DEEPNEX_LAUNCH_IMAGES_REGISTRY_H_
#define DEEPNEX_LAUNCH_IMAGES_REGISTRY_H_

#include <string>

#include "deepnex/status.h"

namespace deepnex::launch {

inline constexpr char kRegistryScheme[] = "docker://";

struct RegistryRef {
  std::string registry;  // HOST:PORT
  std::string repo;      // e.g. "alice/tools"
  std::string tag;
  // The manifest's "sha256:<64 hex>", or "" (the tag's image, as it is
  // when pulled). A catalog's image pins the digest it pushed, so a tag
  // pushed over later does not change what it runs.
  std::string digest;

  std::string ToString() const;  // docker://HOST:PORT/REPO:TAG[@DIGEST]
  // What skopeo reads: REPO@DIGEST when pinned (skopeo takes no tag beside
  // a digest), else REPO:TAG.
  std::string Location() const;
  // InvalidArgument naming the text unless it is such a reference.
  static absl::StatusOr<RegistryRef> Parse(const std::string& text);
};

// Whether `image` (a spec's) names an image in a registry.
bool IsRegistryImage(const std::string& image);

// The digest ("sha256:...") of `ref`'s manifest (its pinned one, if the
// registry has it), from the registry (its
// manifest only: no layer moves). Unavailable naming the registry when it
// cannot be reached; NotFound when it has no such image.
absl::StatusOr<std::string> RegistryDigest(const RegistryRef& ref);

// Copies OCI image layout `layout` (its only image, or tag `tag` if given)
// to `ref`: only the blobs the registry lacks move. Errors as
// RegistryDigest's.
absl::Status PushLayout(const std::string& layout, const std::string& tag, const RegistryRef& ref);

// Copies `ref` into a new OCI image layout `dir` (tag `ref.tag`).
absl::Status PullLayout(const RegistryRef& ref, const std::string& dir);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_IMAGES_REGISTRY_H_
