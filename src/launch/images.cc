#include "launch/images.h"

#include <chrono>
#include <filesystem>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/text.h"
#include "gpu/ledger.h"

namespace deepnex::launch {
namespace {

// Records between snapshots of the catalog's ledger.
constexpr uint64_t kSnapshotEvery = 1000;
constexpr size_t kMaxPart = 128;
// Users one image is shared with, at most: each share is a record in the
// catalog's log and in every listing of the image.
constexpr size_t kMaxSharedWith = 1024;

// [A-Za-z0-9][A-Za-z0-9_.-]* (a tag may also start with '_'), as OCI
// registries take them.
bool PlainPart(const std::string& s, bool tag) {
  if (s.empty() || s.size() > kMaxPart) return false;
  const auto first = static_cast<unsigned char>(s[0]);
  if (!absl::ascii_isalnum(first) && !(tag && s[0] == '_')) return false;
  for (char c : s) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' &&
        c != '-') {
      return false;
    }
  }
  return true;
}

nlohmann::json ToJson(const CatalogImage& i) {
  return {{"name", i.name},       {"tag", i.tag},
          {"owner", i.owner},     {"public", i.is_public},
          {"shared_with", i.shared_with}, {"size", i.size},
          {"created", i.created}, {"source", i.source}};
}

std::string PutRecord(const CatalogImage& i) {
  return nlohmann::json{{"op", "put"}, {"image", ToJson(i)}}.dump();
}

std::string RefText(const CatalogImage& i) {
  return absl::StrCat(i.owner.empty() ? "" : i.owner + "/", i.name, ":", i.tag);
}

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string CatalogImage::visibility() const {
  if (owner.empty()) return "preset";
  if (is_public) return "public";
  return shared_with.empty() ? "private" : "shared";
}

absl::StatusOr<ImageRef> ImageRef::Parse(const std::string& text, const std::string& field) {
  ImageRef r;
  std::string rest = text;
  if (const size_t slash = rest.find('/'); slash != std::string::npos) {
    r.owner = rest.substr(0, slash);
    rest = rest.substr(slash + 1);
  }
  if (const size_t colon = rest.rfind(':'); colon != std::string::npos) {
    r.tag = rest.substr(colon + 1);
    rest = rest.substr(0, colon);
  }
  r.name = rest;
  const bool owner_ok = text.find('/') == std::string::npos || PlainPart(r.owner, false);
  if (!owner_ok || !PlainPart(r.name, false) || !PlainPart(r.tag, true)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", Quoted(text),
        " is not an image NAME[:TAG] or OWNER/NAME[:TAG] (each part [A-Za-z0-9][A-Za-z0-9_.-]*, "
        "at most ", kMaxPart, " characters; never a path)"));
  }
  return r;
}

absl::StatusOr<std::unique_ptr<ImageCatalog>> ImageCatalog::Open(const std::string& dir) {
  std::unique_ptr<ImageCatalog> c(new ImageCatalog());
  if (dir.empty()) return c;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  std::lock_guard<std::mutex> lock(c->mu_);
  DEEPNEX_ASSIGN_OR_RETURN(
      c->ledger_, gpu::Ledger::Open(dir, gpu::LedgerOptions{},
                                    [&](const std::string& r) { return c->ApplyLocked(r); }));
  return c;
}

ImageCatalog::~ImageCatalog() = default;

absl::Status ImageCatalog::ApplyLocked(const std::string& record) {
  nlohmann::json r = nlohmann::json::parse(record, nullptr, /*allow_exceptions=*/false);
  auto bad = [&] {
    return absl::DataLossError(absl::StrCat("image catalog: record \"", record,
                                            "\" is not one of its records"));
  };
  if (!r.is_object()) return bad();
  try {
    const std::string op = r.at("op").get<std::string>();
    if (op == "put") {
      const nlohmann::json& j = r.at("image");
      CatalogImage i;
      i.name = j.at("name").get<std::string>();
      i.tag = j.at("tag").get<std::string>();
      i.owner = j.at("owner").get<std::string>();
      i.is_public = j.at("public").get<bool>();
      i.shared_with = j.at("shared_with").get<std::set<std::string>>();
      i.size = j.at("size").get<uint64_t>();
      i.created = j.at("created").get<double>();
      i.source = j.at("source").get<std::string>();
      images_[Key{i.owner, i.name, i.tag}] = std::move(i);
    } else if (op == "rm") {
      images_.erase(Key{r.at("owner").get<std::string>(), r.at("name").get<std::string>(),
                        r.at("tag").get<std::string>()});
    } else {
      return bad();
    }
  } catch (const nlohmann::json::exception&) {
    return bad();
  }
  return absl::OkStatus();
}

absl::Status ImageCatalog::CommitLocked(std::unique_lock<std::mutex>& lock,
                                        const std::string& record) {
  DEEPNEX_RETURN_IF_ERROR(ApplyLocked(record));
  if (!ledger_) return absl::OkStatus();
  const uint64_t ticket = ledger_->Append(record);
  if (ledger_->records_since_snapshot() >= kSnapshotEvery) {
    std::vector<std::string> records;
    for (const auto& [key, i] : images_) records.push_back(PutRecord(i));
    return ledger_->Snapshot(records);
  }
  // Catalog changes are rare: one at a time, under the lock, keeps the
  // state in memory never ahead of a failed write for long.
  absl::Status s = ledger_->Sync(ticket);
  if (!s.ok()) {
    images_.clear();
    ledger_->Recover([this](const std::string& r) { return ApplyLocked(r); }).IgnoreError();
  }
  return s;
}

absl::Status ImageCatalog::Put(CatalogImage image, bool force) {
  if (!PlainPart(image.name, false) || !PlainPart(image.tag, true) ||
      (!image.owner.empty() && !PlainPart(image.owner, false))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "image: \"", RefText(image), "\" is not an image OWNER/NAME:TAG (each part "
        "[A-Za-z0-9][A-Za-z0-9_.-]*)"));
  }
  if (image.created == 0) image.created = Now();
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{image.owner, image.name, image.tag};
  if (reserved_.count(key)) {
    return absl::AlreadyExistsError(absl::StrCat("image \"", RefText(image),
                                                 "\" is being committed"));
  }
  if (!force && images_.count(key)) {
    return absl::AlreadyExistsError(absl::StrCat("image \"", RefText(image),
                                                 "\" exists (force replaces it)"));
  }
  return CommitLocked(lock, PutRecord(image));
}

absl::StatusOr<ImageCatalog::Reservation> ImageCatalog::Reserve(const std::string& owner,
                                                                const std::string& name,
                                                                const std::string& tag) {
  std::lock_guard<std::mutex> lock(mu_);
  Key key{owner, name, tag};
  const std::string what = absl::StrCat("name: image \"", name, ":", tag, "\" of user ", owner);
  if (images_.count(key)) {
    return absl::AlreadyExistsError(
        absl::StrCat(what, " exists; commit as a new tag (NAME:TAG) or remove it first"));
  }
  if (!reserved_.insert(key).second) {
    return absl::AlreadyExistsError(
        absl::StrCat(what, " is being committed by another call; commit as a new tag (NAME:TAG)"));
  }
  return Reservation(this, std::move(key));
}

ImageCatalog::Reservation::Reservation(Reservation&& other) noexcept
    : catalog_(std::exchange(other.catalog_, nullptr)), key_(std::move(other.key_)) {}

ImageCatalog::Reservation::~Reservation() {
  if (catalog_ == nullptr) return;
  std::lock_guard<std::mutex> lock(catalog_->mu_);
  catalog_->reserved_.erase(key_);
}

absl::Status ImageCatalog::Reservation::Fill(CatalogImage image) {
  if (catalog_ == nullptr || Key{image.owner, image.name, image.tag} != key_) {
    return absl::InternalError(absl::StrCat("image \"", RefText(image),
                                            "\" is not the one reserved"));
  }
  if (image.created == 0) image.created = Now();
  ImageCatalog* catalog = std::exchange(catalog_, nullptr);
  std::unique_lock<std::mutex> lock(catalog->mu_);
  catalog->reserved_.erase(key_);
  // Put refuses a reserved name, so nothing took it meanwhile.
  return catalog->CommitLocked(lock, PutRecord(image));
}

bool ImageCatalog::MayRunLocked(const ImageCaller& caller, const CatalogImage& i) const {
  return caller.admin || i.owner.empty() || i.owner == caller.user || i.is_public ||
         i.shared_with.count(caller.user) != 0;
}

const CatalogImage* ImageCatalog::LookupLocked(const ImageCaller& caller,
                                               const ImageRef& ref) const {
  // Without an owner: the caller's own, else a preset.
  for (const std::string& owner :
       ref.owner.empty() ? std::vector<std::string>{caller.user, ""}
                         : std::vector<std::string>{ref.owner}) {
    auto it = images_.find(Key{owner, ref.name, ref.tag});
    if (it != images_.end()) return &it->second;
  }
  return nullptr;
}

std::string ImageCatalog::DisplayName(const ImageCaller& caller, const CatalogImage& image) {
  return image.owner.empty() || image.owner == caller.user ? image.name
                                                            : image.owner + "/" + image.name;
}

absl::StatusOr<CatalogImage> ImageCatalog::Resolve(const ImageCaller& caller,
                                                   const std::string& ref) const {
  DEEPNEX_ASSIGN_OR_RETURN(ImageRef r, ImageRef::Parse(ref, "image"));
  std::lock_guard<std::mutex> lock(mu_);
  const CatalogImage* i = LookupLocked(caller, r);
  if (i == nullptr || !MayRunLocked(caller, *i)) {
    return absl::NotFoundError(
        absl::StrCat("image \"", ref, "\": no such image that user ", caller.user, " may run"));
  }
  return *i;
}

std::vector<CatalogImage> ImageCatalog::List(const ImageCaller& caller) const {
  std::vector<CatalogImage> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, i] : images_) {
    if (MayRunLocked(caller, i)) out.push_back(i);
  }
  return out;
}

absl::StatusOr<CatalogImage> ImageCatalog::FindOwnedLocked(const ImageCaller& caller,
                                                           const std::string& ref) const {
  DEEPNEX_ASSIGN_OR_RETURN(ImageRef r, ImageRef::Parse(ref, "image"));
  const CatalogImage* i = LookupLocked(caller, r);
  if (i == nullptr || !MayRunLocked(caller, *i)) {
    return absl::NotFoundError(
        absl::StrCat("image \"", ref, "\": no such image that user ", caller.user, " may see"));
  }
  if (!caller.admin && i->owner != caller.user) {
    return absl::PermissionDeniedError(absl::StrCat(
        "image \"", ref, "\": user ", caller.user, " does not own it (",
        i->owner.empty() ? "a preset, an admin's" : "its owner is " + i->owner, ")"));
  }
  return *i;
}

absl::StatusOr<CatalogImage> ImageCatalog::Share(const ImageCaller& caller,
                                                 const std::string& ref,
                                                 const std::vector<std::string>& users,
                                                 bool make_public) {
  if (users.empty() && !make_public) {
    return absl::InvalidArgumentError(
        absl::StrCat("share of image \"", ref, "\": give users or public"));
  }
  // A name that could own an image, as an owner's part of a reference: '*'
  // (which is not "everyone": that is public), '../bob' and the like were
  // kept (probe).
  for (const std::string& u : users) {
    if (!PlainPart(u, false)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "share of image \"", ref, "\": user ", Quoted(u, 64),
          " is not a user name (letters, digits, '_', '.', '-', at most ", kMaxPart,
          " characters; public shares with everyone)"));
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  DEEPNEX_ASSIGN_OR_RETURN(CatalogImage i, FindOwnedLocked(caller, ref));
  if (i.owner.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("image \"", ref, "\" is a preset: every user may run it already"));
  }
  i.shared_with.insert(users.begin(), users.end());
  i.shared_with.erase(i.owner);
  if (i.shared_with.size() > kMaxSharedWith) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "share of image \"", ref, "\": it would be shared with ", i.shared_with.size(),
        " users, more than ", kMaxSharedWith, "; share it public"));
  }
  i.is_public = i.is_public || make_public;
  DEEPNEX_RETURN_IF_ERROR(CommitLocked(lock, PutRecord(i)));
  return i;
}

absl::StatusOr<CatalogImage> ImageCatalog::Unshare(const ImageCaller& caller,
                                                   const std::string& ref,
                                                   const std::vector<std::string>& users) {
  std::unique_lock<std::mutex> lock(mu_);
  DEEPNEX_ASSIGN_OR_RETURN(CatalogImage i, FindOwnedLocked(caller, ref));
  if (i.owner.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("image \"", ref, "\" is a preset: it cannot be unshared (remove it)"));
  }
  if (users.empty()) {
    i.shared_with.clear();
    i.is_public = false;
  }
  for (const std::string& u : users) {
    if (!i.shared_with.erase(u)) {
      return absl::NotFoundError(
          absl::StrCat("image \"", ref, "\" is not shared with user ", Quoted(u), " (it is shared with [",
                       absl::StrJoin(i.shared_with, ", "), "])"));
    }
  }
  DEEPNEX_RETURN_IF_ERROR(CommitLocked(lock, PutRecord(i)));
  return i;
}

absl::StatusOr<CatalogImage> ImageCatalog::Remove(const ImageCaller& caller,
                                                  const std::string& ref) {
  std::unique_lock<std::mutex> lock(mu_);
  DEEPNEX_ASSIGN_OR_RETURN(CatalogImage i, FindOwnedLocked(caller, ref));
  DEEPNEX_RETURN_IF_ERROR(CommitLocked(
      lock,
      nlohmann::json{{"op", "rm"}, {"owner", i.owner}, {"name", i.name}, {"tag", i.tag}}.dump()));
  return i;
}

uint64_t DirectorySize(const std::string& dir) {
  if (dir.empty() || dir[0] != '/') return 0;
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(
           dir, std::filesystem::directory_options::skip_permission_denied, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec) && !it->is_symlink(ec)) total += it->file_size(ec);
  }
  return total;
}

}  // namespace deepnex::launch
