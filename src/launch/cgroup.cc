#include "launch/cgroup.h"
#include "launch/gpu_devices.h"
#include "launch/procfs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace deepnex::launch {
namespace {

// The controllers a container's cgroup joins on v1, each its own hierarchy
// (some may be co-mounted and share a directory). freezer is optional: it
// only makes KillAll race-free against fork; devices only matters with
// gpu_minors.
const char* const kV1Controllers[] = {"cpu", "cpuacct", "memory", "pids", "freezer", "devices"};
const char* const kRequired[] = {"cpu", "memory", "pids"};

// Where this process's cgroups are: per controller, the absolute directory
// of the cgroup this process is in (v1), or the unified one (v2).
struct Layout {
  bool v2 = false;
  std::map<std::string, std::string> base;  // v1: controller -> directory
  std::string unified;                      // v2: the directory
  std::string error;                        // why neither was found
};

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::optional<uint64_t> ReadUint(const std::string& path) {
  std::optional<std::string> text = ReadFile(path);
  uint64_t v;
  if (!text || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v)) return std::nullopt;
  return v;
}

// The value of `key` in a "key value" per line file (memory.events, cpu.stat,
// memory.oom_control).
std::optional<uint64_t> ReadKeyed(const std::string& path, const std::string& key) {
  std::optional<std::string> text = ReadFile(path);
  if (!text) return std::nullopt;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    std::vector<absl::string_view> kv = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t v;
    if (kv.size() == 2 && kv[0] == key && absl::SimpleAtoi(kv[1], &v)) return v;
  }
  return std::nullopt;
}

// Each of `values` with a write() of its own, on one open of `path`: a
// cgroup file takes one value (one devices rule) per write, and an open per
// rule made a container start pay for 254 of them.
absl::Status WriteEach(const std::string& path, const std::vector<std::string>& values) {
  int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open ", path, ": ", strerror(errno)));
  }
  for (const std::string& value : values) {
    ssize_t n = write(fd, value.data(), value.size());
    if (n != static_cast<ssize_t>(value.size())) {
      int err = errno;
      close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat("cannot write \"", value, "\" to ", path, ": ", strerror(err)));
    }
  }
  close(fd);
  return absl::OkStatus();
}

absl::Status WriteFile(const std::string& path, const std::string& value) {
  return WriteEach(path, {value});
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

absl::Status MakeDir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0755) == 0 || errno == EEXIST) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("cannot create cgroup ", dir, ": ", strerror(errno)));
}

// /proc/self/mountinfo: "<id> <parent> <dev> <root> <mountpoint> <opts>...
// - <fstype> <source> <superopts>".
struct CgroupMount {
  std::string root, mountpoint, fstype;
  std::set<std::string> options;
};

std::vector<CgroupMount> CgroupMounts() {
  std::vector<CgroupMount> mounts;
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || f.end() - dash < 4) continue;
    CgroupMount m{f[3], f[4], *(dash + 1), {}};
    if (m.fstype != "cgroup" && m.fstype != "cgroup2") continue;
    for (absl::string_view o : absl::StrSplit(*(dash + 3), ',')) m.options.emplace(o);
    mounts.push_back(std::move(m));
  }
  return mounts;
}

// `path` (from /proc/self/cgroup) as a directory under mount `m`.
std::string DirUnder(const CgroupMount& m, const std::string& path) {
  absl::string_view rel = path;
  if (m.root != "/" && absl::StartsWith(rel, m.root)) rel.remove_prefix(m.root.size());
  std::string dir = m.mountpoint;
  if (!rel.empty() && rel != "/") absl::StrAppend(&dir, rel);
  return dir;
}

Layout ReadLayout() {
  Layout layout;
  std::vector<CgroupMount> mounts = CgroupMounts();
  std::ifstream in("/proc/self/cgroup");
  std::string line, unified_path;
  bool have_unified = false;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[1].empty()) {
      have_unified = true;
      unified_path = f[2];
      continue;
    }
    std::vector<std::string> names = absl::StrSplit(f[1], ',');
    for (const CgroupMount& m : mounts) {
      if (m.fstype != "cgroup" || !m.options.count(names[0])) continue;
      for (const std::string& c : names) layout.base[c] = DirUnder(m, f[2]);
      break;
    }
  }
  if (layout.base.count("memory")) return layout;
  layout.base.clear();
  if (have_unified) {
    for (const CgroupMount& m : mounts) {
      if (m.fstype != "cgroup2") continue;
      layout.v2 = true;
      layout.unified = DirUnder(m, unified_path);
      return layout;
    }
  }
  layout.error = "no cgroup v1 memory hierarchy and no cgroup2 mount in /proc/self/mountinfo";
  return layout;
}

const Layout& GetLayout() {
  static const Layout* layout = new Layout(ReadLayout());
  return *layout;
}

// The directories of cgroup `path`: one per v1 hierarchy (co-mounted
// controllers share one), or the unified one.
std::vector<std::string> Dirs(const std::string& path) {
  const Layout& l = GetLayout();
  if (l.v2) return {absl::StrCat(l.unified, "/", path)};
  std::vector<std::string> dirs;
  for (const char* c : kV1Controllers) {
    auto it = l.base.find(c);
    if (it == l.base.end()) continue;
    std::string dir = absl::StrCat(it->second, "/", path);
    if (std::find(dirs.begin(), dirs.end(), dir) == dirs.end()) dirs.push_back(dir);
  }
  return dirs;
}

// The directory of `path` for v1 `controller` (or the unified one); empty
// when the controller is not mounted.
std::string DirOf(const std::string& path, const std::string& controller) {
  const Layout& l = GetLayout();
  if (l.v2) return absl::StrCat(l.unified, "/", path);
  auto it = l.base.find(controller);
  return it == l.base.end() ? "" : absl::StrCat(it->second, "/", path);
}

std::vector<pid_t> ReadPids(const std::string& file) {
  std::vector<pid_t> pids;
  std::optional<std::string> text = ReadFile(file);
  if (!text) return pids;
  for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
    int pid;
    if (absl::SimpleAtoi(line, &pid)) pids.push_back(pid);
  }
  return pids;
}

// v2: each ancestor below this process's cgroup must delegate the
// controllers to its children.
absl::Status EnableV2Controllers(const std::string& path) {
  const Layout& l = GetLayout();
  std::string dir = l.unified;
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    DEEPNEX_RETURN_IF_ERROR(WriteFile(dir + "/cgroup.subtree_control", "+cpu +memory +pids"));
    absl::StrAppend(&dir, "/", part);
    DEEPNEX_RETURN_IF_ERROR(MakeDir(dir));
  }
  return absl::OkStatus();
}

absl::Status ApplyLimits(const std::string& path, const CgroupLimits& limits) {
  const bool v2 = GetLayout().v2;
  if (limits.cpus > 0) {
    const int64_t period = 100000;
    const int64_t quota = std::max<int64_t>(1000, std::llround(limits.cpus * period));
    const std::string cpu = DirOf(path, "cpu");
    if (v2) {
      DEEPNEX_RETURN_IF_ERROR(WriteFile(cpu + "/cpu.max", absl::StrCat(quota, " ", period)));
    } else {
      DEEPNEX_RETURN_IF_ERROR(WriteFile(cpu + "/cpu.cfs_period_us", std::to_string(period)));
      DEEPNEX_RETURN_IF_ERROR(WriteFile(cpu + "/cpu.cfs_quota_us", std::to_string(quota)));
    }
  }
  if (limits.memory > 0) {
    const std::string mem = DirOf(path, "memory");
    const std::string bytes = std::to_string(limits.memory);
    if (v2) {
      DEEPNEX_RETURN_IF_ERROR(WriteFile(mem + "/memory.max", bytes));
      if (Exists(mem + "/memory.swap.max")) {
        DEEPNEX_RETURN_IF_ERROR(WriteFile(mem + "/memory.swap.max", "0"));
      }
    } else {
      DEEPNEX_RETURN_IF_ERROR(WriteFile(mem + "/memory.limit_in_bytes", bytes));
      // memory+swap: without it the container could page out past its limit.
      if (Exists(mem + "/memory.memsw.limit_in_bytes")) {
        DEEPNEX_RETURN_IF_ERROR(WriteFile(mem + "/memory.memsw.limit_in_bytes", bytes));
      }
    }
  }
  if (limits.gpu_minors) {
    if (v2) {
      DEEPNEX_RETURN_IF_ERROR(AttachGpuDeviceProgram(DirOf(path, ""), *limits.gpu_minors));
    } else {
      const std::string dev = DirOf(path, "devices");
      if (dev.empty()) {
        return absl::FailedPreconditionError(
            "restricting GPU device nodes needs the cgroup v1 devices controller, which is not "
            "mounted");
      }
      DEEPNEX_RETURN_IF_ERROR(WriteEach(dev + "/devices.deny", GpuDenyRules(*limits.gpu_minors)));
    }
  }
  if (limits.pids > 0) {
    DEEPNEX_RETURN_IF_ERROR(
        WriteFile(DirOf(path, "pids") + "/pids.max", std::to_string(limits.pids)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Cgroup::Usable() {
  const Layout& l = GetLayout();
  if (!l.error.empty()) return absl::FailedPreconditionError(l.error);
  if (l.v2) {
    std::optional<std::string> have = ReadFile(l.unified + "/cgroup.controllers");
    std::set<std::string> controllers;
    if (have) {
      for (absl::string_view c : absl::StrSplit(*have, absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
        controllers.emplace(c);
      }
    }
    for (const char* c : kRequired) {
      if (!controllers.count(c)) {
        return absl::FailedPreconditionError(
            absl::StrCat("cgroup v2 controller ", c, " is not available in ", l.unified));
      }
    }
    if (access(l.unified.c_str(), W_OK) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cgroup ", l.unified, " is not writable: ", strerror(errno)));
    }
    // v2 lets a cgroup with processes (ours, unless it is the root) hand
    // controllers to children only if that was set up before (delegation).
    std::optional<std::string> delegated = ReadFile(l.unified + "/cgroup.subtree_control");
    std::set<std::string> given;
    if (delegated) {
      for (absl::string_view c : absl::StrSplit(*delegated, absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
        given.emplace(c);
      }
    }
    const bool root = !Exists(l.unified + "/cgroup.type");
    for (const char* c : kRequired) {
      if (!root && !given.count(c)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cgroup v2: ", l.unified, " does not delegate controller ", c,
            " to its children (cgroup.subtree_control) and, holding this process, cannot"));
      }
    }
    return absl::OkStatus();
  }
  for (const char* c : kRequired) {
    auto it = l.base.find(c);
    if (it == l.base.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cgroup v1 controller ", c, " is not mounted"));
    }
    if (access(it->second.c_str(), W_OK) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cgroup ", it->second, " is not writable: ", strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Cgroup>> Cgroup::Create(const std::string& path,
                                                       const CgroupLimits& limits) {
  DEEPNEX_RETURN_IF_ERROR(Usable());
  std::unique_ptr<Cgroup> cg(new Cgroup(path));
  absl::Status made;
  if (GetLayout().v2) {
    made = EnableV2Controllers(path);
  } else {
    for (const std::string& dir : Dirs(path)) {
      std::string partial = dir.substr(0, dir.size() - path.size() - 1);
      for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
        absl::StrAppend(&partial, "/", part);
        made = MakeDir(partial);
        if (!made.ok()) break;
      }
      if (!made.ok()) break;
    }
  }
  if (made.ok()) made = ApplyLimits(path, limits);
  if (!made.ok()) {
    cg->Remove().IgnoreError();
    return made;
  }
  return cg;
}

absl::StatusOr<std::unique_ptr<Cgroup>> Cgroup::Open(const std::string& path) {
  DEEPNEX_RETURN_IF_ERROR(Usable());
  for (const std::string& dir : Dirs(path)) {
    if (Exists(dir)) return std::unique_ptr<Cgroup>(new Cgroup(path));
  }
  return absl::NotFoundError(absl::StrCat("no cgroup ", path, " (looked in ",
                                          absl::StrJoin(Dirs(path), ", "), ")"));
}

std::vector<std::string> Cgroup::Children(const std::string& parent) {
  std::set<std::string> names;
  if (!Usable().ok()) return {};
  for (const std::string& dir : Dirs(parent)) {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) continue;
    while (struct dirent* e = readdir(d)) {
      if (e->d_type == DT_DIR && e->d_name[0] != '.') names.emplace(e->d_name);
    }
    closedir(d);
  }
  return {names.begin(), names.end()};
}

absl::Status Cgroup::AddProcess(pid_t pid) {
  for (const std::string& dir : Dirs(path_)) {
    DEEPNEX_RETURN_IF_ERROR(WriteFile(dir + "/cgroup.procs", std::to_string(pid)));
  }
  return absl::OkStatus();
}

std::vector<std::string> Cgroup::SelfJoinFiles() const {
  if (GetLayout().v2) return {};
  std::vector<std::string> files;
  for (const std::string& dir : Dirs(path_)) files.push_back(dir + "/tasks");
  return files;
}

bool JoinCgroupSelf(const std::vector<const char*>& files) {
  for (const char* file : files) {
    int fd = open(file, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return false;
    bool ok = write(fd, "0", 1) == 1;
    int saved = errno;
    close(fd);
    errno = saved;
    if (!ok) return false;
  }
  return true;
}

std::vector<pid_t> Cgroup::Processes() {
  std::set<pid_t> pids;
  for (const std::string& dir : Dirs(path_)) {
    for (pid_t p : ReadPids(dir + "/cgroup.procs")) pids.insert(p);
  }
  return {pids.begin(), pids.end()};
}

launch::Usage Cgroup::ReadUsage() {
  launch::Usage u;
  if (GetLayout().v2) {
    const std::string dir = DirOf(path_, "");
    u.cpu_seconds = ReadKeyed(dir + "/cpu.stat", "usage_usec").value_or(0) / 1e6;
    u.memory = ReadUint(dir + "/memory.current").value_or(0);
    u.memory_peak = ReadUint(dir + "/memory.peak").value_or(u.memory);
    u.pids = ReadUint(dir + "/pids.current").value_or(0);
    u.gpu_memory = GpuMemoryOf(Processes());
    return u;
  }
  u.cpu_seconds = ReadUint(DirOf(path_, "cpuacct") + "/cpuacct.usage").value_or(0) / 1e9;
  const std::string mem = DirOf(path_, "memory");
  u.memory = ReadUint(mem + "/memory.usage_in_bytes").value_or(0);
  u.memory_peak = ReadUint(mem + "/memory.max_usage_in_bytes").value_or(u.memory);
  u.pids = ReadUint(DirOf(path_, "pids") + "/pids.current").value_or(0);
  u.gpu_memory = GpuMemoryOf(Processes());
  return u;
}

bool Cgroup::OomKilled() {
  const std::string mem = DirOf(path_, "memory");
  if (GetLayout().v2) return ReadKeyed(mem + "/memory.events", "oom_kill").value_or(0) > 0;
  std::optional<uint64_t> kills = ReadKeyed(mem + "/memory.oom_control", "oom_kill");
  if (kills) return *kills > 0;
  // Kernels before 4.13 do not count kills: hitting the limit is the sign.
  std::optional<uint64_t> limit = ReadUint(mem + "/memory.limit_in_bytes");
  std::optional<uint64_t> peak = ReadUint(mem + "/memory.max_usage_in_bytes");
  return ReadUint(mem + "/memory.failcnt").value_or(0) > 0 && limit && peak &&
         *peak >= *limit;
}

absl::Status Cgroup::KillAll() {
  const bool v2 = GetLayout().v2;
  const std::string dir = v2 ? DirOf(path_, "") : DirOf(path_, "freezer");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  // Frozen, a process cannot fork a child that escapes the kill; the
  // SIGKILL lands when it is thawed.
  const bool freezer = !dir.empty() && Exists(dir + (v2 ? "/cgroup.freeze" : "/freezer.state"));
  const bool v2_kill = v2 && Exists(dir + "/cgroup.kill");
  while (true) {
    std::vector<pid_t> pids = Processes();
    if (pids.empty()) return absl::OkStatus();
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "cgroup ", path_, " still has ", pids.size(), " processes after SIGKILL"));
    }
    if (v2_kill) {
      WriteFile(dir + "/cgroup.kill", "1").IgnoreError();
    } else {
      if (freezer) WriteFile(dir + (v2 ? "/cgroup.freeze" : "/freezer.state"), v2 ? "1" : "FROZEN").IgnoreError();
      for (pid_t pid : Processes()) kill(pid, SIGKILL);
      if (freezer) WriteFile(dir + (v2 ? "/cgroup.freeze" : "/freezer.state"), v2 ? "0" : "THAWED").IgnoreError();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

absl::Status Cgroup::Remove() {
  absl::Status killed = KillAll();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (const std::string& dir : Dirs(path_)) {
    // A killed process leaves the cgroup a moment after it died; one that
    // joined after the kill (an exec'd process joins itself) is killed now.
    while (rmdir(dir.c_str()) != 0 && errno != ENOENT) {
      if (errno != EBUSY || std::chrono::steady_clock::now() > deadline) {
        return absl::InternalError(
            absl::StrCat("cannot remove cgroup ", dir, ": ", strerror(errno)));
      }
      KillAll().IgnoreError();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return killed;
}

}  // namespace deepnex::launch
