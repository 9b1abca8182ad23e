#include "launch/oci_config.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/file_util.h"
#include "launch/gpu_devices.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// Debian's nobody and nogroup.
constexpr uint32_t kNobody = 65534;

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

// ContainerCapabilities; everything else is dropped.
json Capabilities(uint32_t uid) {
  json caps = json::array();
  for (const std::string& c : ContainerCapabilities(uid)) caps.push_back("CAP_" + c);
  return {{"bounding", caps}, {"effective", caps}, {"permitted", caps}};
}

// The user's name in the container.
std::string UserName(const ContainerSpec& spec, uint32_t uid) {
  if (uid == 0) return "root";
  return spec.run_as && !spec.run_as->user.empty() ? spec.run_as->user : "user";
}

}  // namespace

json Mounts(const Image& image, const ContainerSpec& spec, const Bundle& bundle) {
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
      // Scratch space in no image layer (a commit leaves it out), the
      // container user's: runc gives a tmpfs its mount point's mode over
      // mode=1777, and where the image's /tmp (or what its link names) was
      // 0755, the user could not write there ('deepnex notebook' could not
      // mktemp; probe).
      {{"destination", "/tmp"},
       {"type", "tmpfs"},
       {"source", "tmpfs"},
       {"options",
        {"nosuid", "nodev", "mode=1777", absl::StrCat("uid=", bundle.uid),
         absl::StrCat("gid=", bundle.gid)}}},
  };
  if (!bundle.init.empty()) mounts.push_back(Bind(bundle.init, kInitPath, true));
  if (image.host) {
    for (const char* dir : kHostDirs) {
      if (fs::is_directory(dir)) mounts.push_back(Bind(dir, dir, true));
    }
  }
  for (const EtcEntry& e : image.etc) mounts.push_back(Bind(e.source, "/etc/" + e.name, true));
  // Over the image's own, so that no image (nor the host) decides who the
  // users are. File by file: a bind of a directory over the image's /etc
  // would also cover the image's entries that runc binds from under it.
  if (!bundle.etc_dir.empty()) {
    for (const char* name : kGeneratedEtc) {
      mounts.push_back(
          Bind(absl::StrCat(bundle.etc_dir, "/", name), absl::StrCat("/etc/", name), true));
    }
  }
  for (const Mount& m : spec.mounts) mounts.push_back(Bind(m.source, m.target, m.read_only));
  return mounts;
}

json MakeConfig(const Image& image, const ContainerSpec& spec, const RunContext& context,
                const Bundle& bundle) {
  std::vector<std::string> args = spec.command;
  if (!bundle.init.empty()) {
    // Not tini's -g (signals to the command's process group): tini sets that
    // group up in the child after the fork, and a signal that comes first
    // (runc init leaves a SIGURG pending across its exec) finds no group,
    // is lost and logged into the command's output.
    args.insert(args.begin(), {kInitPath, "--"});
  }
  json env = json::array();
  for (const auto& [k, v] : spec.env) env.push_back(absl::StrCat(k, "=", v));
  if (!spec.env.count("PATH")) env.push_back(absl::StrCat("PATH=", kContainerPath));
  if (!spec.env.count("HOME")) env.push_back("HOME=" + ContainerHome(spec, bundle.uid));
  // As docker's containers have it (a shell's prompt shows it; bash exports
  // no HOSTNAME of its own to the programs it starts).
  if (!spec.env.count("HOSTNAME")) env.push_back("HOSTNAME=" + spec.name);
  // Never above the current hard limit: raising it needs CAP_SYS_RESOURCE.
  struct rlimit nofile;
  getrlimit(RLIMIT_NOFILE, &nofile);
  const uint64_t soft = std::min<uint64_t>(1024, nofile.rlim_max);
  json config = {
      {"ociVersion", "1.0.2"},
      {"process",
       {{"terminal", false},
        // The user's own uid on the host, with no capabilities and no new
        // privileges. No user namespace (yet): it would only add depth, and
        // needs more than a mapping here: runc's init must be root inside
        // it (a second host uid mapped to 0), sysfs cannot be mounted in
        // it with the host network, and GPU nodes must then be bound in.
        {"user", {{"uid", bundle.uid}, {"gid", bundle.gid}}},
        {"args", args},
        {"env", env},
        {"cwd", spec.working_dir.empty() ? "/" : spec.working_dir},
        {"capabilities", Capabilities(bundle.uid)},
        {"rlimits",
         {{{"type", "RLIMIT_NOFILE"}, {"soft", soft}, {"hard", uint64_t{nofile.rlim_max}}}}},
        {"noNewPrivileges", true}}},
      {"root",
       {{"path", bundle.root.empty() ? image.rootfs : bundle.root},
        {"readonly", bundle.root.empty()}}},
      {"hostname", spec.name},
      {"mounts", Mounts(image, spec, bundle)},
      {"annotations", context.labels},
  };
  json& lx = config["linux"];
  lx["cgroupsPath"] = bundle.cgroup_path;
  json namespaces = json::array();
  for (const char* ns : {"pid", "mount", "uts", "ipc"}) namespaces.push_back({{"type", ns}});
  // A new network namespace has only a loopback, which runc brings up.
  if (!spec.host_network) namespaces.push_back({{"type", "network"}});
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
    // NVIDIA's character devices: minor = index; nvidiactl is minor 255;
    // nvidia-uvm's major is assigned at load time, so only a node on the
    // host tells it.
    for (const gpu::GrantedGpu& g : spec.allocation->gpus) {
      AddDevice(absl::StrCat("/dev/nvidia", g.index), kNvidiaMajor, g.index, &config);
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
  resources["pids"] = {{"limit", PidsLimitOf(spec)}};
  return config;
}

std::map<std::string, std::string> EtcFiles(const ContainerSpec& spec, const Bundle& bundle,
                                            const std::string& resolv_conf) {
  const std::string user = UserName(spec, bundle.uid);
  std::string passwd = "root:x:0:0:root:/root:/bin/sh\n";
  std::string group = "root:x:0:\n";
  // The user's own line takes the place of nobody's when the user is
  // mapped to nobody, so that `id -un` names them.
  if (bundle.uid != 0) {
    absl::StrAppend(&passwd, user, ":x:", bundle.uid, ":", bundle.gid, ":", user, ":",
                    ContainerHome(spec, bundle.uid), ":/bin/sh\n");
  }
  if (bundle.gid != 0) absl::StrAppend(&group, user, ":x:", bundle.gid, ":\n");
  if (bundle.uid != kNobody) {
    absl::StrAppend(&passwd, "nobody:x:", kNobody, ":", kNobody,
                    ":nobody:/nonexistent:/usr/sbin/nologin\n");
  }
  if (bundle.gid != kNobody) absl::StrAppend(&group, "nogroup:x:", kNobody, ":\n");
  return {
      {"passwd", passwd},
      {"group", group},
      {"hosts", absl::StrCat("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
                             "127.0.1.1\t", spec.name, "\n")},
      {"hostname", spec.name + "\n"},
      {"resolv.conf", spec.host_network ? resolv_conf : ""},
      {"nsswitch.conf", "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n"},
  };
}

absl::Status WriteEtc(const std::string& dir, const std::map<std::string, std::string>& files) {
  auto failed = [](const std::string& path) {
    return absl::InternalError(absl::StrCat("cannot create ", path, ": ", strerror(errno)));
  };
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return failed(dir);
  for (const auto& [name, text] : files) {
    const std::string path = absl::StrCat(dir, "/", name);
    DEEPNEX_RETURN_IF_ERROR(WriteFileAtomically(path, text));
    // Whatever the launcher's umask: the container's user reads them.
    if (chmod(path.c_str(), 0644) != 0) return failed(path);
  }
  return absl::OkStatus();
}

}  // namespace deepnex::launch
