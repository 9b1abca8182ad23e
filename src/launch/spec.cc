// Spec validation and resolution against a grant (see spec.h).
#include "launch/spec.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/text.h"
#include "deepnex/status.h"
#include "deepnex/units.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

// The variables that carry the GPU grant: a spec may repeat them but not
// change them.
constexpr const char* kGrantEnv[] = {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
                                     "DEEPNEX_GPU_MEMORY_LIMIT"};

bool IsNameChar(char c, bool first) {
  return std::isalnum(static_cast<unsigned char>(c)) ||
         (!first && (c == '_' || c == '.' || c == '-'));
}

std::optional<std::string> RealPath(const std::string& path) {
  char buf[PATH_MAX];
  if (realpath(path.c_str(), buf) == nullptr) return std::nullopt;
  return std::string(buf);
}

bool IsUnder(const std::string& path, const std::string& root) {
  return root == "/" || path == root || absl::StartsWith(path, root + "/");
}

// The container paths that the runtime itself mounts: a mount over them
// would hide what runc, the devices allowed and the kernel's views need.
constexpr const char* kRuntimeDirs[] = {"/proc", "/dev", "/sys"};

// More than any machine has; far below where a CFS quota overflows (the
// kernel refused the cgroup write of 1e9 cores with EINVAL).
constexpr double kMaxCpus = 65536;
// PID_MAX_LIMIT on 64-bit Linux: pids.max takes nothing above it.
constexpr int64_t kMaxPids = 4194304;
// Memory past 1 EiB is no machine's, and near 2^64 a rounding up to whole
// MiB (Slurm's --mem) wrapped to 0, which Slurm takes as all of the node's.
constexpr uint64_t kMaxMemory = 1ull << 60;

// Checks mount `i` and sets its source to the real path that was checked, so
// that the backend mounts what was allowed even if a symlink on the way is
// changed afterwards.
absl::Status CheckMount(const LauncherOptions& options, size_t i, Mount& m) {
  const std::string field = absl::StrCat("spec.mounts[", i, "]");
  DEEPNEX_RETURN_IF_ERROR(CheckAbsoluteNormal(field + ".source", m.source));
  DEEPNEX_RETURN_IF_ERROR(CheckAbsoluteNormal(field + ".target", m.target));
  std::string target = std::filesystem::path(m.target).lexically_normal().string();
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  if (target == "/") {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".target: ", QuotedPath(m.target),
                     " would cover the container's root"));
  }
  for (const char* dir : kRuntimeDirs) {
    if (IsUnder(target, dir)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".target: ", QuotedPath(m.target),
                                                     " is over the container's ", dir,
                                                     ", which the runtime mounts"));
    }
  }
  std::optional<std::string> real = RealPath(m.source);
  if (!real) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".source: ", QuotedPath(m.source), " does not exist"));
  }
  std::vector<std::string> roots = options.allowed_mount_roots;
  if (roots.empty()) roots.push_back("/");
  for (const std::string& root : roots) {
    std::optional<std::string> real_root = RealPath(root);
    if (real_root && IsUnder(*real, *real_root)) {
      m.source = *real;
      return absl::OkStatus();
    }
  }
  return absl::PermissionDeniedError(absl::StrCat(
      field, ".source: ", QuotedPath(m.source),
      *real == m.source ? "" : " (" + QuotedPath(*real) + ")",
      " is outside the allowed mount roots [", absl::StrJoin(roots, ", "), "]"));
}

// Labels travel in engines' own syntax: docker's and podman's filters
// (key=value), Slurm's --comment (key=value,... read back line by line from
// squeue, whose lines a newline in a value could forge to have Cleanup cancel
// another user's job). So no control characters anywhere, no ',' and no
// '=' or space in a key, no ',' in a value. And at most 64 KiB in all (as
// Kubernetes bounds a pod's annotations): central keeps them for every
// container, and a probe's 850 labels of 4000 bytes were taken.
absl::Status CheckLabels(const std::map<std::string, std::string>& labels) {
  constexpr size_t kMaxLabelBytes = 64 << 10;
  auto control = [](const std::string& s) {
    return std::any_of(s.begin(), s.end(), [](char c) {
      return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
    });
  };
  size_t total = 0;
  for (const auto& [key, value] : labels) {
    if (key.empty() || key.size() > 253 || control(key) ||
        key.find_first_of(",= ") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.labels: key ", Quoted(key),
          " is not 1-253 characters without control characters, ',', '=' or spaces"));
    }
    if (value.size() > 4096 || control(value) || value.find(',') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.labels: the value of \"", key, "\" (", Quoted(value),
          ") is not at most 4096 characters without control characters or ','"));
    }
    total += key.size() + value.size();
  }
  if (total > kMaxLabelBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.labels: ", labels.size(), " labels of ", total,
                     " bytes in all (keys and values); at most ", kMaxLabelBytes));
  }
  return absl::OkStatus();
}

// Whether `backend` can run a container as `run_as`: the user name goes
// into an oci container's /etc/passwd. Every backend runs the processes as
// that user; process, oci and slurm (sbatch --uid) become them here, which
// needs root, while docker and kubernetes have their engine do it.
absl::Status CheckRunAs(const std::string& backend, const RunAs& run_as) {
  if (!run_as.user.empty() && !IsPasswdName(run_as.user)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.run_as.user: ", Quoted(run_as.user),
                                                   " is not a user name ([a-z_][a-z0-9_-]*, "
                                                   "at most 32 characters)"));
  }
  if (!run_as.home.empty()) {
    DEEPNEX_RETURN_IF_ERROR(CheckAbsoluteNormal("spec.run_as.home", run_as.home));
  }
  const bool engine_becomes = backend == "docker" || backend == "kubernetes";
  if (!engine_becomes && geteuid() != 0 &&
      (run_as.uid != geteuid() || run_as.gid != getegid())) {
    return absl::PermissionDeniedError(absl::StrCat(
        "spec.run_as: uid ", run_as.uid, " gid ", run_as.gid, ": this launcher runs as uid ",
        geteuid(), " gid ", getegid(), " and only root may run ", backend,
        " containers as another user"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckSpecUser(const std::string& user, const gpu::Allocation& a) {
  if (user == a.user) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "spec.user \"", user, "\" may not use allocation \"", a.id, "\" of user \"", a.user, "\""));
}

absl::Status CheckMounts(const std::vector<std::string>& roots, ContainerSpec& spec) {
  if (spec.mounts.empty()) return absl::OkStatus();
  if (roots.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat("spec.mounts[0].source: ", QuotedPath(spec.mounts[0].source),
                     ": no mount roots are allowed here"));
  }
  LauncherOptions options;
  options.allowed_mount_roots = roots;
  for (size_t i = 0; i < spec.mounts.size(); ++i) {
    DEEPNEX_RETURN_IF_ERROR(CheckMount(options, i, spec.mounts[i]));
  }
  return absl::OkStatus();
}

absl::Status CheckName(const std::string& field, const std::string& name, size_t max) {
  bool ok = !name.empty() && name.size() <= max;
  for (size_t i = 0; ok && i < name.size(); ++i) ok = IsNameChar(name[i], i == 0);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": ", Quoted(name), " is not a valid name ([a-zA-Z0-9][a-zA-Z0-9_.-]*, at most ", max,
      " characters)"));
}

absl::Status CheckAbsoluteNormal(const std::string& field, const std::string& path) {
  if (!absl::StartsWith(path, "/")) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", QuotedPath(path), " is not an absolute path"));
  }
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part == "." || part == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", QuotedPath(path), " is not lexically normal (has a \"", part,
          "\" component)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ContainerSpec> Resolve(const LauncherOptions& options,
                                      const std::string& launcher_id, ContainerSpec spec) {
  DEEPNEX_RETURN_IF_ERROR(CheckName("spec.name", spec.name, 63));
  if (spec.command.empty() || spec.command[0].empty()) {
    return absl::InvalidArgumentError("spec.command: empty (give at least the program)");
  }
  // Arguments and environment reach exec as C strings: past a NUL they
  // would be cut short without a word.
  for (size_t i = 0; i < spec.command.size(); ++i) {
    if (spec.command[i].find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.command[", i, "]: holds a NUL byte"));
    }
  }
  if (!spec.working_dir.empty()) {
    DEEPNEX_RETURN_IF_ERROR(CheckAbsoluteNormal("spec.working_dir", spec.working_dir));
  }
  for (size_t i = 0; i < spec.mounts.size(); ++i) {
    DEEPNEX_RETURN_IF_ERROR(CheckMount(options, i, spec.mounts[i]));
  }
  for (const auto& [key, value] : spec.env) {
    if (key.empty() || key.find('=') != std::string::npos ||
        key.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.env: ", Quoted(key), " is not a variable name"));
    }
    if (value.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.env: the value of \"", key, "\" holds a NUL byte"));
    }
  }
  if (spec.memory != 0 && spec.memory < options.min_memory) {
    return absl::InvalidArgumentError(absl::StrCat("spec.memory: ", spec.memory,
                                                   " bytes is below the minimum ",
                                                   FormatByteSize(options.min_memory)));
  }
  if (spec.memory > kMaxMemory) {
    return absl::InvalidArgumentError(absl::StrCat("spec.memory: ", spec.memory,
                                                   " bytes is more than ",
                                                   FormatByteSize(kMaxMemory)));
  }
  if (!std::isfinite(spec.cpus) || spec.cpus < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.cpus: ", spec.cpus, " is not a non-negative number of cores"));
  }
  if (spec.cpus > kMaxCpus) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.cpus: ", spec.cpus, " is more than ", kMaxCpus, " cores"));
  }
  if (spec.log_max_bytes > options.log_max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.log_max_bytes: ", spec.log_max_bytes, " bytes is more than the launcher's limit ",
        FormatByteSize(options.log_max_bytes)));
  }
  if (spec.log_max_bytes == 0) spec.log_max_bytes = options.log_max_bytes;
  if (spec.pids_limit < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.pids_limit: ", spec.pids_limit, " is negative"));
  }
  if (spec.pids_limit > kMaxPids) {
    return absl::InvalidArgumentError(absl::StrCat("spec.pids_limit: ", spec.pids_limit,
                                                   " is more than the kernel's most processes (",
                                                   kMaxPids, ")"));
  }
  if (spec.restart.max_restarts < -1 || spec.restart.backoff.count() < 0 ||
      spec.restart.max_backoff < spec.restart.backoff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.restart: max_restarts ", spec.restart.max_restarts, ", backoff ",
        spec.restart.backoff.count(), " ms, max_backoff ", spec.restart.max_backoff.count(),
        " ms is not a policy (max_restarts >= -1, 0 <= backoff <= max_backoff)"));
  }
  if (spec.network_none && spec.host_network) {
    return absl::InvalidArgumentError(
        "spec.host_network: true contradicts spec.network_none: true");
  }
  if (spec.run_as) DEEPNEX_RETURN_IF_ERROR(CheckRunAs(options.backend, *spec.run_as));
  if (auto named = options.images.find(spec.image); named != options.images.end()) {
    spec.image = named->second;
  }
  DEEPNEX_RETURN_IF_ERROR(CheckLabels(spec.labels));
  for (const char* key : {kLauncherLabel, kNameLabel}) {
    if (spec.labels.count(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.labels: \"", key, "\" is set by the launcher"));
    }
  }
  spec.labels[kLauncherLabel] = launcher_id;
  spec.labels[kNameLabel] = spec.name;
  if (!spec.allocation) return spec;

  const gpu::Allocation& a = *spec.allocation;
  if (spec.user.empty()) spec.user = a.user;
  DEEPNEX_RETURN_IF_ERROR(CheckSpecUser(spec.user, a));
  // A grant's CPUs and memory bound its containers: a grant of 0 is none,
  // never "unlimited" (a container without a limit would escape the quota
  // that the grant was counted against), and every container needs some.
  if (spec.cpus == 0) spec.cpus = a.cpus;
  if (spec.cpus == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.cpus: allocation \"", a.id,
        "\" grants 0 CPUs, and a container needs some (allocate with cpus > 0)"));
  }
  if (spec.cpus > a.cpus) {
    return absl::InvalidArgumentError(absl::StrCat("spec.cpus: ", spec.cpus,
                                                   " is more than allocation \"", a.id,
                                                   "\" grants (", a.cpus, ")"));
  }
  if (spec.memory == 0) spec.memory = a.memory;
  if (spec.memory == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.memory: allocation \"", a.id,
        "\" grants no memory, and a container needs some (allocate with memory > 0)"));
  }
  if (spec.memory > a.memory) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.memory: ", FormatByteSize(spec.memory), " is more than allocation \"", a.id,
        "\" grants (", FormatByteSize(a.memory), ")"));
  }
  for (const char* key : kGrantEnv) {
    auto want = spec.env.find(key);
    if (want == spec.env.end()) continue;
    auto granted = a.env.find(key);
    if (granted == a.env.end() || granted->second != want->second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.env: ", key, "=\"", want->second, "\" contradicts allocation \"", a.id,
          "\" (", granted == a.env.end() ? "unset" : "\"" + granted->second + "\"", ")"));
    }
  }
  std::map<std::string, std::string> env = a.env;
  for (const auto& [k, v] : spec.env) env[k] = v;
  spec.env = std::move(env);
  return spec;
}

absl::Status CheckRunsOnHost(const ContainerSpec& spec) {
  if (!spec.working_dir.empty()) {
    struct stat st;
    if (stat(spec.working_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::NotFoundError(absl::StrCat("spec.working_dir: ", QuotedPath(spec.working_dir),
                                              " is not a directory on this host"));
    }
  }
  return FindOnPath(spec.command[0], PathOf(spec.env)).status();
}

}  // namespace deepnex::launch
