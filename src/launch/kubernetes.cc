// The kubernetes backend: one Pod (or a Job of one pod) per run, through the
// API server's REST API. A run with an allocation goes to the allocation's
// node (nodeName); without one, the cluster's scheduler places it. The
// allocation gives the resources it asks for: nvidia.com/gpu for exclusive GPUs, an
// extended resource in MiB for shared GPU memory.
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "core/file_util.h"
#include "core/net.h"
#include "core/random.h"
#include "core/text.h"
#include "launch/backend.h"
#include "launch/engine_env.h"
#include "launch/http.h"
#include "launch/kubernetes.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr char kServiceAccountDir[] = "/var/run/secrets/kubernetes.io/serviceaccount";
constexpr char kNvidiaGpu[] = "nvidia.com/gpu";
// The annotation that says which create made an object (Start).
constexpr char kCreateAnnotation[] = "deepnex.io/create";

// Where the API server is and how to authenticate to it.
struct ApiConfig {
  HttpClientOptions http;
  std::string namespace_;  // empty: not said
};

// `path` from a kubeconfig, which is relative to the kubeconfig's directory.
std::string KubeconfigPath(const std::string& kubeconfig, const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  size_t slash = kubeconfig.rfind('/');
  return slash == std::string::npos ? path : kubeconfig.substr(0, slash + 1) + path;
}

absl::StatusOr<std::string> Base64Field(const YAML::Node& node, const char* key,
                                        const std::string& where) {
  std::string decoded;
  if (!absl::Base64Unescape(node[key].as<std::string>(), &decoded)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, ": not base64"));
  }
  return decoded;
}

// The entry of `list` (clusters, users, contexts) called `name`.
absl::StatusOr<YAML::Node> NamedEntry(const YAML::Node& root, const char* list, const char* field,
                                      const std::string& name, const std::string& file) {
  for (const YAML::Node& entry : root[list]) {
    if (entry["name"] && entry["name"].as<std::string>() == name && entry[field]) {
      return entry[field];
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("kubeconfig ", file, ": no ", field, " named \"", name, "\" in ", list));
}

absl::StatusOr<ApiConfig> FromKubeconfig(const std::string& file) {
  DEEPNEX_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(file, "kubeconfig"));
  ApiConfig config;
  try {
    YAML::Node root = YAML::Load(text);
    if (!root["current-context"]) {
      return absl::InvalidArgumentError(absl::StrCat("kubeconfig ", file, ": no current-context"));
    }
    const std::string context_name = root["current-context"].as<std::string>();
    DEEPNEX_ASSIGN_OR_RETURN(YAML::Node context,
                             NamedEntry(root, "contexts", "context", context_name, file));
    if (context["namespace"]) config.namespace_ = context["namespace"].as<std::string>();
    const std::string cluster_name = context["cluster"].as<std::string>("");
    DEEPNEX_ASSIGN_OR_RETURN(YAML::Node cluster,
                             NamedEntry(root, "clusters", "cluster", cluster_name, file));
    config.http.endpoint = cluster["server"].as<std::string>("");
    if (config.http.endpoint.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kubeconfig ", file, ": cluster \"", cluster_name, "\" has no server"));
    }
    const std::string where = absl::StrCat("kubeconfig ", file, ": cluster ", cluster_name);
    if (cluster["certificate-authority-data"]) {
      DEEPNEX_ASSIGN_OR_RETURN(config.http.ca_pem,
                               Base64Field(cluster, "certificate-authority-data", where));
    }
    config.http.ca_file = KubeconfigPath(file, cluster["certificate-authority"].as<std::string>(""));
    config.http.insecure_skip_verify = cluster["insecure-skip-tls-verify"].as<bool>(false);

    const std::string user_name = context["user"].as<std::string>("");
    if (!user_name.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(YAML::Node user, NamedEntry(root, "users", "user", user_name, file));
      const std::string where = absl::StrCat("kubeconfig ", file, ": user ", user_name);
      if (user["exec"] || user["auth-provider"]) {
        return absl::FailedPreconditionError(absl::StrCat(
            where, " gets its credentials from a plugin, which deepnex does not run; "
                   "give a token, a client certificate or KubernetesOptions::token"));
      }
      config.http.bearer_token = user["token"].as<std::string>("");
      if (config.http.bearer_token.empty() && user["tokenFile"]) {
        DEEPNEX_ASSIGN_OR_RETURN(
            config.http.bearer_token,
            ReadWholeFile(KubeconfigPath(file, user["tokenFile"].as<std::string>()), where + " tokenFile"));
        config.http.bearer_token = std::string(absl::StripAsciiWhitespace(config.http.bearer_token));
      }
      config.http.client_cert_file =
          KubeconfigPath(file, user["client-certificate"].as<std::string>(""));
      config.http.client_key_file = KubeconfigPath(file, user["client-key"].as<std::string>(""));
      if (user["client-certificate-data"]) {
        DEEPNEX_ASSIGN_OR_RETURN(config.http.client_cert_pem,
                                 Base64Field(user, "client-certificate-data", where));
      }
      if (user["client-key-data"]) {
        DEEPNEX_ASSIGN_OR_RETURN(config.http.client_key_pem,
                                 Base64Field(user, "client-key-data", where));
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("kubeconfig ", file, ": ", e.what()));
  }
  return config;
}

absl::StatusOr<ApiConfig> InCluster() {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
  const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
  if (host == nullptr || port == nullptr) {
    return absl::FailedPreconditionError(
        "kubernetes: no kubeconfig ($KUBECONFIG, ~/.kube/config) or server given, and not "
        "inside a cluster (KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are unset)");
  }
  ApiConfig config;
  const std::string h = host;
  config.http.endpoint = h.find(':') == std::string::npos
                             ? absl::StrCat("https://", h, ":", port)
                             : absl::StrCat("https://[", h, "]:", port);
  const std::string dir = kServiceAccountDir;
  DEEPNEX_ASSIGN_OR_RETURN(std::string token,
                           ReadWholeFile(dir + "/token", "the service account token"));
  config.http.bearer_token = std::string(absl::StripAsciiWhitespace(token));
  config.http.ca_file = dir + "/ca.crt";
  absl::StatusOr<std::string> ns = ReadWholeFile(dir + "/namespace", "namespace");
  if (ns.ok()) config.namespace_ = std::string(absl::StripAsciiWhitespace(*ns));
  return config;
}

// Where kubectl looks when no kubeconfig is given: the first file of
// $KUBECONFIG's list that exists (NotFound when none does: a user who set
// it means it), else ~/.kube/config if it exists; empty: neither, so the
// in-cluster account. kubectl merges the files of the list; one is taken
// here, the one that says the current context in the usual single file.
absl::StatusOr<std::string> DefaultKubeconfig() {
  std::error_code error;
  const char* list = std::getenv("KUBECONFIG");
  if (list != nullptr && *list != '\0') {
    for (absl::string_view file : absl::StrSplit(list, ':', absl::SkipEmpty())) {
      if (std::filesystem::is_regular_file(std::string(file), error)) return std::string(file);
    }
    return absl::NotFoundError(
        absl::StrCat("kubernetes: KUBECONFIG=", QuotedPath(list), ": none of its files exists"));
  }
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') return std::string();
  std::string file = absl::StrCat(home, "/.kube/config");
  return std::filesystem::is_regular_file(file, error) ? file : std::string();
}

// The kubeconfig (the options', else kubectl's default), else the
// in-cluster account (unless a server is given), then the explicit
// overrides. The namespace: options.namespace_ unless it is the default
// "default" and the kubeconfig context or the service account names one.
absl::StatusOr<ApiConfig> ResolveConfig(const KubernetesOptions& o) {
  ApiConfig config;
  std::string kubeconfig = o.kubeconfig;
  if (kubeconfig.empty() && o.server.empty()) {
    DEEPNEX_ASSIGN_OR_RETURN(kubeconfig, DefaultKubeconfig());
  }
  if (!kubeconfig.empty()) {
    DEEPNEX_ASSIGN_OR_RETURN(config, FromKubeconfig(kubeconfig));
  } else if (o.server.empty()) {
    DEEPNEX_ASSIGN_OR_RETURN(config, InCluster());
  }
  if (!o.server.empty()) config.http.endpoint = o.server;
  if (!o.token.empty()) config.http.bearer_token = o.token;
  if (!o.ca_file.empty()) {
    config.http.ca_file = o.ca_file;
    config.http.ca_pem.clear();
  }
  if (config.namespace_.empty() || o.namespace_ != "default") config.namespace_ = o.namespace_;
  return config;
}

bool IsAlnum(char c) { return absl::ascii_isalnum(static_cast<unsigned char>(c)); }

// A label value: at most 63 of [A-Za-z0-9_.-], starting and ending with an
// alphanumeric (or empty).
bool ValidLabelValue(const std::string& v) {
  if (v.empty()) return true;
  if (v.size() > 63 || !IsAlnum(v.front()) || !IsAlnum(v.back())) return false;
  for (char c : v) {
    if (!IsAlnum(c) && c != '-' && c != '_' && c != '.') return false;
  }
  return true;
}

// [prefix/]name: the name a non-empty label value, the prefix a DNS
// subdomain.
bool ValidLabelKey(const std::string& k) {
  size_t slash = k.rfind('/');
  std::string name = slash == std::string::npos ? k : k.substr(slash + 1);
  if (name.empty() || !ValidLabelValue(name)) return false;
  if (slash == std::string::npos) return true;
  std::string prefix = k.substr(0, slash);
  if (prefix.empty() || prefix.size() > 253 || !IsAlnum(prefix.front()) || !IsAlnum(prefix.back())) {
    return false;
  }
  for (char c : prefix) {
    if (!(absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-' || c == '.')) return false;
  }
  return true;
}

// A namespace's (or an object's) name: [a-z0-9]([-a-z0-9]*[a-z0-9])?, at
// most 63.
bool IsDns1123Label(const std::string& name) {
  if (name.empty() || name.size() > 63 || name.front() == '-' || name.back() == '-') return false;
  for (char c : name) {
    if (!(absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-')) return false;
  }
  return true;
}

// A run name as an object name (a DNS-1123 label: lowercase alphanumerics
// and '-', at most 63, alphanumeric at both ends).
std::string ObjectName(const std::string& run_name) {
  std::string name;
  for (char c : run_name) name += IsAlnum(c) ? absl::ascii_tolower(c) : '-';
  while (!name.empty() && name.front() == '-') name.erase(0, 1);
  while (!name.empty() && name.back() == '-') name.pop_back();
  if (name.size() > 63 || name != run_name) {
    // Cut to fit, and end with a hash of the whole name: names that differ
    // only past the cut (a job's worker0 and worker1 under a long job name),
    // or only where the label has no such character (central's "a.b-c" and
    // "a-b.c", "forever.a" and "Forever_a"), stay distinct. FNV-1a, so the
    // name is the same in every process.
    uint64_t h = 14695981039346656037ull;
    for (unsigned char c : run_name) h = (h ^ c) * 1099511628211ull;
    if (name.size() > 54) name.resize(54);
    while (!name.empty() && name.back() == '-') name.pop_back();
    if (!name.empty()) name += '-';
    name += absl::StrFormat("%08x", static_cast<uint32_t>(h ^ (h >> 32)));
  }
  return name;
}

// Kubernetes expands $(VAR) in command and env values and turns "$$" into
// "$"; doubling every '$' keeps the text exactly as given.
std::string NoExpansion(const std::string& text) { return absl::StrReplaceAll(text, {{"$", "$$"}}); }

json Resources(const ContainerSpec& spec, const KubernetesOptions& options) {
  json quantities = json::object();
  if (spec.cpus > 0) {
    quantities["cpu"] = absl::StrCat(static_cast<int64_t>(std::ceil(spec.cpus * 1000)), "m");
  }
  if (spec.memory > 0) quantities["memory"] = std::to_string(spec.memory);
  if (spec.allocation.has_value()) {
    int exclusive = 0;
    uint64_t shared_memory = 0;
    for (const gpu::GrantedGpu& g : spec.allocation->gpus) {
      if (g.exclusive) {
        ++exclusive;
      } else {
        shared_memory += g.memory;
      }
    }
    if (exclusive > 0) quantities[kNvidiaGpu] = std::to_string(exclusive);
    if (shared_memory > 0) {
      quantities[options.shared_gpu_memory_resource] =
          std::to_string((shared_memory + (1 << 20) - 1) >> 20);
    }
  }
  if (quantities.empty()) return json::object();
  // Requests equal to limits: the pod is guaranteed what it was granted, and
  // extended resources allow nothing else.
  json resources = json::object();
  resources["requests"] = quantities;
  resources["limits"] = quantities;
  return resources;
}

json PodSpec(const ContainerSpec& spec, const KubernetesOptions& options) {
  json container = json::object();
  container["name"] = "main";
  container["image"] = spec.image;
  json command = json::array();
  for (const std::string& arg : spec.command) command.push_back(NoExpansion(arg));
  // args, not command: like `docker run IMAGE ARGV...`, the image's entrypoint
  // (an environment wrapper in many GPU images) still runs first.
  container["args"] = command;
  std::map<std::string, std::string> engine_env = EngineEnv(spec);
  // The device plugin picks the node's GPUs and sets NVIDIA_VISIBLE_DEVICES
  // for them; the allocation's UUIDs would name GPUs of another node (or,
  // with the NVIDIA runtime's environment strategy, expose GPUs the pod was
  // not given).
  if (spec.allocation.has_value() && !spec.allocation->gpus.empty()) {
    engine_env.erase("NVIDIA_VISIBLE_DEVICES");
  }
  // Whom it runs as: run_as, else the launcher's own ids, never the
  // image's user (root in most images).
  const RunAs identity = ContainerRunAs(spec);
  // The runtime's HOME for a uid the image does not know is "/", read-only.
  engine_env.emplace("HOME", ContainerHome(spec, identity.uid));
  json env = json::array();
  for (const auto& [name, value] : engine_env) {
    json var = json::object();
    var["name"] = name;
    var["value"] = NoExpansion(value);
    env.push_back(var);
  }
  if (!env.empty()) container["env"] = env;
  if (!spec.working_dir.empty()) container["workingDir"] = spec.working_dir;
  // spec.pids_limit has no per-pod field (Check refuses one): the kubelet's
  // podPidsLimit caps a pod.
  json resources = Resources(spec, options);
  if (!resources.empty()) container["resources"] = resources;
  json security = json::object();
  security["allowPrivilegeEscalation"] = false;
  security["readOnlyRootFilesystem"] = true;
  json capabilities = json::object({{"drop", json::array({"ALL"})}});
  const std::vector<std::string> caps = ContainerCapabilities(identity.uid);
  if (!caps.empty()) capabilities["add"] = caps;
  security["capabilities"] = capabilities;
  container["securityContext"] = security;

  json volumes = json::array();
  json mounts = json::array();
  auto add_volume = [&](const std::string& name, json source_field, const std::string& source_kind,
                        const std::string& target, bool read_only) {
    json volume = json::object();
    volume["name"] = name;
    volume[source_kind] = std::move(source_field);
    volumes.push_back(volume);
    json mount = json::object();
    mount["name"] = name;
    mount["mountPath"] = target;
    if (read_only) mount["readOnly"] = true;
    mounts.push_back(mount);
  };
  bool tmp_mounted = false;
  for (size_t i = 0; i < spec.mounts.size(); ++i) {
    const Mount& m = spec.mounts[i];
    json host_path = json::object();
    host_path["path"] = m.source;
    // A type, so that the kubelet mounts only what is there: with none it
    // would make a missing path, as root, on its node. The launcher checked
    // the source here, on the pod's node (Check).
    std::error_code ignored;
    host_path["type"] = std::filesystem::is_directory(m.source, ignored) ? "Directory" : "File";
    add_volume(absl::StrCat("mount-", i), host_path, "hostPath", m.target, m.read_only);
    tmp_mounted |= m.target == "/tmp";
  }
  // What programs expect to write to on a read-only root.
  if (!tmp_mounted) add_volume("tmp", json::object(), "emptyDir", "/tmp", false);
  container["volumeMounts"] = mounts;

  json pod = json::object();
  pod["restartPolicy"] = "Never";  // the launcher's supervisor restarts
  // A training container has no business with the API server.
  pod["automountServiceAccountToken"] = false;
  pod["containers"] = json::array({container});
  pod["volumes"] = volumes;
  // The identity numeric, so that the image needs no passwd entry;
  // runAsNonRoot makes the kubelet refuse to start another uid as root
  // anyway. The runtime's default seccomp profile: the "restricted" Pod
  // Security Standard refuses a pod without one (Unconfined).
  json pod_security = json::object();
  pod_security["runAsUser"] = identity.uid;
  pod_security["runAsGroup"] = identity.gid;
  if (identity.uid != 0) pod_security["runAsNonRoot"] = true;
  pod_security["seccompProfile"] = json::object({{"type", "RuntimeDefault"}});
  pod["securityContext"] = pod_security;
  // The allocation decided the node (ARCHITECTURE: a launcher never decides
  // placement); nodeName binds the pod there without the scheduler.
  if (spec.allocation.has_value() && !spec.allocation->node.empty()) {
    pod["nodeName"] = spec.allocation->node;
  }
  return pod;
}


// Waiting reasons after which the container never starts by itself.
bool StuckWaiting(const std::string& reason) {
  return reason == "ImagePullBackOff" || reason == "InvalidImageName" ||
         reason == "ErrImageNeverPull" || reason == "CreateContainerConfigError" ||
         reason == "CreateContainerError";
}

// How the pod's container ended, or nullopt while it has not.
std::optional<ExitStatus> PodExit(const json& pod, bool stopped_by_us) {
  const json& status = JsonField(pod, "status");
  const std::string phase = JsonValue<std::string>(status, "phase", "");
  const json& statuses = JsonField(status, "containerStatuses");
  const json first = statuses.is_array() && !statuses.empty() ? statuses[0] : json();
  const json& state = JsonField(first, "state");
  const json& terminated = JsonField(state, "terminated");
  if (terminated.is_object()) {
    ExitStatus exit;
    exit.code = JsonValue(terminated, "exitCode", 0);
    exit.signal = JsonValue(terminated, "signal", 0);
    if (JsonValue<std::string>(terminated, "reason", "") == "OOMKilled") {
      exit.reason = ExitReason::kOomKilled;
      if (exit.signal == 0) exit.signal = 9;
    } else if (exit.signal != 0) {
      exit.reason = ExitReason::kSignaled;
    } else if (stopped_by_us && exit.code > 128 && exit.code < 128 + 65) {
      // As with Docker: 128+N is signal N only when we sent one.
      exit.reason = ExitReason::kSignaled;
      exit.signal = exit.code - 128;
    }
    return exit;
  }
  if (phase == "Failed" || phase == "Unknown" ||
      StuckWaiting(JsonValue<std::string>(JsonField(state, "waiting"), "reason", ""))) {
    ExitStatus lost;
    lost.reason = ExitReason::kLost;
    return lost;
  }
  return std::nullopt;
}

// "123456Ki" and the like as bytes (metrics-server's memory).
uint64_t ParseMemoryQuantity(const std::string& q) {
  static const std::pair<const char*, double> kSuffixes[] = {
      {"Ki", 1024.0}, {"Mi", 1048576.0}, {"Gi", 1073741824.0}, {"Ti", 1099511627776.0},
      {"k", 1e3},     {"M", 1e6},        {"G", 1e9},           {"T", 1e12}};
  for (const auto& [suffix, factor] : kSuffixes) {
    if (absl::EndsWith(q, suffix)) {
      double v = 0;
      return absl::SimpleAtod(q.substr(0, q.size() - strlen(suffix)), &v)
                 ? static_cast<uint64_t>(v * factor)
                 : 0;
    }
  }
  double v = 0;
  return absl::SimpleAtod(q, &v) ? static_cast<uint64_t>(v) : 0;
}

class KubernetesRun : public Run {
 public:
  KubernetesRun(std::shared_ptr<HttpClient> http, std::string namespace_, bool job,
                std::string name, std::chrono::milliseconds poll)
      : http_(std::move(http)), ns_(std::move(namespace_)), job_(job), name_(std::move(name)),
        poll_(poll) {
    if (!job_) pod_ = name_;
  }

  std::string id() const override { return job_ ? "job/" + name_ : name_; }

  absl::StatusOr<std::optional<ExitStatus>> Wait(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      absl::StatusOr<std::optional<ExitStatus>> exit = Poll();
      std::unique_lock<std::mutex> lock(mu_);
      const auto now = Clock::now();
      if (!exit.ok()) {
        // One failed GET (a 503, a timeout) used to end a healthy pod as
        // lost, and the supervisor deleted it.
        if (!silence_.Tolerates(now)) return exit.status();
      } else {
        silence_.Answered();
        if (exit->has_value()) return exit;
      }
      if (now >= deadline) return std::optional<ExitStatus>();
      // A Stop wakes it to look again at once.
      wake_.wait_until(lock, std::min(deadline, now + poll_));
    }
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    // Deleting is the only way to stop a pod, and takes its logs with it.
    Logs().IgnoreError();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    if (job_) {
      // Orphan the pod first, so that the job controller does not replace it
      // and the pod gets our grace instead of the garbage collector's.
      DEEPNEX_RETURN_IF_ERROR(Delete(JobPath() + "?propagationPolicy=Orphan"));
    }
    DEEPNEX_ASSIGN_OR_RETURN(std::string pod, PodName());
    if (!pod.empty()) {
      const int64_t seconds = (grace.count() + 999) / 1000;
      DEEPNEX_RETURN_IF_ERROR(Delete(absl::StrCat(PodPath(pod), "?gracePeriodSeconds=", seconds)));
    }
    wake_.notify_all();
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Logs() override {
    DEEPNEX_ASSIGN_OR_RETURN(std::string pod, PodName());
    if (pod.empty()) return std::string();
    absl::StatusOr<HttpResponse> r = http_->Send("GET", PodPath(pod) + "/log");
    if (!r.ok()) return r.status();
    std::lock_guard<std::mutex> lock(mu_);
    if (r->status == 200) {
      logs_ = r->body;
    } else if (r->status != 404 && r->status != 400) {
      // 404: the pod is gone (after Stop): what was read last is all there
      // is. 400: its container has not started yet.
      return http_->ErrorFor("GET", PodPath(pod) + "/log", *r);
    }
    return logs_;
  }

  absl::StatusOr<launch::Usage> Usage() override {
    launch::Usage usage;
    DEEPNEX_ASSIGN_OR_RETURN(std::string pod, PodName());
    if (pod.empty()) return usage;
    const std::string path =
        absl::StrCat("/apis/metrics.k8s.io/v1beta1/namespaces/", ns_, "/pods/", pod);
    absl::StatusOr<HttpResponse> r = http_->Send("GET", path);
    if (!r.ok()) return r.status();
    // Without a metrics server (404, 503) there is nothing to see.
    if (r->status != 200) return usage;
    const json metrics = json::parse(r->body, nullptr, false);
    const json& containers = JsonField(metrics, "containers");
    if (!containers.is_array() || containers.empty()) return usage;
    usage.memory = ParseMemoryQuantity(
        JsonValue<std::string>(JsonField(containers[0], "usage"), "memory", ""));
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = std::max(peak_, usage.memory);
    usage.memory_peak = peak_;
    return usage;
  }

  absl::Status Remove() override {
    if (job_) return Delete(JobPath() + "?propagationPolicy=Background&gracePeriodSeconds=0");
    return Delete(PodPath(pod_) + "?gracePeriodSeconds=0");
  }

 private:
  std::string PodPath(const std::string& pod) const {
    return absl::StrCat("/api/v1/namespaces/", ns_, "/pods/", pod);
  }
  std::string JobPath() const {
    return absl::StrCat("/apis/batch/v1/namespaces/", ns_, "/jobs/", name_);
  }

  // DELETE that counts "already gone" as done.
  absl::Status Delete(const std::string& path) {
    absl::StatusOr<HttpResponse> r = http_->Send("DELETE", path);
    if (!r.ok()) return r.status();
    if (r->status == 404 || (r->status >= 200 && r->status < 300)) return absl::OkStatus();
    return http_->ErrorFor("DELETE", path, *r);
  }

  // The run's pod; for a job, its pod once the job controller made it
  // (empty before).
  absl::StatusOr<std::string> PodName() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!pod_.empty()) return pod_;
    }
    DEEPNEX_ASSIGN_OR_RETURN(
        std::string listed,
        http_->Call("GET", absl::StrCat("/api/v1/namespaces/", ns_, "/pods?labelSelector=",
                                        UrlEncode("job-name=" + name_))));
    const json list = json::parse(listed, nullptr, false);
    const json& items = JsonField(list, "items");
    if (!items.is_array() || items.empty()) return std::string();
    std::lock_guard<std::mutex> lock(mu_);
    pod_ = JsonValue<std::string>(JsonField(items[0], "metadata"), "name", "");
    return pod_;
  }

  absl::StatusOr<std::optional<ExitStatus>> Poll() {
    bool stopped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (result_.has_value()) return result_;
      stopped = stopped_;
    }
    std::optional<ExitStatus> exit;
    DEEPNEX_ASSIGN_OR_RETURN(std::string pod, PodName());
    if (!pod.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(HttpResponse r, http_->Send("GET", PodPath(pod)));
      if (r.status == 200) {
        exit = PodExit(json::parse(r.body, nullptr, false), stopped);
      } else if (r.status != 404) {
        return http_->ErrorFor("GET", PodPath(pod), r);
      } else if (stopped) {
        // Deleted by our Stop before its last status could be read.
        exit = ExitStatus{ExitReason::kSignaled, 0, 15};
      } else {
        exit = ExitStatus{ExitReason::kLost};  // deleted by someone else
      }
    } else if (stopped) {
      exit = ExitStatus{ExitReason::kSignaled, 0, 15};  // a job stopped before its pod came
    } else {
      // A job whose pod is not there (yet): pending, unless the job failed
      // without one or is gone.
      absl::StatusOr<HttpResponse> j = http_->Send("GET", JobPath());
      if (!j.ok()) return j.status();
      if (j->status == 404) {
        exit = ExitStatus{ExitReason::kLost};
      } else if (j->status != 200) {
        return http_->ErrorFor("GET", JobPath(), *j);
      } else {
        const json job = json::parse(j->body, nullptr, false);
        const json& conditions = JsonField(JsonField(job, "status"), "conditions");
        for (const json& c : conditions.is_array() ? conditions : json::array()) {
          if (JsonValue<std::string>(c, "type", "") == "Failed" &&
              JsonValue<std::string>(c, "status", "") == "True") {
            exit = ExitStatus{ExitReason::kLost};
          }
        }
      }
    }
    if (exit.has_value()) {
      std::lock_guard<std::mutex> lock(mu_);
      result_ = exit;
    }
    return exit;
  }

  const std::shared_ptr<HttpClient> http_;
  const std::string ns_;
  const bool job_;
  const std::string name_;  // the pod's or the job's
  const std::chrono::milliseconds poll_;

  std::mutex mu_;
  std::condition_variable wake_;
  std::string pod_;
  bool stopped_ = false;
  EngineSilence silence_;
  std::optional<ExitStatus> result_;
  std::string logs_;
  uint64_t peak_ = 0;
};

class KubernetesBackend : public Backend {
 public:
  KubernetesBackend(std::shared_ptr<HttpClient> http, std::string namespace_,
                    KubernetesOptions options)
      : http_(std::move(http)), ns_(std::move(namespace_)), options_(std::move(options)) {}

  absl::Status Check(const ContainerSpec& spec) override {
    if (spec.image.empty() || spec.image == "host" || spec.image[0] == '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.image: \"", spec.image, "\": kubernetes runs an image reference, not a directory"));
    }
    if (spec.network_none) {
      return absl::InvalidArgumentError(
          "spec.network_none: a kubernetes pod cannot run without a network");
    }
    // The launcher checked each mount's source here (its allowed roots, its
    // symlinks); the kubelet resolves a hostPath on the pod's node. A pod
    // the scheduler places could land on any node, where the path could be
    // anything (another user's files, or nothing, which the kubelet made).
    if (!spec.mounts.empty() && (!spec.allocation.has_value() || spec.allocation->node.empty())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.mounts[0]: ", QuotedPath(spec.mounts[0].source),
          ": host mounts need the pod on the "
          "launcher's host, where their paths were checked, but this pod has no allocation "
          "naming its node and the scheduler could put it on any node"));
    }
    if (!spec.mounts.empty() && spec.allocation.has_value() && !spec.allocation->node.empty() &&
        spec.allocation->node != HostName()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "spec.mounts: the pod runs on node \"", spec.allocation->node,
          "\", whose kubelet would resolve the host paths there, but they were checked on this "
          "host (\"", HostName(), "\"); host mounts need the pod on the launcher's host"));
    }
    if (!ValidLabelValue(spec.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.name: \"", spec.name, "\" is no kubernetes label value "
          "(at most 63 characters, a letter or digit at both ends)"));
    }
    for (const auto& [key, value] : spec.labels) {
      if (!ValidLabelKey(key) || !ValidLabelValue(value)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.labels: \"", key, "=", value, "\" is no kubernetes label"));
      }
      // The job controller's own labels: a pod carrying another job's
      // job-name would be taken for that job's pod.
      if (key == "job-name" || key == "controller-uid" ||
          absl::StartsWith(key, "batch.kubernetes.io/")) {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.labels: \"", key, "\" is set by Kubernetes' job controller"));
      }
    }
    // What a pod's manifest cannot say is refused, not dropped.
    if (spec.pids_limit > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.pids_limit: ", spec.pids_limit,
          ": a pod's process limit is the kubelet's (podPidsLimit), not the pod's"));
    }
    if (spec.host_network) {
      return absl::InvalidArgumentError(
          "spec.host_network: true: the kubernetes backend runs pods on the pod network");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Run>> Start(const ContainerSpec& spec,
                                             const RunContext& context) override {
    const std::string name = ObjectName(context.run_name);
    const bool job = options_.kind == "job";
    const std::string path = job ? absl::StrCat("/apis/batch/v1/namespaces/", ns_, "/jobs")
                                 : absl::StrCat("/api/v1/namespaces/", ns_, "/pods");
    json manifest = json::parse(KubernetesManifest(spec, context, options_, name, ns_));
    // Marks this create as ours: a POST the client retried after its answer
    // was lost may have made the object already, and the retry's 409 must
    // tell that apart from another object of the name (a leftover of a
    // launcher that had this id before).
    const std::string token = RandomHex(16);
    manifest["metadata"]["annotations"] = json::object({{kCreateAnnotation, token}});
    absl::Status created = Create(path, name, manifest.dump(), token, context.labels);
    if (!created.ok()) {
      // The create may have made the object all the same (an answer lost,
      // a timeout): left, it would run unwatched and hold the name. Not when
      // the name is another's.
      if (!absl::IsAlreadyExists(created)) {
        KubernetesRun(http_, ns_, job, name, options_.poll).Remove().IgnoreError();
      }
      return created;
    }
    return std::unique_ptr<Run>(new KubernetesRun(http_, ns_, job, name, options_.poll));
  }

  absl::StatusOr<int> Cleanup(const std::string& launcher_id) override {
    const std::string selector = absl::StrCat("deepnex.launcher=", launcher_id);
    DEEPNEX_ASSIGN_OR_RETURN(
        int jobs, DeleteListed(absl::StrCat("/apis/batch/v1/namespaces/", ns_, "/jobs"), selector,
                               "propagationPolicy=Background&gracePeriodSeconds=0"));
    // Pods of those jobs go with them; the rest, a job's pod too (a Stop
    // that failed after orphaning it from its job left it), here.
    DEEPNEX_ASSIGN_OR_RETURN(
        int pods, DeleteListed(absl::StrCat("/api/v1/namespaces/", ns_, "/pods"), selector,
                               "gracePeriodSeconds=0"));
    return jobs + pods;
  }

 private:
  // POSTs `manifest` to `collection`. A 409 is this create's own object
  // when the object of that name carries `token` and the run's labels: an
  // earlier try, retried by the client, made it.
  absl::Status Create(const std::string& collection, const std::string& name,
                      const std::string& manifest, const std::string& token,
                      const std::map<std::string, std::string>& labels) {
    absl::StatusOr<HttpResponse> r = http_->Send("POST", collection, manifest);
    if (!r.ok()) return r.status();
    if (r->status >= 200 && r->status < 300) return absl::OkStatus();
    const absl::Status error = http_->ErrorFor("POST", collection, *r);
    if (r->status != 409) return error;
    absl::StatusOr<std::string> got = http_->Call("GET", collection + "/" + name);
    if (!got.ok()) return error;
    const json object = json::parse(*got, nullptr, false);
    const json& metadata = JsonField(object, "metadata");
    if (JsonValue<std::string>(JsonField(metadata, "annotations"), kCreateAnnotation, "") != token) {
      return error;
    }
    for (const auto& [key, value] : labels) {
      if (JsonValue<std::string>(JsonField(metadata, "labels"), key, "") != value) return error;
    }
    return absl::OkStatus();
  }

  // Deletes every object under `collection` that `selector` picks.
  absl::StatusOr<int> DeleteListed(const std::string& collection, const std::string& selector,
                                   const std::string& options) {
    DEEPNEX_ASSIGN_OR_RETURN(
        std::string listed,
        http_->Call("GET", collection + "?labelSelector=" + UrlEncode(selector)));
    const json list = json::parse(listed, nullptr, false);
    const json& items = JsonField(list, "items");
    int deleted = 0;
    for (const json& item : items.is_array() ? items : json::array()) {
      const std::string name = JsonValue<std::string>(JsonField(item, "metadata"), "name", "");
      if (name.empty()) continue;
      const std::string path = absl::StrCat(collection, "/", name, "?", options);
      absl::StatusOr<HttpResponse> r = http_->Send("DELETE", path);
      if (!r.ok()) return r.status();
      if (r->status == 404) continue;  // gone meanwhile
      if (r->status < 200 || r->status >= 300) return http_->ErrorFor("DELETE", path, *r);
      ++deleted;
    }
    return deleted;
  }

  const std::shared_ptr<HttpClient> http_;
  const std::string ns_;
  const KubernetesOptions options_;
};

}  // namespace

std::string KubernetesManifest(const ContainerSpec& spec, const RunContext& context,
                               const KubernetesOptions& options, const std::string& name,
                               const std::string& namespace_) {
  json metadata = json::object();
  metadata["name"] = name;
  metadata["namespace"] = namespace_;
  metadata["labels"] = context.labels;
  json manifest = json::object();
  if (options.kind == "job") {
    json template_metadata = json::object();
    template_metadata["labels"] = context.labels;
    json pod_template = json::object();
    pod_template["metadata"] = template_metadata;
    pod_template["spec"] = PodSpec(spec, options);
    json job = json::object();
    job["backoffLimit"] = 0;  // one pod; the launcher's supervisor restarts
    job["template"] = pod_template;
    manifest["apiVersion"] = "batch/v1";
    manifest["kind"] = "Job";
    manifest["spec"] = job;
  } else {
    manifest["apiVersion"] = "v1";
    manifest["kind"] = "Pod";
    manifest["spec"] = PodSpec(spec, options);
  }
  manifest["metadata"] = metadata;
  return manifest.dump();
}

absl::StatusOr<std::unique_ptr<Backend>> MakeKubernetesBackend(const LauncherOptions& options) {
  const KubernetesOptions& o = options.kubernetes;
  if (o.kind != "pod" && o.kind != "job") {
    return absl::InvalidArgumentError(
        absl::StrCat("kubernetes.kind: \"", o.kind, "\" is neither \"pod\" nor \"job\""));
  }
  if (o.poll.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kubernetes.poll: ", o.poll.count(), " ms is not positive"));
  }
  DEEPNEX_ASSIGN_OR_RETURN(ApiConfig config, ResolveConfig(o));
  // It goes into every URL: a '/' or '?' in it would name another path.
  if (!IsDns1123Label(config.namespace_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kubernetes namespace \"", config.namespace_, "\" is not a DNS-1123 label "
        "(lowercase letters, digits and '-', a letter or digit at both ends, at most 63)"));
  }
  // One cheap call that needs the token: a wrong one shows now, as
  // Unauthenticated, not at the first Start. Tried once: a server that
  // does not answer is the caller's to hear about now.
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<HttpClient> prober, HttpClient::Create(config.http));
  absl::StatusOr<std::string> probe = prober->Call(
      "GET", absl::StrCat("/api/v1/namespaces/", config.namespace_, "/pods?limit=1"));
  if (absl::IsUnavailable(probe.status()) || absl::IsDeadlineExceeded(probe.status())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kubernetes: the API server at ", config.http.endpoint,
        " does not answer: ", probe.status().message()));
  }
  DEEPNEX_RETURN_IF_ERROR(probe.status());
  // Every later call rides out a busy or restarting API server for as long
  // as a run's Wait does (EngineSilence), not failing a start or a restart
  // on one 429 or 503.
  config.http.retry_for = EngineSilence::kFor;
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<HttpClient> client, HttpClient::Create(config.http));
  return std::unique_ptr<Backend>(new KubernetesBackend(
      std::shared_ptr<HttpClient>(std::move(client)), config.namespace_, o));
}

}  // namespace deepnex::launch
