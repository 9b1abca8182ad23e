// The docker backend: one container per run through the Docker Engine REST
// API on its unix socket (podman's Docker-compatible service works too).
#include "launch/docker.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "launch/engine_env.h"
#include "launch/http.h"
#include "launch/spec.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

using nlohmann::json;

// The container's exit as ExitStatus. Docker reports a process killed by
// signal N as 128+N, which a program can also exit with: only a run we
// stopped counts as signaled.
ExitStatus ExitFromInspect(const json& state, bool stopped_by_us) {
  ExitStatus exit;
  exit.code = JsonValue(state, "ExitCode", 0);
  if (JsonValue(state, "OOMKilled", false)) {
    exit.reason = ExitReason::kOomKilled;
    exit.signal = 9;
  } else if (stopped_by_us && exit.code > 128 && exit.code < 128 + 65) {
    exit.reason = ExitReason::kSignaled;
    exit.signal = exit.code - 128;
  }
  return exit;
}

// stdout and stderr from a logs response: frames of an 8-byte header
// (stream, 0, 0, 0, big-endian size) and the payload.
std::string Demultiplex(const std::string& raw) {
  std::string out;
  size_t pos = 0;
  while (pos + 8 <= raw.size()) {
    const auto* h = reinterpret_cast<const unsigned char*>(raw.data() + pos);
    if (h[0] > 2 || h[1] != 0 || h[2] != 0 || h[3] != 0) return raw;  // a TTY's raw stream
    size_t size = (size_t{h[4]} << 24) | (size_t{h[5]} << 16) | (size_t{h[6]} << 8) | h[7];
    out.append(raw, pos + 8, size);
    pos += 8 + size;
  }
  return out;
}

// Characters of an image reference (name[:tag][@digest]); anything else is
// refused before it reaches a URL path.
bool ValidImageReference(const std::string& image) {
  if (image.empty()) return false;
  for (char c : image) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-' && c != '/' && c != ':' &&
        c != '@') {
      return false;
    }
  }
  return true;
}

class DockerRun : public Run {
 public:
  DockerRun(std::shared_ptr<HttpClient> http, std::string api, std::string id)
      : http_(std::move(http)), api_(std::move(api)), id_(std::move(id)),
        waiter_([this] { WaitForExit(); }) {}

  ~DockerRun() override {
    cancel_.Cancel();
    {
      std::lock_guard<std::mutex> lock(mu_);
      destroying_ = true;
    }
    cv_.notify_all();
    waiter_.join();
    if (killer_.joinable()) killer_.join();
  }

  std::string id() const override { return id_; }

  absl::StatusOr<std::optional<ExitStatus>> Wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [this] { return result_.has_value(); })) {
      return std::optional<ExitStatus>();
    }
    if (!result_->ok()) return result_->status();
    return std::optional<ExitStatus>(**result_);
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    const auto kill_at = std::chrono::steady_clock::now() + grace;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (result_.has_value()) return absl::OkStatus();
      if (stopping_) {
        // The TERM went once (as kubelet's does); a later Stop only brings
        // the KILL forward.
        kill_at_ = std::min(kill_at_, kill_at);
        cv_.notify_all();
        return absl::OkStatus();
      }
      stopping_ = true;
      kill_at_ = kill_at;
    }
    absl::Status term = Kill("TERM");
    // The Docker API's own stop takes whole seconds and blocks; a thread
    // keeps both the grace exact and Stop prompt.
    killer_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!result_.has_value() && !destroying_) {
        if (std::chrono::steady_clock::now() >= kill_at_) {
          lock.unlock();
          Kill("KILL").IgnoreError();
          return;
        }
        cv_.wait_until(lock, kill_at_);
      }
    });
    return term;
  }

  absl::StatusOr<std::string> Logs() override {
    DEEPNEX_ASSIGN_OR_RETURN(
        std::string raw, http_->Call("GET", Path("/logs?stdout=1&stderr=1")));
    return Demultiplex(raw);
  }

  absl::StatusOr<launch::Usage> Usage() override {
    DEEPNEX_ASSIGN_OR_RETURN(std::string body, http_->Call("GET", Path("/stats?stream=false")));
    const json stats = json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (!stats.is_object()) {
      return absl::InternalError(absl::StrCat("container ", id_, ": stats are not JSON"));
    }
    launch::Usage usage;
    usage.cpu_seconds =
        JsonValue(JsonField(JsonField(stats, "cpu_stats"), "cpu_usage"), "total_usage", 0.0) / 1e9;
    const json& memory = JsonField(stats, "memory_stats");
    const uint64_t used = JsonValue(memory, "usage", uint64_t{0});
    // As `docker stats` does: page cache that can be dropped is not use.
    const json& detail = JsonField(memory, "stats");
    const uint64_t inactive = JsonValue(detail, "total_inactive_file",
                                        JsonValue(detail, "inactive_file", uint64_t{0}));
    usage.memory = used > inactive ? used - inactive : used;
    usage.pids = JsonValue(JsonField(stats, "pids_stats"), "current", int64_t{0});
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = std::max({peak_, usage.memory, JsonValue(memory, "max_usage", uint64_t{0})});
    usage.memory_peak = peak_;
    return usage;
  }

  absl::Status Remove() override {
    absl::StatusOr<HttpResponse> r = http_->Send("DELETE", Path("?force=1"));
    if (!r.ok()) return r.status();
    if (r->status == 404 || (r->status >= 200 && r->status < 300)) return absl::OkStatus();
    return http_->ErrorFor("DELETE", Path("?force=1"), *r);
  }

 private:
  std::string Path(const std::string& rest) const {
    return absl::StrCat(api_, "/containers/", id_, rest);
  }

  absl::Status Kill(const std::string& signal) {
    absl::StatusOr<HttpResponse> r = http_->Send("POST", Path("/kill?signal=" + signal));
    if (!r.ok()) return r.status();
    if (r->status >= 200 && r->status < 300) return absl::OkStatus();
    // Docker says 409, podman 500, when the container is no longer running:
    // Stop is idempotent, so that is no failure.
    auto state = http_->Call("GET", Path("/json"));
    if (state.ok()) {
      const json info = json::parse(*state, nullptr, false);
      if (!JsonValue(JsonField(info, "State"), "Running", true)) return absl::OkStatus();
    }
    return http_->ErrorFor("POST", Path("/kill?signal=" + signal), *r);
  }

  // The waiter thread: one long wait call, then the exit from inspect.
  void WaitForExit() {
    std::string body;
    absl::Status waited = http_->Stream(
        "POST", Path("/wait?condition=not-running"), "",
        [&](const std::string& piece) {
          body += piece;
          return true;
        },
        std::chrono::milliseconds(0), &cancel_);
    if (absl::IsCancelled(waited)) return;
    absl::StatusOr<ExitStatus> result = ExitStatus{};
    if (!waited.ok()) {
      result = waited;
    } else {
      auto inspected = http_->Call("GET", Path("/json"));
      const json info = inspected.ok() ? json::parse(*inspected, nullptr, false) : json();
      const json& state = JsonField(info, "State");
      if (!inspected.ok()) {
        result = inspected.status();
      } else if (!state.is_object()) {
        result = absl::InternalError(absl::StrCat("container ", id_, ": inspect has no State"));
      } else {
        std::lock_guard<std::mutex> lock(mu_);
        result = ExitFromInspect(state, stopping_);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      result_ = std::move(result);
    }
    cv_.notify_all();
  }

  const std::shared_ptr<HttpClient> http_;
  const std::string api_;
  const std::string id_;
  HttpCancel cancel_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<absl::StatusOr<ExitStatus>> result_;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point kill_at_;  // of the KILL, once stopping_
  bool destroying_ = false;
  uint64_t peak_ = 0;
  std::thread killer_;
  std::thread waiter_;  // last: it starts in the constructor and uses the rest
};

// The engine's containers (running or not) that match `filters` (the
// Docker API's filters object), as its JSON array.
absl::StatusOr<json> ListContainers(HttpClient& http, const std::string& api,
                                    const json& filters) {
  DEEPNEX_ASSIGN_OR_RETURN(
      std::string listed,
      http.Call("GET", absl::StrCat(api, "/containers/json?all=1&filters=",
                                    UrlEncode(filters.dump()))));
  json containers = json::parse(listed, nullptr, false);
  if (!containers.is_array()) {
    return absl::InternalError(absl::StrCat("docker container list is not a JSON array: ", listed));
  }
  return containers;
}

class DockerBackend : public Backend {
 public:
  DockerBackend(std::shared_ptr<HttpClient> http, std::string api, std::string socket)
      : http_(std::move(http)), api_(std::move(api)), socket_(std::move(socket)) {}

  absl::Status Check(const ContainerSpec& spec) override {
    if (!ValidImageReference(spec.image)) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.image: \"", spec.image, "\" is not an image reference"));
    }
    absl::StatusOr<std::string> found =
        http_->Call("GET", absl::StrCat(api_, "/images/", spec.image, "/json"));
    if (absl::IsNotFound(found.status())) {
      return absl::NotFoundError(absl::StrCat("spec.image: image \"", spec.image,
                                              "\" not found on the docker engine at ", socket_));
    }
    return found.status();
  }

  absl::StatusOr<std::unique_ptr<Run>> Start(const ContainerSpec& spec,
                                             const RunContext& context) override {
    StagedMounts staged;  // until the engine has made its own mounts (start)
    DEEPNEX_ASSIGN_OR_RETURN(ContainerSpec pinned, PinMountSources(spec, context.dir, &staged));
    DEEPNEX_ASSIGN_OR_RETURN(
        std::string created,
        http_->Call("POST",
                    absl::StrCat(api_, "/containers/create?name=", UrlEncode(context.run_name)),
                    DockerCreateBody(pinned, context)));
    const std::string id = JsonValue<std::string>(json::parse(created, nullptr, false), "Id", "");
    if (id.empty()) {
      return absl::InternalError(
          absl::StrCat("docker create of ", context.run_name, ": no Id in \"", created, "\""));
    }
    absl::StatusOr<std::string> started =
        http_->Call("POST", absl::StrCat(api_, "/containers/", id, "/start"));
    if (!started.ok()) {
      http_->Send("DELETE", absl::StrCat(api_, "/containers/", id, "?force=1")).IgnoreError();
      const std::string message(started.status().message());
      if (absl::StrContains(message, "executable file not found") ||
          absl::StrContains(message, "no such file or directory")) {
        return absl::NotFoundError(absl::StrCat("spec.command: \"", spec.command[0],
                                                "\" not found in image \"", spec.image,
                                                "\": ", message));
      }
      return started.status();
    }
    return std::unique_ptr<Run>(new DockerRun(http_, api_, id));
  }

  absl::StatusOr<int> Cleanup(const std::string& launcher_id) override {
    json filters = json::object();
    filters["label"] = json::array({absl::StrCat(kLauncherLabel, "=", launcher_id)});
    DEEPNEX_ASSIGN_OR_RETURN(json containers, ListContainers(*http_, api_, filters));
    int swept = 0;
    for (const json& c : containers) {
      const std::string id = JsonValue<std::string>(c, "Id", "");
      if (id.empty()) continue;
      // force=1 kills a running container first.
      absl::StatusOr<HttpResponse> r =
          http_->Send("DELETE", absl::StrCat(api_, "/containers/", id, "?force=1"));
      if (!r.ok()) return r.status();
      if (r->status == 404) continue;  // gone meanwhile
      if (r->status < 200 || r->status >= 300) {
        return http_->ErrorFor("DELETE", absl::StrCat(api_, "/containers/", id, "?force=1"), *r);
      }
      ++swept;
    }
    return swept;
  }

 private:
  const std::shared_ptr<HttpClient> http_;
  const std::string api_;
  const std::string socket_;
};

// The engine at options.docker.socket, answering /_ping, and the API path
// prefix of options.docker.api_version.
struct Engine {
  std::shared_ptr<HttpClient> http;
  std::string api;
};

absl::StatusOr<Engine> Connect(const LauncherOptions& options) {
  const std::string& socket = options.docker.socket;
  struct stat st;
  if (stat(socket.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("docker: no Docker Engine socket at ", socket));
  }
  HttpClientOptions http;
  http.endpoint = "unix:" + socket;
  // Creating a container copies its image on some storage drivers.
  http.read_timeout = std::chrono::seconds(120);
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<HttpClient> client, HttpClient::Create(http));
  absl::StatusOr<std::string> pong = client->Call("GET", "/_ping");
  if (!pong.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "docker: the engine at ", socket, " does not answer /_ping: ", pong.status().message()));
  }
  return Engine{std::shared_ptr<HttpClient>(std::move(client)),
                options.docker.api_version.empty() ? "" : "/" + options.docker.api_version};
}

}  // namespace

std::string DockerCreateBody(const ContainerSpec& spec, const RunContext& context) {
  // Whom it runs as: run_as, else the launcher's own ids, never the
  // image's user (root in most images).
  const RunAs identity = ContainerRunAs(spec);
  std::map<std::string, std::string> engine_env = EngineEnv(spec);
  // The engine's HOME for a uid the image does not know is "/", read-only.
  engine_env.emplace("HOME", ContainerHome(spec, identity.uid));
  json env = json::array();
  for (const auto& [k, v] : engine_env) env.push_back(k + "=" + v);
  json host = json::object();
  host["ReadonlyRootfs"] = true;
  // What programs expect to write to on a read-only root.
  host["Tmpfs"] = json::object({{"/tmp", ""}});
  host["SecurityOpt"] = json::array({"no-new-privileges"});
  if (spec.memory > 0) {
    host["Memory"] = spec.memory;
    host["MemorySwap"] = spec.memory;  // equal: no swap beyond the limit
  }
  if (spec.cpus > 0) host["NanoCpus"] = static_cast<int64_t>(spec.cpus * 1e9);
  host["PidsLimit"] = PidsLimitOf(spec);
  // As oci: the host's network where allowed, else only a loopback of its
  // own. The engine's default bridge would put every user's containers on
  // one network, where a probe's container reached another user's server.
  host["NetworkMode"] = spec.host_network ? "host" : "none";
  // The identity numeric, so that the image needs no passwd entry; no
  // capabilities but ContainerCapabilities (none unless root), and
  // no-new-privileges keeps setuid binaries from giving any back.
  host["CapDrop"] = json::array({"ALL"});
  const std::vector<std::string> caps = ContainerCapabilities(identity.uid);
  if (!caps.empty()) host["CapAdd"] = caps;
  // Mounts, not Binds: a "SRC:DST[:OPTS]" string would read a ':' in a
  // target as the start of the engine's options (a probe's "/x:U" asked
  // podman to chown the source to the container's user).
  json mounts = json::array();
  for (const Mount& m : spec.mounts) {
    mounts.push_back({{"Type", "bind"},
                      {"Source", m.source},
                      {"Target", m.target},
                      {"ReadOnly", m.read_only},
                      {"BindOptions", {{"Propagation", "rprivate"}}}});
  }
  if (!mounts.empty()) host["Mounts"] = mounts;
  if (spec.allocation.has_value() && !spec.allocation->gpus.empty()) {
    json ids = json::array();
    for (const gpu::GrantedGpu& g : spec.allocation->gpus) {
      ids.push_back(g.uuid.empty() ? std::to_string(g.index) : g.uuid);
    }
    json request = json::object();
    request["Driver"] = "nvidia";
    request["DeviceIDs"] = ids;
    request["Capabilities"] = json::array({json::array({"gpu"})});
    host["DeviceRequests"] = json::array({request});
  }
  json body = json::object();
  body["Image"] = spec.image;
  body["Cmd"] = spec.command;
  body["Env"] = env;
  body["Labels"] = context.labels;
  body["HostConfig"] = host;
  body["User"] = absl::StrCat(identity.uid, ":", identity.gid);
  if (!spec.working_dir.empty()) body["WorkingDir"] = spec.working_dir;
  return body.dump();
}

absl::StatusOr<std::unique_ptr<Backend>> MakeDockerBackend(const LauncherOptions& options) {
  DEEPNEX_ASSIGN_OR_RETURN(Engine engine, Connect(options));
  return std::unique_ptr<Backend>(
      new DockerBackend(std::move(engine.http), std::move(engine.api), options.docker.socket));
}

absl::StatusOr<std::unique_ptr<Run>> FindDockerRun(const LauncherOptions& options,
                                                   const std::string& launcher_id,
                                                   const std::string& name) {
  DEEPNEX_ASSIGN_OR_RETURN(Engine engine, Connect(options));
  json filters = json::object();
  filters["label"] = json::array({absl::StrCat(kLauncherLabel, "=", launcher_id),
                                  absl::StrCat(kNameLabel, "=", name)});
  filters["status"] = json::array({"running"});
  DEEPNEX_ASSIGN_OR_RETURN(json containers, ListContainers(*engine.http, engine.api, filters));
  // One run of a container runs at a time.
  for (const json& c : containers) {
    const std::string id = JsonValue<std::string>(c, "Id", "");
    if (!id.empty()) return std::unique_ptr<Run>(new DockerRun(engine.http, engine.api, id));
  }
  return absl::NotFoundError(absl::StrCat("docker: no running container labelled ",
                                          kLauncherLabel, "=", launcher_id, ",", kNameLabel, "=",
                                          name));
}

}  // namespace deepnex::launch
