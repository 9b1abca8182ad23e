#include "launch/util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/match.h"
#include "absl/strings/ascii.h"
#include "deepnex/gpu/discovery.h"

extern char** environ;

namespace deepnex::launch {
namespace {

constexpr char kDefaultPath[] = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
         access(path.c_str(), X_OK) == 0;
}

std::vector<pid_t> AllPids() {
  std::vector<pid_t> pids;
  DIR* dir = opendir("/proc");
  if (dir == nullptr) return pids;
  while (struct dirent* e = readdir(dir)) {
    int pid;
    if (absl::SimpleAtoi(e->d_name, &pid) && pid > 0) pids.push_back(pid);
  }
  closedir(dir);
  return pids;
}

// The fields of /proc/<pid>/stat after the command (which may hold spaces),
// starting with field 3 (state) at index 0.
std::vector<std::string> StatFields(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return {};
  size_t close = line.rfind(')');
  if (close == std::string::npos) return {};
  return absl::StrSplit(line.substr(close + 1), ' ', absl::SkipEmpty());
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

std::map<std::string, std::string> HostEnv(const ContainerSpec& spec) {
  std::map<std::string, std::string> env = spec.env;
  env.emplace("PATH", PathOf(spec.env));
  if (spec.run_as) {
    env.emplace("HOME", spec.run_as->home.empty() ? "/" : spec.run_as->home);
    if (!spec.run_as->user.empty()) env.emplace("USER", spec.run_as->user);
  }
  return env;
}

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

std::string RandomHex(int n) {
  std::random_device rd;
  std::string out;
  static const char kDigits[] = "0123456789abcdef";
  for (int i = 0; i < n; ++i) {
    unsigned byte = rd() & 0xff;
    out += kDigits[byte >> 4];
    out += kDigits[byte & 0xf];
  }
  return out;
}

std::vector<pid_t> ProcessesWithEnv(const std::string& key, const std::string& value) {
  const std::string needle = key + "=" + value;
  std::vector<pid_t> found;
  for (pid_t pid : AllPids()) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
    std::string entry;
    while (std::getline(in, entry, '\0')) {
      if (entry == needle) {
        found.push_back(pid);
        break;
      }
    }
  }
  return found;
}

launch::Usage ProcUsage(const std::vector<pid_t>& pids) {
  launch::Usage u;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (pid_t pid : pids) {
    std::vector<std::string> f = StatFields(pid);
    if (f.empty() || f[0] == "Z") continue;
    // Fields 14-17 (utime, stime, cutime, cstime) and 24 (rss, pages).
    if (f.size() < 22) continue;
    uint64_t t[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; ++i) (void)absl::SimpleAtoi(f[11 + i], &t[i]);
    uint64_t rss = 0;
    (void)absl::SimpleAtoi(f[21], &rss);
    u.cpu_seconds += static_cast<double>(t[0] + t[1] + t[2] + t[3]) / ticks;
    u.memory += rss * page;
    ++u.pids;
    std::ifstream status("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(status, line)) {
      uint64_t kib;
      if (absl::StartsWith(line, "VmHWM:") &&
          absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::StripSuffix(
                               absl::string_view(line).substr(6), "kB")),
                           &kib)) {
        u.memory_peak = std::max(u.memory_peak, kib << 10);
      }
    }
  }
  u.memory_peak = std::max(u.memory_peak, u.memory);
  u.gpu_memory = GpuMemoryOf(pids);
  return u;
}

std::map<int, uint64_t> GpuMemoryOf(const std::vector<pid_t>& pids) {
  std::map<int, uint64_t> out;
  if (pids.empty()) return out;
  const std::set<int64_t> mine(pids.begin(), pids.end());
  for (const auto& [gpu, by_pid] : gpu::GpuMemoryByProcess()) {
    for (const auto& [pid, bytes] : by_pid) {
      if (mine.count(pid)) out[gpu] += bytes;
    }
  }
  return out;
}

bool ProcessAlive(pid_t pid) {
  std::vector<std::string> f = StatFields(pid);
  return !f.empty() && f[0] != "Z" && f[0] != "X";
}

std::optional<uint64_t> ProcessStartTime(pid_t pid) {
  std::vector<std::string> f = StatFields(pid);
  uint64_t ticks = 0;
  if (f.size() <= 19 || !absl::SimpleAtoi(f[19], &ticks)) return std::nullopt;  // field 22
  return ticks;
}

std::vector<pid_t> ProcessGroupMembers(pid_t pgid) {
  std::vector<pid_t> members;
  for (pid_t pid : AllPids()) {
    std::vector<std::string> f = StatFields(pid);
    int group;
    // Field 5 (pgrp).
    if (f.size() > 2 && f[0] != "Z" && absl::SimpleAtoi(f[2], &group) && group == pgid) {
      members.push_back(pid);
    }
  }
  return members;
}

void ExportUsage(Launcher& launcher, MetricsRegistry& registry) {
  for (const std::shared_ptr<Handle>& h : launcher.List()) {
    absl::StatusOr<launch::Usage> u = h->Usage();
    if (!u.ok()) continue;
    const Labels labels = {{"container", h->spec().name}, {"backend", launcher.backend()}};
    registry.GetGauge("deepnex_container_cpu_seconds", "CPU time the container used.", labels)
        ->Set(u->cpu_seconds);
    registry.GetGauge("deepnex_container_memory_bytes", "Memory the container uses now.", labels)
        ->Set(static_cast<double>(u->memory));
    registry
        .GetGauge("deepnex_container_memory_peak_bytes", "The most memory the container used.",
                  labels)
        ->Set(static_cast<double>(u->memory_peak));
    registry.GetGauge("deepnex_container_pids", "Processes in the container.", labels)
        ->Set(static_cast<double>(u->pids));
  }
}

}  // namespace deepnex::launch
