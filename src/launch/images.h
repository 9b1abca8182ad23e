// deepnex-central's image catalog (private to src/launch): the images users
// may run. Presets are an admin's (deepnex-central's --image flags, or
// registered by an admin call); other images belong to a user, who may
// share them with named users or with everyone. A user names an image as
// NAME[:TAG] (their own, else a preset) or OWNER/NAME[:TAG] (another's that
// is shared with them); a user never names a host path.
//
// Crash-safe: every change is a record in a gpu::Ledger under the catalog's
// directory, durable before the call returns.
#ifndef DEEPNEX_LAUNCH_IMAGES_H_
#define DEEPNEX_LAUNCH_IMAGES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "deepnex/status.h"

namespace deepnex::gpu {
class Ledger;
}

namespace deepnex::launch {

inline constexpr char kDefaultTag[] = "latest";

struct CatalogImage {
  std::string name;
  std::string tag = kDefaultTag;
  std::string owner;  // "": a preset
  bool is_public = false;
  std::set<std::string> shared_with;
  uint64_t size = 0;   // bytes of its files
  double created = 0;  // seconds since the epoch
  // What the launcher runs: a preset's launcher image name (one of
  // LauncherOptions::images), "host", or an absolute directory.
  std::string source;

  // "preset", "public", "shared" or "private".
  std::string visibility() const;
};

// NAME[:TAG] or OWNER/NAME[:TAG], parsed.
struct ImageRef {
  std::string owner;  // "" unless given
  std::string name;
  std::string tag = kDefaultTag;

  // InvalidArgument naming `field` and the text when it is not a reference.
  static absl::StatusOr<ImageRef> Parse(const std::string& text, const std::string& field);
};

// Who asks: a user, or an admin (who sees and acts on every image).
struct ImageCaller {
  std::string user;
  bool admin = false;
};

// Thread-safe.
class ImageCatalog {
 public:
  // Opens (creating) the catalog in `dir`; "" keeps it in memory only.
  static absl::StatusOr<std::unique_ptr<ImageCatalog>> Open(const std::string& dir);
  ~ImageCatalog();

  // Adds `image` (its created time now if 0), or, with `force`, replaces
  // one of the same owner, name and tag; AlreadyExists otherwise, and
  // while a commit holds that name (Reserve).
  absl::Status Put(CatalogImage image, bool force);

  // A user's NAME:TAG held for a commit while it pushes, so that a second
  // commit of it fails at once instead of pushing over the first one's
  // registry tag. Visible to nobody and kept in memory only: a restart of
  // central drops it, never leaving an image. Destroyed unfilled (the
  // commit failed), it frees the name.
  class Reservation {
   public:
    Reservation(Reservation&& other) noexcept;
    Reservation& operator=(Reservation&&) = delete;
    ~Reservation();
    // Records `image` (the reserved owner, name and tag) and frees the hold.
    absl::Status Fill(CatalogImage image);

   private:
    friend class ImageCatalog;
    Reservation(ImageCatalog* catalog, std::tuple<std::string, std::string, std::string> key)
        : catalog_(catalog), key_(std::move(key)) {}
    ImageCatalog* catalog_;  // null: filled or moved from
    std::tuple<std::string, std::string, std::string> key_;
  };
  // Holds `owner`'s `name`:`tag` for a commit; AlreadyExists (naming the
  // field "name") when it exists or another commit holds it.
  absl::StatusOr<Reservation> Reserve(const std::string& owner, const std::string& name,
                                      const std::string& tag);
  // The image `ref` names for `caller`, if the caller may run it: their
  // own, a preset, one shared with them or public. Anything else is
  // NotFound, as if it did not exist.
  absl::StatusOr<CatalogImage> Resolve(const ImageCaller& caller, const std::string& ref) const;
  // What `caller` may run (admins: every image), by owner, name and tag.
  std::vector<CatalogImage> List(const ImageCaller& caller) const;
  // Shares `ref`, the caller's own (admins: any), with `users` and, with
  // `make_public`, everyone. Returns the image as it is now.
  absl::StatusOr<CatalogImage> Share(const ImageCaller& caller, const std::string& ref,
                                     const std::vector<std::string>& users, bool make_public);
  // Takes back the shares of `users`; without users, every share and the
  // public one.
  absl::StatusOr<CatalogImage> Unshare(const ImageCaller& caller, const std::string& ref,
                                       const std::vector<std::string>& users);
  // Removes `ref` (a preset: admins only); returns what it was.
  absl::StatusOr<CatalogImage> Remove(const ImageCaller& caller, const std::string& ref);

  // How `caller` names `image`: NAME for their own and presets,
  // OWNER/NAME for another's.
  static std::string DisplayName(const ImageCaller& caller, const CatalogImage& image);

 private:
  using Key = std::tuple<std::string, std::string, std::string>;  // owner, name, tag
  ImageCatalog() = default;
  absl::Status ApplyLocked(const std::string& record);
  // Appends `record`, applies it, and returns once it is durable.
  absl::Status CommitLocked(std::unique_lock<std::mutex>& lock, const std::string& record);
  bool MayRunLocked(const ImageCaller& caller, const CatalogImage& image) const;
  // The image `ref` names that `caller` may change: their own (admins:
  // any). NotFound for what the caller may not see, PermissionDenied for
  // what they see but do not own.
  absl::StatusOr<CatalogImage> FindOwnedLocked(const ImageCaller& caller,
                                               const std::string& ref) const;
  const CatalogImage* LookupLocked(const ImageCaller& caller, const ImageRef& ref) const;

  mutable std::mutex mu_;
  std::map<Key, CatalogImage> images_;
  std::set<Key> reserved_;  // NAME:TAGs being committed
  std::unique_ptr<gpu::Ledger> ledger_;  // null: in memory
};

// The bytes of the regular files under `dir` (0 for "host").
uint64_t DirectorySize(const std::string& dir);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_IMAGES_H_
