#include "launch/oci_image.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/file_util.h"
#include "core/random.h"
#include "core/text.h"
#include "launch/command.h"
#include "launch/images.h"
#include "launch/images_registry.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The "host" image's symlinks into kHostDirs (the layout of a merged-/usr
// Debian).
const char* const kHostLinks[][2] = {
    {"bin", "usr/bin"}, {"lib", "usr/lib"}, {"lib64", "usr/lib64"}, {"sbin", "usr/sbin"}};

// What the "host" image shows of the host's /etc: what programs need to
// run (on Debian many commands are symlinks through /etc/alternatives), and
// nothing that names the host's users or holds a secret.
const char* const kHostEtc[] = {
    "alternatives", "ca-certificates", "ca-certificates.conf", "gai.conf", "host.conf",
    "ld.so.cache",  "ld.so.conf",      "ld.so.conf.d",         "localtime", "mime.types",
    "protocols",    "services",        "ssl",                  "terminfo",  "timezone"};

std::string Errno(int err) { return strerror(err); }

// The host's /etc entries of kHostEtc as the host image shows them: the
// directories and files (to bind in); the symlinks are made in `rootfs`'s
// /etc, where they resolve in the container.
absl::StatusOr<std::vector<EtcEntry>> HostEtc(const std::string& rootfs) {
  std::vector<EtcEntry> entries;
  for (const char* name : kHostEtc) {
    const std::string path = absl::StrCat("/etc/", name);
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) continue;
    if (S_ISLNK(st.st_mode)) {
      char target[PATH_MAX];
      const ssize_t n = readlink(path.c_str(), target, sizeof target);
      if (n <= 0 || n == sizeof target) continue;
      const std::string at = absl::StrCat(rootfs, "/etc/", name);
      if (symlink(std::string(target, n).c_str(), at.c_str()) != 0 && errno != EEXIST) {
        return absl::InternalError(absl::StrCat("cannot create ", at, ": ", Errno(errno)));
      }
    } else if (S_ISDIR(st.st_mode) || S_ISREG(st.st_mode)) {
      entries.push_back({name, path});
    }
  }
  return entries;
}

// Opens `path` (absolute, as the container sees it) inside `root_fd` with
// symlinks and ".." resolved as if `root_fd` were "/".
Fd OpenInRoot(int root_fd, const std::string& path, uint64_t flags) {
  struct open_how how;
  memset(&how, 0, sizeof how);
  how.flags = flags | O_CLOEXEC;
  how.resolve = RESOLVE_IN_ROOT;
  return Fd(static_cast<int>(syscall(SYS_openat2, root_fd, path.c_str(), &how, sizeof how)));
}

bool IsExecutable(const struct stat& st) {
  return S_ISREG(st.st_mode) && (st.st_mode & 0111) != 0;
}

// The container's file tree as it will be, seen from the host before the
// container exists: the image's rootfs under the bundle's mounts. Binds
// show their host source; the runtime's own file systems (proc, the tmpfs
// of /dev and /tmp, ...) are empty here. Paths resolve as the kernel
// resolves them inside the container: component by component, symlinks
// followed, an absolute link or ".." from the container's root and never
// above it, at most kMaxSymlinks links per lookup.
class ContainerTree {
 public:
  // `mounts`: the bundle's "mounts", in order (a later one covers an
  // earlier one's subtree).
  ContainerTree(std::string rootfs, const json& mounts) : rootfs_(std::move(rootfs)) {
    for (const json& m : mounts) {
      const std::string source = m.value("type", "") == "bind" ? m.value("source", "") : "";
      mounts_.push_back({fs::path(m.value("destination", "/")).lexically_normal().string(),
                         source});
    }
  }

  // What `path` names in the container (relative paths start at `cwd`),
  // with symlinks followed; NotFound saying why there is nothing.
  absl::StatusOr<struct stat> Stat(const std::string& path, const std::string& cwd = "/") const {
    std::vector<std::string> done;  // resolved components, none a symlink
    std::deque<std::string> todo;
    auto prepend = [&todo](const std::string& p) {
      std::vector<std::string> parts = absl::StrSplit(p, '/', absl::SkipEmpty());
      todo.insert(todo.begin(), parts.begin(), parts.end());
    };
    prepend(path);
    if (path.empty() || path[0] != '/') prepend(cwd);
    int links = 0;
    struct stat st;
    while (!todo.empty()) {
      std::string part = std::move(todo.front());
      todo.pop_front();
      if (part == ".") continue;
      if (part == "..") {
        if (!done.empty()) done.pop_back();
        continue;
      }
      done.push_back(std::move(part));
      if (int err = Lstat(done, &st)) return Missing(done, "", err);
      if (S_ISLNK(st.st_mode)) {
        if (++links > kMaxSymlinks) {
          return Missing(done, absl::StrCat("more than ", kMaxSymlinks, " symlinks"), ELOOP);
        }
        absl::StatusOr<std::string> target = ReadLink(done);
        if (!target.ok()) return target.status();
        done.pop_back();
        if (absl::StartsWith(*target, "/")) done.clear();
        prepend(*target);
        continue;
      }
      if (!todo.empty() && !S_ISDIR(st.st_mode)) return Missing(done, "", ENOTDIR);
    }
    // Again: a trailing ".." leaves the walk on a directory it has not
    // stat'ed; `done` holds no symlink now.
    if (int err = Lstat(done, &st)) return Missing(done, "", err);
    return st;
  }

 private:
  // The kernel's limit on the symlinks of one lookup (MAXSYMLINKS).
  static constexpr int kMaxSymlinks = 40;

  static std::string Join(const std::vector<std::string>& parts) {
    return "/" + absl::StrJoin(parts, "/");
  }

  static absl::Status Missing(const std::vector<std::string>& parts, const std::string& why,
                              int err) {
    return absl::NotFoundError(
        absl::StrCat(Join(parts), ": ", why.empty() ? "" : why + ": ", Errno(err)));
  }

  // Where container path `parts` lies: under mounts_[mount] (-1: the
  // rootfs) at host path `host`, "" in one of the runtime's file systems;
  // `top`: it is that mount's mount point.
  struct Where {
    std::string host;
    bool top = false;
    int mount = -1;
  };
  Where Locate(const std::vector<std::string>& parts) const {
    const std::string path = Join(parts);
    for (int i = static_cast<int>(mounts_.size()) - 1; i >= 0; --i) {
      const auto& [target, source] = mounts_[i];
      if (path == target) return {source, true, i};
      if (absl::StartsWith(path, target == "/" ? "/" : target + "/")) {
        return {source.empty() ? "" : source + path.substr(target.size()), false, i};
      }
    }
    return {rootfs_ + path, parts.empty(), -1};
  }

  // lstat of container path `parts`: 0, or the errno of its failure.
  int Lstat(const std::vector<std::string>& parts, struct stat* st) const {
    const Where where = Locate(parts);
    int err = 0;
    if (where.host.empty()) {
      err = where.top ? 0 : ENOENT;  // nothing is in the runtime's file systems yet
    } else if ((where.top ? stat(where.host.c_str(), st) : lstat(where.host.c_str(), st)) != 0) {
      // The source of a bind is resolved on the host, as runc does.
      err = errno;
    } else {
      return 0;
    }
    // runc makes the directories leading to a later mount's mount point.
    const std::string prefix = Join(parts) + (parts.empty() ? "" : "/");
    for (size_t i = where.mount + 1; err == ENOENT && i < mounts_.size(); ++i) {
      if (absl::StartsWith(mounts_[i].first, prefix)) err = 0;
    }
    if (err == 0) {
      memset(st, 0, sizeof *st);
      st->st_mode = S_IFDIR | 0755;
    }
    return err;
  }

  absl::StatusOr<std::string> ReadLink(const std::vector<std::string>& parts) const {
    const std::string host = Locate(parts).host;
    char buf[PATH_MAX];
    ssize_t n = readlink(host.c_str(), buf, sizeof buf);
    if (n < 0 || n == sizeof buf) {
      const int err = n < 0 ? errno : ENAMETOOLONG;
      return Missing(parts, "cannot read the symlink", err);
    }
    return std::string(buf, n);
  }

  std::string rootfs_;
  std::vector<std::pair<std::string, std::string>> mounts_;  // (target, bind source or "")
};

absl::Status CheckInTree(const ContainerTree& tree, const ContainerSpec& spec) {
  const std::string cwd = spec.working_dir.empty() ? "/" : spec.working_dir;
  if (!spec.working_dir.empty()) {
    absl::StatusOr<struct stat> st = tree.Stat(spec.working_dir);
    if (!st.ok() || !S_ISDIR(st->st_mode)) {
      return absl::NotFoundError(absl::StrCat(
          "spec.working_dir: ", QuotedPath(spec.working_dir), " is not a directory in image ",
          spec.image,
          " (", st.ok() ? "not a directory" : st.status().message(),
          "); a mount can bring a host directory in"));
    }
  }
  const std::string& command = spec.command[0];
  auto env_path = spec.env.find("PATH");
  const std::string path = env_path != spec.env.end() ? env_path->second : kContainerPath;
  if (command.find('/') != std::string::npos) {
    absl::StatusOr<struct stat> st = tree.Stat(command, cwd);
    if (st.ok() && IsExecutable(*st)) return absl::OkStatus();
    return absl::NotFoundError(absl::StrCat(
        "command \"", command, "\" is not an executable file in image ", spec.image,
        st.ok() ? "" : absl::StrCat(" (", st.status().message(), ")")));
  }
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    if (dir[0] != '/') continue;  // runc resolves PATH before the cwd exists
    absl::StatusOr<struct stat> st = tree.Stat(absl::StrCat(dir, "/", command));
    if (st.ok() && IsExecutable(*st)) return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("command \"", command, "\" not found in image ",
                                          spec.image, " on PATH=", path));
}

// The blob a descriptor's digest ("sha256:<hex>") names in layout `dir`.
absl::StatusOr<std::string> BlobPath(const std::string& dir, const json& descriptor) {
  const std::string digest = descriptor.value("digest", "");
  std::vector<std::string> parts = absl::StrSplit(digest, absl::MaxSplits(':', 1));
  auto plain = [](const std::string& s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
    });
  };
  if (parts.size() != 2 || !plain(parts[0]) || !plain(parts[1])) {
    return absl::InvalidArgumentError(
        absl::StrCat("image ", dir, ": bad digest \"", digest, "\""));
  }
  return absl::StrCat(dir, "/blobs/", parts[0], "/", parts[1]);
}

absl::StatusOr<json> ReadJson(const std::string& path, const std::string& what) {
  DEEPNEX_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path, what));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is not a JSON object"));
  }
  return j;
}

std::string Arch() {
  struct utsname u;
  uname(&u);
  const std::string m = u.machine;
  if (m == "x86_64") return "amd64";
  if (m == "aarch64") return "arm64";
  return m;
}

// The image manifest of OCI layout `dir` for this machine's platform (an
// index.json entry may itself be an index: followed).
absl::StatusOr<json> FindManifest(const std::string& dir) {
  DEEPNEX_ASSIGN_OR_RETURN(json index, ReadJson(dir + "/index.json", "OCI image index"));
  for (int depth = 0; depth < 4; ++depth) {
    const json& manifests = index["manifests"];
    const json* chosen = nullptr;
    if (manifests.is_array()) {
      for (const json& m : manifests) {
        const json& platform = m.contains("platform") ? m["platform"] : json::object();
        if (platform.value("os", "linux") == "linux" &&
            platform.value("architecture", Arch()) == Arch()) {
          chosen = &m;
          break;
        }
      }
    }
    if (chosen == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("image ", dir, ": no manifest for linux/", Arch(), " in index.json"));
    }
    DEEPNEX_ASSIGN_OR_RETURN(std::string blob, BlobPath(dir, *chosen));
    DEEPNEX_ASSIGN_OR_RETURN(json next, ReadJson(blob, "OCI image manifest"));
    if (!next.contains("manifests")) {
      next["digest"] = (*chosen)["digest"];
      return next;
    }
    index = std::move(next);
  }
  return absl::InvalidArgumentError(absl::StrCat("image ", dir, ": indexes nested too deep"));
}

// Applies the whiteouts of layer tar `layer` to `rootfs` (what lower layers
// unpacked): ".wh.<name>" deletes <name>, ".wh..wh..opq" empties its
// directory. Paths resolve inside `rootfs`, so a symlink from a lower
// layer cannot point the deletion outside it.
absl::Status ApplyWhiteouts(const std::string& layer, const std::string& rootfs) {
  DEEPNEX_ASSIGN_OR_RETURN(CommandResult list, RunCommand({"/usr/bin/tar", "-tf", layer}, OwnEnv(),
                                                          std::chrono::minutes(5)));
  if (!list.ok()) return absl::InvalidArgumentError(DescribeFailure({"tar -tf", layer}, list));
  Fd root_fd(open(rootfs.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  for (absl::string_view line : absl::StrSplit(list.out, '\n', absl::SkipEmpty())) {
    fs::path entry = fs::path(std::string(line)).lexically_normal();
    const std::string base = entry.filename().string();
    if (!absl::StartsWith(base, ".wh.")) continue;
    Fd parent = OpenInRoot(root_fd.get(), "/" + entry.parent_path().string(),
                           O_PATH | O_DIRECTORY);
    if (parent.get() < 0) continue;  // nothing below to hide
    char real[PATH_MAX];
    ssize_t n = readlink(absl::StrCat("/proc/self/fd/", parent.get()).c_str(), real,
                         sizeof real - 1);
    if (n <= 0) continue;
    const fs::path dir(std::string(real, n));
    std::error_code ec;
    if (base == ".wh..wh..opq") {
      for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
        fs::remove_all(e.path(), ec);
      }
    } else {
      fs::remove_all(dir / base.substr(4), ec);
    }
  }
  return absl::OkStatus();
}

// Unpacks OCI image layout `dir` into a rootfs under `cache` named by the
// manifest digest, once; later calls find it there.
absl::StatusOr<std::string> UnpackLayout(const std::string& dir, const std::string& cache) {
  DEEPNEX_ASSIGN_OR_RETURN(json manifest, FindManifest(dir));
  std::string key = manifest.value("digest", "");
  std::replace(key.begin(), key.end(), ':', '-');
  const std::string rootfs = absl::StrCat(cache, "/", key);
  if (fs::is_directory(rootfs)) return rootfs;
  const std::string tmp = absl::StrCat(rootfs, ".tmp-", RandomHex(4));
  DEEPNEX_RETURN_IF_ERROR(MakeDirectories(tmp));
  auto fail = [&tmp](absl::Status s) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    return s;
  };
  if (!manifest["layers"].is_array()) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("image ", dir, ": the manifest has no layers")));
  }
  for (const json& layer : manifest["layers"]) {
    absl::StatusOr<std::string> blob = BlobPath(dir, layer);
    if (!blob.ok()) return fail(blob.status());
    absl::Status s = ApplyWhiteouts(*blob, tmp);
    if (!s.ok()) return fail(s);
    // GNU tar recognizes gzip and zstd layers by their magic.
    std::vector<std::string> argv = {"/usr/bin/tar", "-xf", *blob, "-C", tmp,
                                     "--exclude=.wh.*"};
    absl::StatusOr<CommandResult> r = RunCommand(argv, OwnEnv(), std::chrono::minutes(5));
    if (!r.ok()) return fail(r.status());
    if (!r->ok()) return fail(absl::InvalidArgumentError(DescribeFailure(argv, *r)));
  }
  std::error_code ec;
  fs::rename(tmp, rootfs, ec);
  if (ec) {
    fail(absl::OkStatus()).IgnoreError();
    // Another launcher unpacked the same manifest first.
    if (fs::is_directory(rootfs)) return rootfs;
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
  }
  return rootfs;
}

// The empty root of the "host" image, with mount points and symlinks.
absl::Status MakeHostRootfs(const std::string& rootfs) {
  for (const char* dir : {"usr", "etc", "opt", "tmp", "proc", "dev", "sys"}) {
    DEEPNEX_RETURN_IF_ERROR(MakeDirectories(absl::StrCat(rootfs, "/", dir)));
  }
  for (const auto& link : kHostLinks) {
    const std::string at = absl::StrCat(rootfs, "/", link[0]);
    if (symlink(link[1], at.c_str()) != 0 && errno != EEXIST) {
      return absl::InternalError(absl::StrCat("cannot create ", at, ": ", Errno(errno)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckInImage(const Image& image, const json& mounts, const ContainerSpec& spec) {
  return CheckInTree(ContainerTree(image.rootfs, mounts), spec);
}

namespace {

constexpr char kUmoci[] = "/usr/bin/umoci";

// Runs `argv` (a tool of the commit); Internal naming it on failure.
absl::Status RunTool(const std::vector<std::string>& argv) {
  DEEPNEX_ASSIGN_OR_RETURN(CommandResult r, RunCommand(argv, OwnEnv(), std::chrono::minutes(30)));
  if (!r.ok()) return absl::InternalError(DescribeFailure(argv, r));
  return absl::OkStatus();
}

// Turns overlayfs's whiteouts in `dir` (a copy of an upper directory) into
// the OCI layer format's: a 0:0 character device <name> becomes an empty
// ".wh.<name>", an opaque directory gets a ".wh..wh..opq".
absl::Status OciWhiteouts(const std::string& dir) {
  std::error_code ec;
  std::vector<fs::path> devices, opaque;
  for (auto it = fs::recursive_directory_iterator(dir, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    struct stat st;
    if (lstat(it->path().c_str(), &st) != 0) continue;
    if (S_ISCHR(st.st_mode) && st.st_rdev == makedev(0, 0)) devices.push_back(it->path());
    char v = 0;
    if (S_ISDIR(st.st_mode) &&
        lgetxattr(it->path().c_str(), "trusted.overlay.opaque", &v, 1) == 1 && v == 'y') {
      opaque.push_back(it->path());
    }
  }
  if (ec) return absl::InternalError(absl::StrCat("cannot walk ", dir, ": ", ec.message()));
  for (const fs::path& p : devices) {
    fs::remove(p, ec);
    DEEPNEX_RETURN_IF_ERROR(
        WriteFileAtomically((p.parent_path() / (".wh." + p.filename().string())).string(), ""));
  }
  for (const fs::path& p : opaque) {
    DEEPNEX_RETURN_IF_ERROR(WriteFileAtomically((p / ".wh..wh..opq").string(), ""));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> CommitChanges(const Image& base, const std::string& upper,
                                       const std::string& scratch, const std::string& target) {
  if (base.layout.empty()) {
    return absl::FailedPreconditionError(
        "the container's image is not from an image registry: there are no layers to add its "
        "changes to");
  }
  DEEPNEX_ASSIGN_OR_RETURN(RegistryRef ref, RegistryRef::Parse(target));
  if (access(kUmoci, X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        kUmoci, " is missing (Debian's umoci package): a commit adds its layer with it"));
  }
  const std::string work = absl::StrCat(scratch, "/commit-", RandomHex(4));
  const std::string changes = work + "/changes", layer = work + "/layer.tar",
                    layout = work + "/image";
  DEEPNEX_RETURN_IF_ERROR(MakeDirectories(layout));
  absl::Status s = [&]() -> absl::Status {
    // Hard links: the files are not copied, and the upper directory, which
    // overlayfs owns while mounted, is only read.
    DEEPNEX_RETURN_IF_ERROR(RunTool({"/bin/cp", "-al", upper, changes}));
    DEEPNEX_RETURN_IF_ERROR(OciWhiteouts(changes));
    DEEPNEX_RETURN_IF_ERROR(
        RunTool({"/usr/bin/tar", "--numeric-owner", "-cf", layer, "-C", changes, "."}));
    // The base's blobs are linked, its index copied: umoci rewrites the
    // index, which the pull cache shares otherwise.
    for (const char* file : {"/index.json", "/oci-layout"}) {
      DEEPNEX_RETURN_IF_ERROR(RunTool({"/bin/cp", base.layout + file, layout + file}));
    }
    DEEPNEX_RETURN_IF_ERROR(RunTool({"/bin/cp", "-al", base.layout + "/blobs", layout + "/blobs"}));
    DEEPNEX_RETURN_IF_ERROR(RunTool({kUmoci, "raw", "add-layer", "--image",
                                     absl::StrCat(layout, ":", base.tag), "--tag", ref.tag,
                                     "--history.created_by", "deepnex commit", layer}));
    return PushLayout(layout, ref.tag, ref);
  }();
  const uint64_t size = DirectorySize(layout + "/blobs");
  std::error_code ec;
  fs::remove_all(work, ec);
  DEEPNEX_RETURN_IF_ERROR(s);
  return size;
}

absl::StatusOr<Image> ImageStore::Resolve(const std::string& spec_image) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string image = spec_image;
  std::string pulled_tag;
  if (IsRegistryImage(image)) {
    DEEPNEX_ASSIGN_OR_RETURN(image, PullLocked(spec_image));
    DEEPNEX_ASSIGN_OR_RETURN(RegistryRef ref, RegistryRef::Parse(spec_image));
    pulled_tag = ref.tag;
  }
  if (image == "host") {
    const std::string rootfs = state_dir_ + "/oci/host";
    if (!host_ready_) {
      DEEPNEX_RETURN_IF_ERROR(MakeHostRootfs(rootfs));
      DEEPNEX_ASSIGN_OR_RETURN(host_etc_, HostEtc(rootfs));
      host_ready_ = true;
    }
    return Image{rootfs, true, host_etc_};
  }
  if (image.empty() || image[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.image: \"", image,
        "\" is neither \"host\" nor an absolute path of a rootfs or OCI image layout"));
  }
  std::error_code ec;
  if (!fs::exists(image, ec)) {
    return absl::NotFoundError(absl::StrCat("image ", image, " does not exist"));
  }
  if (!fs::is_directory(image, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.image: ", image, " is not a directory"));
  }
  if (!fs::exists(image + "/oci-layout", ec)) return Image{image, false, {}};
  // A layout of the user's own (not pulled) is no base for a commit.
  const std::string layout = pulled_tag.empty() ? "" : image;
  auto cached = layouts_.find(image);
  if (cached != layouts_.end()) return Image{cached->second, false, {}, layout, pulled_tag};
  DEEPNEX_ASSIGN_OR_RETURN(std::string rootfs, UnpackLayout(image, state_dir_ + "/oci/images"));
  layouts_[image] = rootfs;
  return Image{rootfs, false, {}, layout, pulled_tag};
}

absl::StatusOr<std::string> ImageStore::PullLocked(const std::string& image) {
  DEEPNEX_ASSIGN_OR_RETURN(RegistryRef ref, RegistryRef::Parse(image));
  // The registry's digest names the cache: a tag moved to a new image pulls
  // that one, and an image pulled once is not pulled again.
  DEEPNEX_ASSIGN_OR_RETURN(std::string key, RegistryDigest(ref));
  std::replace(key.begin(), key.end(), ':', '-');
  const std::string pulled = state_dir_ + "/oci/pulled";
  const std::string layout = absl::StrCat(pulled, "/", key);
  std::error_code ec;
  if (fs::is_directory(layout, ec)) return layout;
  DEEPNEX_RETURN_IF_ERROR(MakeDirectories(pulled));
  const std::string tmp = absl::StrCat(layout, ".tmp-", RandomHex(4));
  absl::Status s = PullLayout(ref, tmp);
  if (s.ok()) {
    fs::rename(tmp, layout, ec);
    // Another launcher on this state directory pulled it first.
    if (ec && !fs::is_directory(layout)) {
      s = absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
    }
  }
  fs::remove_all(tmp, ec);
  DEEPNEX_RETURN_IF_ERROR(s);
  return layout;
}

}  // namespace deepnex::launch
