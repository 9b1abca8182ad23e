#include "launch/procfs.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "deepnex/gpu/discovery.h"

namespace deepnex::launch {
namespace {

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

std::optional<std::string> EnvOf(pid_t pid, const std::string& key) {
  const std::string prefix = key + "=";
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string entry;
  while (std::getline(in, entry, '\0')) {
    if (absl::StartsWith(entry, prefix)) return entry.substr(prefix.size());
  }
  return std::nullopt;
}

std::vector<pid_t> ProcessesWithEnv(const std::string& key, const std::string& value) {
  std::vector<pid_t> found;
  for (pid_t pid : AllPids()) {
    if (EnvOf(pid, key) == value) found.push_back(pid);
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

std::optional<pid_t> ParentOf(pid_t pid) {
  std::vector<std::string> f = StatFields(pid);
  pid_t parent = 0;
  if (f.size() <= 1 || !absl::SimpleAtoi(f[1], &parent)) return std::nullopt;  // field 4
  return parent;
}

std::vector<std::string> ArgumentsOf(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string arg;
  while (std::getline(in, arg, '\0')) args.push_back(arg);
  return args;
}

}  // namespace deepnex::launch
