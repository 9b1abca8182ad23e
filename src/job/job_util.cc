#include "job/job_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/net.h"
#include "nlohmann/json.hpp"

extern char** environ;

namespace deepnex::job {

absl::StatusOr<int> ReservePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("no free port: ", strerror(err)));
  }
  close(fd);
  return ntohs(addr.sin_port);
}

bool Connects(const std::string& host, int port) {
  absl::StatusOr<sockaddr_in> addr = ResolveIPv4(host, port);
  if (!addr.ok()) return false;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  bool ok = connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) == 0;
  close(fd);
  return ok;
}

std::map<std::string, std::string> InheritedEnv(bool as_another_user) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string key = kv.substr(0, eq);
    // The job's own DEEPNEX_ variables are the launcher's to set; the
    // user's knobs pass (DEEPNEX_ELASTIC_TIMEOUT, which a worker reads and
    // the runner sets not, was dropped: it could not be set at all).
    if (key.rfind("DEEPNEX_", 0) == 0 && key != "DEEPNEX_BUILD_DIR" && key != "DEEPNEX_PS_BIN" &&
        key != "DEEPNEX_ELASTIC_TIMEOUT") {
      continue;
    }
    if (as_another_user && (key == "HOME" || key == "USER" || key == "LOGNAME" ||
                            key == "MAIL" || key == "XDG_RUNTIME_DIR")) {
      continue;
    }
    if (key == "CUDA_VISIBLE_DEVICES" || key == "NVIDIA_VISIBLE_DEVICES" || key == "RANK" ||
        key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "LOCAL_WORLD_SIZE" ||
        key == "MASTER_ADDR" || key == "MASTER_PORT") {
      continue;
    }
    env[key] = kv.substr(eq + 1);
  }
  return env;
}

int ExitCodeOf(const launch::ExitStatus& e) {
  switch (e.reason) {
    case launch::ExitReason::kExited: return e.code;
    case launch::ExitReason::kSignaled: return 128 + e.signal;
    case launch::ExitReason::kOomKilled: return 137;
    case launch::ExitReason::kLost: return 1;
  }
  return 1;
}

gpu::JobReport ParseReport(const std::string& value) {
  gpu::JobReport out;
  nlohmann::json j = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j["step"].is_number_integer() || !j["time_ms"].is_number() ||
      !j["metrics"].is_object()) {
    return out;
  }
  for (const auto& [k, v] : j["metrics"].items()) {
    if (!v.is_number()) return gpu::JobReport{};
    out.metrics[k] = v.get<double>();
  }
  out.step = j["step"].get<int64_t>();
  out.time = std::chrono::system_clock::time_point(
      std::chrono::milliseconds(static_cast<int64_t>(j["time_ms"].get<double>())));
  return out;
}

}  // namespace deepnex::job
