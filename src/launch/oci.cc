// The oci backend: every run is a real runc container whose bundle (the
// config.json of the OCI runtime spec) is written from the ContainerSpec.
//
// A run is `runc run --keep` in the foreground, a child of this process:
// runc's exit status is the container's (128+n when a signal killed it), and
// --keep leaves the stopped container and its cgroup in place, so that the
// OOM-kill counter, which the kernel keeps in the victim's own cgroup, can
// be read after the end; Remove then runs `runc delete`. `--pid-file` marks
// the moment the command runs: Start returns then.
#include <fcntl.h>
#include <linux/openat2.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <map>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/file_util.h"
#include "launch/backend.h"
#include "launch/cgroup.h"
#include "launch/command.h"
#include "launch/util.h"

extern char** environ;

namespace deepnex::launch {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The PATH inside a container whose spec sets none (runc spec's).
constexpr char kContainerPath[] =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
// How long runc may take to get the command running.
constexpr auto kStartTimeout = std::chrono::seconds(30);
// How long one runc call other than `run` may take.
constexpr auto kCommandTimeout = std::chrono::seconds(30);
// Where the init (OciOptions::init) is bound in: the runtime's tmpfs, so
// that no image gets a mount point written into it.
constexpr char kInitPath[] = "/dev/init";

// The host directories the "host" image shows read-only, and its symlinks
// into them (the layout of a merged-/usr Debian).
const char* const kHostDirs[] = {"/usr", "/etc", "/opt"};
const char* const kHostLinks[][2] = {
    {"bin", "usr/bin"}, {"lib", "usr/lib"}, {"lib64", "usr/lib64"}, {"sbin", "usr/sbin"}};

std::string Errno(int err) { return strerror(err); }

// RAII for a file descriptor.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    reset(o.release());
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

// Waits for child `pid` to end; its wait status.
int Reap(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// This process's environment, for the commands it runs.
std::vector<std::string> OwnEnv() {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

// runc with a fixed state root. Copyable; every call is independent.
class Runc {
 public:
  Runc(std::string binary, std::string root)
      : binary_(std::move(binary)), root_(std::move(root)) {}

  // {runc, --root, <root>, args...}.
  std::vector<std::string> Argv(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {binary_, "--root", root_};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }
  // stdout, or an error carrying runc's stderr.
  absl::StatusOr<std::string> Call(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = Argv(args);
    DEEPNEX_ASSIGN_OR_RETURN(CommandResult r, RunCommand(argv, OwnEnv(), kCommandTimeout));
    if (!r.ok()) return absl::InternalError(DescribeFailure(argv, r));
    return r.out;
  }
  const std::string& root() const { return root_; }

 private:
  std::string binary_;
  std::string root_;
};

// SIGKILL to every process of container `id` (through its cgroup when runc
// cannot, e.g. its state is gone).
void KillContainer(const Runc& runc, const std::string& id, const std::string& cgroup_path) {
  if (!runc.Call({"kill", "--all", id, "KILL"}).ok()) {
    absl::StatusOr<std::unique_ptr<Cgroup>> cg = Cgroup::Open(cgroup_path);
    if (cg.ok()) (*cg)->KillAll().IgnoreError();
  }
}

// ---------------------------------------------------------------------------
// Images.

// Where a container's files come from.
struct Image {
  std::string rootfs;  // absolute
  bool host = false;   // the "host" image: kHostDirs are bound in
};

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

// NotFound unless `spec.command[0]` is an executable file in the container,
// looked up on the spec's PATH (runc's default without one) as runc would,
// and the working directory is a directory there.
absl::Status CheckInImage(const ContainerTree& tree, const ContainerSpec& spec) {
  const std::string cwd = spec.working_dir.empty() ? "/" : spec.working_dir;
  if (!spec.working_dir.empty()) {
    absl::StatusOr<struct stat> st = tree.Stat(spec.working_dir);
    if (!st.ok() || !S_ISDIR(st->st_mode)) {
      return absl::NotFoundError(absl::StrCat(
          "spec.working_dir: \"", spec.working_dir, "\" is not a directory in image ", spec.image,
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

// ---------------------------------------------------------------------------
// The bundle.

json DeviceRule(bool allow, const char* type, int64_t major, int64_t minor) {
  json rule = {{"allow", allow}, {"access", "rwm"}};
  if (type != nullptr) rule["type"] = type;
  if (major >= 0) rule["major"] = major;
  if (minor >= 0) rule["minor"] = minor;
  return rule;
}

// The char devices every container may use (runc's own default list):
// null, zero, full, random, urandom, tty, ptmx and the pseudo-terminals.
json DefaultDeviceRules() {
  json rules = json::array({DeviceRule(false, nullptr, -1, -1)});
  const int64_t kChar[][2] = {{1, 3}, {1, 5}, {1, 7}, {1, 8}, {1, 9}, {5, 0}, {5, 2}, {136, -1}};
  for (const auto& d : kChar) rules.push_back(DeviceRule(true, "c", d[0], d[1]));
  return rules;
}

// Adds `path` as a char device node in the container and allows it.
// `major`/`minor` are the host node's where it exists.
void AddDevice(const std::string& path, int64_t major, int64_t minor, json* config) {
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode)) {
    major = major(st.st_rdev);
    minor = minor(st.st_rdev);
  }
  (*config)["linux"]["devices"].push_back({{"path", path},
                                           {"type", "c"},
                                           {"major", major},
                                           {"minor", minor},
                                           {"fileMode", 0666},
                                           {"uid", 0},
                                           {"gid", 0}});
  (*config)["linux"]["resources"]["devices"].push_back(DeviceRule(true, "c", major, minor));
}

bool IsCharDevice(const char* path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISCHR(st.st_mode);
}

json Bind(const std::string& source, const std::string& target, bool read_only) {
  json options = {"rbind", "nosuid", "nodev"};
  if (read_only) options.push_back("ro");
  return {{"destination", target}, {"type", "bind"}, {"source", source}, {"options", options}};
}

json Capabilities() {
  // runc spec's default set; everything else is dropped.
  const json caps = {"CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"};
  return {{"bounding", caps}, {"effective", caps}, {"permitted", caps}};
}

// `init` (a host path, or "" for none): bound in at kInitPath.
json Mounts(const Image& image, const ContainerSpec& spec, const std::string& init) {
  json mounts = {
      {{"destination", "/proc"}, {"type", "proc"}, {"source", "proc"}},
      {{"destination", "/dev"},
       {"type", "tmpfs"},
       {"source", "tmpfs"},
       {"options", {"nosuid", "strictatime", "mode=755", "size=65536k"}}},
      {{"destination", "/dev/pts"},
       {"type", "devpts"},
       {"source", "devpts"},
       {"options", {"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}}},
      {{"destination", "/dev/shm"},
       {"type", "tmpfs"},
       {"source", "shm"},
       {"options", {"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}}},
      {{"destination", "/dev/mqueue"},
       {"type", "mqueue"},
       {"source", "mqueue"},
       {"options", {"nosuid", "noexec", "nodev"}}},
      // No /sys/fs/cgroup: mounting it makes runc init fail on these hosts.
      {{"destination", "/sys"},
       {"type", "sysfs"},
       {"source", "sysfs"},
       {"options", {"nosuid", "noexec", "nodev", "ro"}}},
      // The root is read-only; scratch space is not.
      {{"destination", "/tmp"},
       {"type", "tmpfs"},
       {"source", "tmpfs"},
       {"options", {"nosuid", "nodev", "mode=1777"}}},
  };
  if (!init.empty()) mounts.push_back(Bind(init, kInitPath, true));
  if (image.host) {
    for (const char* dir : kHostDirs) {
      if (fs::is_directory(dir)) mounts.push_back(Bind(dir, dir, true));
    }
  }
  for (const Mount& m : spec.mounts) mounts.push_back(Bind(m.source, m.target, m.read_only));
  return mounts;
}

json MakeConfig(const Image& image, const ContainerSpec& spec, const RunContext& context,
                const std::string& cgroup_path, const std::string& init) {
  std::vector<std::string> args = spec.command;
  if (!init.empty()) {
    // Not tini's -g (signals to the command's process group): tini sets that
    // group up in the child after the fork, and a signal that comes first
    // (runc init leaves a SIGURG pending across its exec) finds no group,
    // is lost and logged into the command's output.
    args.insert(args.begin(), {kInitPath, "--"});
  }
  json env = json::array();
  for (const auto& [k, v] : spec.env) env.push_back(absl::StrCat(k, "=", v));
  if (!spec.env.count("PATH")) env.push_back(absl::StrCat("PATH=", kContainerPath));
  // Never above the current hard limit: raising it needs CAP_SYS_RESOURCE.
  struct rlimit nofile;
  getrlimit(RLIMIT_NOFILE, &nofile);
  const uint64_t soft = std::min<uint64_t>(1024, nofile.rlim_max);
  json config = {
      {"ociVersion", "1.0.2"},
      {"process",
       {{"terminal", false},
        {"user", {{"uid", 0}, {"gid", 0}}},
        {"args", args},
        {"env", env},
        {"cwd", spec.working_dir.empty() ? "/" : spec.working_dir},
        {"capabilities", Capabilities()},
        {"rlimits",
         {{{"type", "RLIMIT_NOFILE"}, {"soft", soft}, {"hard", uint64_t{nofile.rlim_max}}}}},
        {"noNewPrivileges", true}}},
      {"root", {{"path", image.rootfs}, {"readonly", true}}},
      {"hostname", spec.name},
      {"mounts", Mounts(image, spec, init)},
      {"annotations", context.labels},
  };
  json& lx = config["linux"];
  lx["cgroupsPath"] = cgroup_path;
  json namespaces = json::array();
  for (const char* ns : {"pid", "mount", "uts", "ipc"}) namespaces.push_back({{"type", ns}});
  if (spec.network_none) namespaces.push_back({{"type", "network"}});
  lx["namespaces"] = namespaces;
  lx["maskedPaths"] = {"/proc/acpi",         "/proc/asound",      "/proc/kcore",
                          "/proc/keys",         "/proc/latency_stats", "/proc/timer_list",
                          "/proc/timer_stats",  "/proc/sched_debug", "/sys/firmware",
                          "/proc/scsi"};
  lx["readonlyPaths"] = {"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                            "/proc/sysrq-trigger"};
  json& resources = lx["resources"];
  resources["devices"] = DefaultDeviceRules();
  lx["devices"] = json::array();
  if (spec.allocation && !spec.allocation->gpus.empty()) {
    // NVIDIA's character devices: major 195, minor = index; nvidiactl is
    // minor 255; nvidia-uvm's major is assigned at load time, so only a
    // node on the host tells it.
    for (const gpu::GrantedGpu& g : spec.allocation->gpus) {
      AddDevice(absl::StrCat("/dev/nvidia", g.index), 195, g.index, &config);
    }
    for (const char* shared : {"/dev/nvidiactl", "/dev/nvidia-uvm"}) {
      if (IsCharDevice(shared)) AddDevice(shared, -1, -1, &config);
    }
  }
  if (spec.memory > 0) {
    // swap == limit: no swapping past the limit.
    resources["memory"] = {{"limit", spec.memory}, {"swap", spec.memory}};
  }
  if (spec.cpus > 0) {
    const uint64_t period = 100000;
    resources["cpu"] = {{"period", period},
                        {"quota", std::max<int64_t>(1000, std::llround(spec.cpus * period))}};
  }
  if (spec.pids_limit > 0) resources["pids"] = {{"limit", spec.pids_limit}};
  return config;
}

// ---------------------------------------------------------------------------
// A run.

class OciRun : public Run {
 public:
  // `init`: the container's PID 1 is the init, with the command under it.
  OciRun(Runc runc, std::string id, std::string dir, std::string cgroup_path, bool init,
         pid_t pid, Fd pidfd)
      : runc_(std::move(runc)),
        id_(std::move(id)),
        dir_(std::move(dir)),
        cgroup_path_(std::move(cgroup_path)),
        init_(init),
        pid_(pid),
        pidfd_(std::move(pidfd)) {}

  ~OciRun() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!ended_) {
      lock.unlock();
      KillContainer(runc_, id_, cgroup_path_);
      lock.lock();
      if (!ended_) Finish();
    }
    lock.unlock();
    Remove().IgnoreError();
  }

  std::string id() const override { return id_; }
  // Readable once `runc run` has exited.
  int pidfd() const { return pidfd_.get(); }

  absl::StatusOr<std::optional<ExitStatus>> Wait(std::chrono::milliseconds timeout) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return Result();
    }
    struct pollfd p = {pidfd_.get(), POLLIN, 0};
    int n = poll(&p, 1, static_cast<int>(std::clamp<int64_t>(timeout.count(), 0, INT32_MAX)));
    if (n < 0 && errno != EINTR) return absl::InternalError("poll: " + Errno(errno));
    if (n <= 0) return std::optional<ExitStatus>();
    std::lock_guard<std::mutex> lock(mu_);
    if (!ended_) Finish();
    return Result();
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_ || killer_.joinable()) return absl::OkStatus();
    // The init passes the TERM on to the command; when that ends, the
    // kernel kills what is left in the container's PID namespace. Without
    // an init, --all: the command is PID 1 and ignores a TERM it has no
    // handler for; its children do not.
    std::vector<std::string> kill = {"kill", id_, "TERM"};
    if (!init_) kill.insert(kill.begin() + 1, "--all");
    runc_.Call(kill).IgnoreError();
    killer_ = std::thread([this, grace] {
      struct pollfd p = {pidfd_.get(), POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(grace.count())) == 0) {
        KillContainer(runc_, id_, cgroup_path_);
      }
    });
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Logs() override {
    return ReadWholeFile(dir_ + "/output.log", "log of " + id_);
  }

  absl::StatusOr<launch::Usage> Usage() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return final_usage_;
    }
    absl::StatusOr<std::unique_ptr<Cgroup>> cg = Cgroup::Open(cgroup_path_);
    if (!cg.ok()) return launch::Usage();  // runc has not made it yet
    return (*cg)->ReadUsage();
  }

  absl::Status Remove() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!ended_) {
      return absl::FailedPreconditionError(
          absl::StrCat("container ", id_, " is still running"));
    }
    if (removed_) return absl::OkStatus();
    removed_ = true;
    std::thread killer = std::move(killer_);
    lock.unlock();
    if (killer.joinable()) killer.join();
    pidfd_.reset();
    absl::StatusOr<std::string> deleted = runc_.Call({"delete", "--force", id_});
    if (!deleted.ok() && !absl::StrContains(deleted.status().message(), "does not exist")) {
      return deleted.status();
    }
    // runc delete can leave the cgroup of a stopped container in hierarchies
    // it did not create it in; whatever is left goes here.
    if (absl::StatusOr<std::unique_ptr<Cgroup>> cg = Cgroup::Open(cgroup_path_); cg.ok()) {
      (*cg)->Remove().IgnoreError();
    }
    for (const char* file : {"/config.json", "/pid"}) unlink((dir_ + file).c_str());
    return absl::OkStatus();
  }

 private:
  // REQUIRES: mu_ held, runc has exited (or been killed). Reaps it and reads
  // the verdict from the container's cgroup, which --keep left in place.
  void Finish() {
    const int status = Reap(pid_);
    ended_ = true;
    if (WIFSIGNALED(status)) {
      // runc itself died: what became of the container is unknown.
      lost_ = absl::StrCat("runc run of ", id_, " was killed by ",
                           SignalName(WTERMSIG(status)));
      KillContainer(runc_, id_, cgroup_path_);
      return;
    }
    const int code = WEXITSTATUS(status);
    // runc reports a container killed by signal n as exit 128+n.
    if (code > 128 && code < 128 + NSIG) {
      exit_ = ExitStatus{ExitReason::kSignaled, 0, code - 128};
    } else {
      exit_ = ExitStatus{ExitReason::kExited, code, 0};
    }
    absl::StatusOr<std::unique_ptr<Cgroup>> cg = Cgroup::Open(cgroup_path_);
    if (!cg.ok()) return;
    final_usage_ = (*cg)->ReadUsage();
    final_usage_.memory = 0;
    final_usage_.pids = 0;
    if (!exit_.ok() && (*cg)->OomKilled()) {
      exit_ = ExitStatus{ExitReason::kOomKilled, 0, exit_.signal ? exit_.signal : SIGKILL};
    }
  }

  absl::StatusOr<std::optional<ExitStatus>> Result() const {
    if (!lost_.empty()) return absl::UnavailableError(lost_);
    return std::optional<ExitStatus>(exit_);
  }

  const Runc runc_;
  const std::string id_;
  const std::string dir_;
  const std::string cgroup_path_;
  const bool init_;
  const pid_t pid_;  // of `runc run`
  Fd pidfd_;

  std::mutex mu_;
  bool ended_ = false;
  bool removed_ = false;
  ExitStatus exit_;
  std::string lost_;
  launch::Usage final_usage_;
  std::thread killer_;  // Stop's SIGKILL after the grace
};

// ---------------------------------------------------------------------------
// The backend.

class OciBackend : public Backend {
 public:
  // `init`: the init's host path, "" for none.
  OciBackend(const LauncherOptions& options, std::string runc_binary, std::string init)
      : runc_(std::move(runc_binary),
              options.oci.root.empty() ? options.state_dir + "/runc" : options.oci.root),
        state_dir_(options.state_dir),
        cgroup_parent_(CgroupParent(options)),
        init_(std::move(init)) {}

  absl::Status Check(const ContainerSpec& spec) override {
    DEEPNEX_ASSIGN_OR_RETURN(Image image, ResolveImage(spec.image));
    return CheckInImage(ContainerTree(image.rootfs, Mounts(image, spec, init_)), spec);
  }

  absl::StatusOr<std::unique_ptr<Run>> Start(const ContainerSpec& spec,
                                             const RunContext& context) override {
    DEEPNEX_ASSIGN_OR_RETURN(Image image, ResolveImage(spec.image));
    const std::string cgroup_path = absl::StrCat(cgroup_parent_, "/", context.run_name);
    const std::string pid_file = context.dir + "/pid";
    unlink(pid_file.c_str());
    DEEPNEX_RETURN_IF_ERROR(WriteFileAtomically(
        context.dir + "/config.json", MakeConfig(image, spec, context, cgroup_path, init_).dump(1)));

    // runc writes the pid file (to a temporary name, then renamed) once the
    // command runs: watch for it rather than poll.
    Fd inotify(inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
    if (inotify.get() < 0 ||
        inotify_add_watch(inotify.get(), context.dir.c_str(), IN_MOVED_TO | IN_CREATE) < 0) {
      return absl::InternalError(absl::StrCat("inotify on ", context.dir, ": ", Errno(errno)));
    }
    const std::string log = context.dir + "/output.log";
    Fd log_fd(open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (log_fd.get() < 0) {
      return absl::InternalError(absl::StrCat("cannot open ", log, ": ", Errno(errno)));
    }
    const std::vector<std::string> argv = runc_.Argv(
        {"run", "--keep", "--bundle", context.dir, "--pid-file", pid_file, context.run_name});
    DEEPNEX_ASSIGN_OR_RETURN(pid_t pid, Spawn(argv, environ, log_fd.get(), log_fd.get()));
    Fd pidfd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
    if (pidfd.get() < 0) {
      const int err = errno;
      kill(pid, SIGKILL);
      Reap(pid);
      return absl::InternalError("pidfd_open: " + Errno(err));
    }
    auto run = std::make_unique<OciRun>(runc_, context.run_name, context.dir, cgroup_path,
                                        !init_.empty(), pid, std::move(pidfd));

    const auto deadline = std::chrono::steady_clock::now() + kStartTimeout;
    while (access(pid_file.c_str(), F_OK) != 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        return absl::DeadlineExceededError(absl::StrCat(
            "container ", context.run_name, " did not start within ",
            std::chrono::duration_cast<std::chrono::seconds>(kStartTimeout).count(), " s"));
      }
      DEEPNEX_ASSIGN_OR_RETURN(std::optional<ExitStatus> ended, run->Wait(std::chrono::milliseconds(0)));
      if (ended) {
        if (access(pid_file.c_str(), F_OK) == 0) break;  // ran, and already ended
        absl::StatusOr<std::string> output = run->Logs();
        return absl::FailedPreconditionError(absl::StrCat(
            "runc could not start container ", context.run_name, ": ",
            absl::StripAsciiWhitespace(output.ok() ? *output : output.status().message())));
      }
      struct pollfd p[2] = {{inotify.get(), POLLIN, 0}, {run->pidfd(), POLLIN, 0}};
      poll(p, 2, static_cast<int>(left.count()));
      char events[4096];
      while (read(inotify.get(), events, sizeof events) > 0) {
      }
    }
    return run;
  }

  absl::StatusOr<int> Cleanup(const std::string& launcher_id) override {
    int swept = 0;
    DEEPNEX_ASSIGN_OR_RETURN(std::string listed, runc_.Call({"list", "--format", "json"}));
    json containers = json::parse(listed, nullptr, false);
    std::set<std::string> ids;
    if (containers.is_array()) {
      for (const json& c : containers) {
        const json& labels = c.contains("annotations") ? c["annotations"] : json::object();
        if (!labels.is_object() || labels.value("deepnex.launcher", "") != launcher_id) continue;
        const std::string id = c.value("id", "");
        KillContainer(runc_, id, absl::StrCat(cgroup_parent_, "/", id));
        runc_.Call({"delete", "--force", id}).IgnoreError();
        std::error_code ec;
        const std::string bundle = c.value("bundle", "");
        if (!bundle.empty()) fs::remove_all(bundle, ec);
        ids.insert(id);
        ++swept;
      }
    }
    // Cgroups of containers whose runc state is gone (another --root, a
    // state dir removed): found by the run name's launcher-id prefix.
    for (const std::string& child : Cgroup::Children(cgroup_parent_)) {
      if (!absl::StartsWith(child, launcher_id + "-") || ids.count(child)) continue;
      absl::StatusOr<std::unique_ptr<Cgroup>> cg =
          Cgroup::Open(absl::StrCat(cgroup_parent_, "/", child));
      if (cg.ok() && (*cg)->Remove().ok()) ++swept;
    }
    return swept;
  }

 private:
  // The rootfs of `image`: NotFound naming it when it does not exist.
  absl::StatusOr<Image> ResolveImage(const std::string& image) {
    std::lock_guard<std::mutex> lock(mu_);
    if (image == "host") {
      const std::string rootfs = state_dir_ + "/oci/host";
      if (!host_ready_) {
        DEEPNEX_RETURN_IF_ERROR(MakeHostRootfs(rootfs));
        host_ready_ = true;
      }
      return Image{rootfs, true};
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
    if (!fs::exists(image + "/oci-layout", ec)) return Image{image, false};
    auto cached = layouts_.find(image);
    if (cached != layouts_.end()) return Image{cached->second, false};
    DEEPNEX_ASSIGN_OR_RETURN(std::string rootfs, UnpackLayout(image, state_dir_ + "/oci/images"));
    layouts_[image] = rootfs;
    return Image{rootfs, false};
  }

  const Runc runc_;
  const std::string state_dir_;
  const std::string cgroup_parent_;
  const std::string init_;

  std::mutex mu_;  // guards the image state below
  bool host_ready_ = false;
  std::map<std::string, std::string> layouts_;  // layout dir -> unpacked rootfs
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeOciBackend(const LauncherOptions& options) {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(
        "the oci backend needs root: rootless runc is not supported");
  }
  absl::StatusOr<std::string> runc = FindOnPath(options.oci.runc, PathOf({}));
  if (!runc.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("runc is not usable: ", runc.status().message()));
  }
  absl::StatusOr<CommandResult> version = RunCommand({*runc, "--version"}, OwnEnv(), kCommandTimeout);
  if (!version.ok() || !version->ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runc is not usable: ",
        version.ok() ? DescribeFailure({*runc, "--version"}, *version) : version.status().message()));
  }
  absl::Status cgroups = Cgroup::Usable();
  if (!cgroups.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the oci backend needs writable cgroups: ", cgroups.message()));
  }
  if (options.state_dir.empty()) {
    return absl::InvalidArgumentError("the oci backend needs options.state_dir");
  }
  std::string init;
  if (options.oci.init != "none") {
    absl::StatusOr<std::string> found = FindOnPath(options.oci.init, PathOf({}));
    if (!found.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "oci.init: \"", options.oci.init, "\" is not usable (", found.status().message(),
          "); install tini (Debian: apt-get install tini) or set it to \"none\""));
    }
    init = fs::absolute(*found).string();  // a bind's source
  }
  return std::make_unique<OciBackend>(options, *runc, init);
}

}  // namespace deepnex::launch
