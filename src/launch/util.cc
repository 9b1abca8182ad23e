#include "launch/util.h"

#include <fcntl.h>
#include <pwd.h>
#include <linux/openat2.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/text.h"

extern char** environ;

namespace deepnex::launch {
namespace {

constexpr char kDefaultPath[] = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
         access(path.c_str(), X_OK) == 0;
}

}  // namespace

absl::StatusOr<std::string> FindOnPath(const std::string& command,
                                       const std::string& path_env) {
  if (command.find('/') != std::string::npos) {
    if (IsExecutableFile(command)) return command;
    return absl::NotFoundError(
        absl::StrCat("command \"", command, "\" not found or not executable"));
  }
  if (!command.empty()) {
    for (absl::string_view dir : absl::StrSplit(path_env, ':')) {
      std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/", command);
      if (IsExecutableFile(candidate)) return candidate;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("command \"", command, "\" not found on PATH=", path_env));
}

bool IsPasswdName(const std::string& name) {
  return !name.empty() && name.size() <= 32 && (name[0] == '_' || absl::ascii_islower(name[0])) &&
         std::all_of(name.begin(), name.end(), [](char c) {
           return absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '_' || c == '-';
         });
}

std::vector<std::string> OwnEnv() {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

std::string PathOf(const std::map<std::string, std::string>& env) {
  auto it = env.find("PATH");
  if (it != env.end()) return it->second;
  const char* own = getenv("PATH");
  return own != nullptr && *own != '\0' ? own : kDefaultPath;
}

std::string HomeOf(const RunAs& run_as) {
  if (!run_as.home.empty()) return run_as.home;
  passwd entry{};
  passwd* found = nullptr;
  std::vector<char> buffer(16384);
  if (getpwuid_r(run_as.uid, &entry, buffer.data(), buffer.size(), &found) == 0 &&
      found != nullptr && found->pw_dir != nullptr && found->pw_dir[0] == '/') {
    std::error_code ignored;
    if (std::filesystem::is_directory(found->pw_dir, ignored)) return found->pw_dir;
  }
  return "/";
}

std::map<std::string, std::string> HostEnv(const ContainerSpec& spec) {
  std::map<std::string, std::string> env = spec.env;
  env.emplace("PATH", PathOf(spec.env));
  if (spec.run_as) {
    env.emplace("HOME", HomeOf(*spec.run_as));
    if (!spec.run_as->user.empty()) env.emplace("USER", spec.run_as->user);
  }
  return env;
}

namespace {

// A character that continues a path or a name: where one is beside a match,
// the match is part of something longer (the user's own "/img/a/x" holds the
// image "/img/a"; every path holds an image at "/") and stays.
bool Continues(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '/' || c == '.' ||
         c == '_' || c == '-' || c == '~' || c == '+' || c == '@' || c == '%';
}

}  // namespace

absl::Status AsNamed(const absl::Status& s,
                     const std::vector<std::pair<std::string, std::string>>& names) {
  if (s.ok()) return s;
  std::string text(s.message());
  for (const auto& [given, named] : names) {
    if (given.empty() || given == named) continue;
    std::string out;
    size_t from = 0;
    for (size_t at = text.find(given); at != std::string::npos; at = text.find(given, at + 1)) {
      const size_t end = at + given.size();
      const bool whole = (!Continues(given.front()) || at == 0 || !Continues(text[at - 1])) &&
                         (!Continues(given.back()) || end == text.size() ||
                          !Continues(text[end]));
      if (!whole || at < from) continue;
      absl::StrAppend(&out, absl::string_view(text).substr(from, at - from), named);
      from = end;
    }
    text = absl::StrCat(out, absl::string_view(text).substr(from));
  }
  return absl::Status(s.code(), text);
}

std::string HostWorkingDir(const ContainerSpec& spec) {
  if (!spec.working_dir.empty()) return spec.working_dir;
  if (spec.run_as) return HomeOf(*spec.run_as);
  return "";
}

RunAs ContainerRunAs(const ContainerSpec& spec) {
  if (spec.run_as) return *spec.run_as;
  RunAs own;
  own.uid = geteuid();
  own.gid = getegid();
  return own;
}

std::string ContainerHome(const ContainerSpec& spec, uint32_t uid) {
  if (spec.run_as && !spec.run_as->home.empty()) return spec.run_as->home;
  return uid == 0 ? "/root" : "/";
}

std::vector<std::string> ContainerCapabilities(uint32_t uid) {
  if (uid != 0) return {};
  return {"AUDIT_WRITE", "KILL", "NET_BIND_SERVICE"};
}

int64_t PidsLimitOf(const ContainerSpec& spec) {
  return spec.pids_limit > 0 ? spec.pids_limit : kDefaultPidsLimit;
}

StagedMounts::~StagedMounts() {
  for (const std::string& p : paths) {
    umount2(p.c_str(), MNT_DETACH);
    std::error_code ignored;
    std::filesystem::remove(p, ignored);
  }
}

absl::StatusOr<ContainerSpec> PinMountSources(const ContainerSpec& spec, const std::string& dir,
                                              StagedMounts* staged) {
  ContainerSpec pinned = spec;
  for (size_t i = 0; i < pinned.mounts.size(); ++i) {
    Mount& m = pinned.mounts[i];
    const std::string field = absl::StrCat("spec.mounts[", i, "].source: ", QuotedPath(m.source));
    open_how how{};
    how.flags = O_PATH | O_CLOEXEC;
    how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    Fd fd(static_cast<int>(syscall(SYS_openat2, AT_FDCWD, m.source.c_str(), &how, sizeof how)));
    struct stat st;
    if (fd.get() < 0 || fstat(fd.get(), &st) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, " changed since it was checked (", strerror(errno), ")"));
    }
    const std::string path = absl::StrCat(dir, "/mount-", i);
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
    const bool made =
        S_ISDIR(st.st_mode)
            ? mkdir(path.c_str(), 0700) == 0
            : Fd(open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600)).get() >= 0;
    if (!made) {
      return absl::InternalError(absl::StrCat("cannot make ", path, ": ", strerror(errno)));
    }
    staged->paths.push_back(path);
    // Private: nothing staged here propagates to other namespaces.
    const std::string via = absl::StrCat("/proc/self/fd/", fd.get());
    if (mount(via.c_str(), path.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0 ||
        mount(nullptr, path.c_str(), nullptr, MS_PRIVATE | MS_REC, nullptr) != 0) {
      return absl::InternalError(
          absl::StrCat(field, ": cannot bind it at ", path, ": ", strerror(errno)));
    }
    m.source = path;
  }
  return pinned;
}

mode_t StateDirMode(const std::string& backend) { return backend == "slurm" ? 0711 : 0700; }

std::string CgroupParent(const LauncherOptions& options) {
  return options.cgroup_parent.empty() ? "deepnex" : options.cgroup_parent;
}

std::string RunName(const std::string& launcher_id, const std::string& name, int attempt) {
  return absl::StrCat(launcher_id, "-", name, "-", attempt);
}

ExitStatus ExitStatusFromWait(int wait_status) {
  ExitStatus e;
  if (WIFSIGNALED(wait_status)) {
    e.reason = ExitReason::kSignaled;
    e.signal = WTERMSIG(wait_status);
  } else {
    e.reason = ExitReason::kExited;
    e.code = WEXITSTATUS(wait_status);
  }
  return e;
}

std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np(signal);
  if (abbrev == nullptr) return absl::StrCat("signal ", signal);
  return absl::StrCat("SIG", abbrev);
}

void ExportContainerUsage(MetricsRegistry& registry, const std::string& node,
                          const std::string& user, const std::string& container,
                          const Usage& usage) {
  const Labels labels{{"node", node}, {"user", user}, {"container", container}};
  registry
      .GetCounterReading("deepnex_container_cpu_seconds_total",
                         "CPU seconds a container has used.", labels)
      ->Set(usage.cpu_seconds);
  registry.GetGauge("deepnex_container_memory_bytes", "Memory a container uses now.", labels)
      ->Set(static_cast<double>(usage.memory));
}

bool FollowedLog::Take(uint64_t offset, const LogChunk& chunk) {
  const uint64_t from = chunk.next_offset - chunk.data.size();
  if (from > offset &&
      !sink_(absl::StrCat(line_start_ ? "" : "\n", "deepnex: ", from - offset,
                          " bytes of this container's output were dropped before they were read "
                          "(its log keeps the newest)\n"))) {
    return false;
  }
  if (chunk.data.empty()) return true;
  line_start_ = chunk.data.back() == '\n';
  return sink_(chunk.data);
}

}  // namespace deepnex::launch
