// launch_bench: start-to-running and start-to-exit latency of a trivial
// container (`true`), per launch backend, beside the same container started
// by hand with plain `runc run`, in one run and interleaved.
//
//   launch_bench [--n 20] [--backends process,oci,docker,slurm] [--csv FILE]
//                [--docker-socket PATH] [--docker-image REF] [--slurm-conf FILE]
//                [--via-agent [--central-listen HOST:PORT] [--agent-on WRAPPER]]
//
// --via-agent adds these rows: the process backend through deepnex-central's
// own launcher, and through deepnex-central (in this process, listening on
// --central-listen, default 127.0.0.1:0) and a deepnex-agent process (the
// deepnex-agent next to this binary, run under --agent-on, e.g. a simulated
// host's on-h2 wrapper, so that its stream crosses hosts): running when
// StartContainer returns (the agent answers once its launcher started it),
// exit when central lists it exited (polled every millisecond). Its ratio
// column compares it with the local process backend (target: within 1.3x).
// A third row, process/granted, is the local process backend with the spec
// central gives the container (the grant's 1 CPU and 64 MiB as cgroup
// limits, no GPU device allowed, the bench user's uid): the agent's row
// against it is what central and the agent add, without the limits' cost.
// launch_bench_hosts.py runs it so, central on h1 and the agent on h2.
//
// Each round starts one container per backend, then one by hand: the peer is
// `runc run --pid-file` fork/exec'ed on a bundle whose config.json is the one
// the oci backend wrote (copied from a container of its own, with a fresh
// cgroup per run), so it does the same work minus deepnex. Running: when
// Start returns with the state running (the peer: when runc writes the pid
// file); exit: when Wait returns (the peer: when `runc run` exits).
// docker and slurm run when given their socket / slurm.conf (flags, or
// DEEPNEX_DOCKER_SOCKET / SLURM_CONF), else they are skipped with the reason.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "deepnex/gpu/central.h"
#include "deepnex/launch/central.h"
#include "deepnex/launch/launcher.h"

using deepnex::launch::ContainerSpec;
using deepnex::launch::Launcher;
using deepnex::launch::LauncherOptions;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

extern char** environ;

namespace {

constexpr char kPeer[] = "runc (plain)";
constexpr char kViaAgent[] = "process/agent";
constexpr char kViaCentral[] = "process/central";
constexpr char kGranted[] = "process/granted";
// AgentRunner's user, node and grant.
constexpr char kBenchUser[] = "bench";
constexpr char kBenchNode[] = "bench";
constexpr int kGrantCpus = 1;
constexpr uint64_t kGrantMemory = 64 << 20;

struct Flags {
  int n = 20;
  std::vector<std::string> backends = {"process", "oci", "docker", "slurm"};
  std::string csv;
  std::string docker_socket;
  std::string docker_image = "localhost/busybox:latest";
  std::string slurm_conf;
  bool via_agent = false;
  std::string central_listen = "127.0.0.1:0";
  std::string agent_on;  // a command prefix for deepnex-agent (space-separated)
};

struct Sample {
  double running_ms = 0;
  double exit_ms = 0;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * (v.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - lo);
}

std::string Env(const char* name) {
  const char* v = getenv(name);
  return v == nullptr ? "" : v;
}

// posix_spawnp of argv with stdin /dev/null and stdout and stderr into
// `log`; the errno value, 0 when it started.
int SpawnLogged(std::vector<std::string> argv, const std::string& log, pid_t* pid) {
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  const int rc = posix_spawnp(pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return rc;
}

// Central runs users' containers only as their mapped, unprivileged
// identity: the bench user's is this process's own when it is not root.
deepnex::launch::RunAs BenchIdentity() {
  const bool root = geteuid() == 0;
  return {root ? 65534u : geteuid(), root ? 65534u : getegid(), kBenchUser, "/"};
}

// One backend through the public Launcher API.
class BackendRunner {
 public:
  // `granted`: the spec central gives a container of AgentRunner's grant
  // (its CPUs and memory as limits, its GPUs, none, as the only ones
  // allowed, run as the bench user), so that the rows through central
  // compare with the same work done locally.
  static std::optional<BackendRunner> Make(const std::string& backend, const Flags& flags,
                                           const std::string& state_dir, std::string* why,
                                           bool granted = false) {
    LauncherOptions options;
    options.backend = backend;
    options.state_dir = state_dir + "/" + backend + (granted ? "-granted" : "");
    options.cgroup_parent = "deepnex-launch-bench";
    ContainerSpec spec;
    spec.command = {"true"};
    if (granted) {
      deepnex::gpu::Allocation a;
      a.user = kBenchUser;
      a.node = kBenchNode;
      a.cpus = kGrantCpus;
      a.memory = kGrantMemory;
      spec.cpus = a.cpus;
      spec.memory = a.memory;
      spec.allocation = a;
      spec.run_as = BenchIdentity();
    }
    if (backend == "docker") {
      options.docker.socket =
          !flags.docker_socket.empty() ? flags.docker_socket : Env("DEEPNEX_DOCKER_SOCKET");
      if (options.docker.socket.empty()) {
        *why = "no --docker-socket (or DEEPNEX_DOCKER_SOCKET) given";
        return std::nullopt;
      }
      spec.image = flags.docker_image;
    }
    if (backend == "slurm") {
      const std::string conf = !flags.slurm_conf.empty() ? flags.slurm_conf : Env("SLURM_CONF");
      if (conf.empty()) {
        *why = "no --slurm-conf (or SLURM_CONF) given";
        return std::nullopt;
      }
      options.slurm.env["SLURM_CONF"] = conf;
    }
    fs::create_directories(options.state_dir);
    absl::StatusOr<std::unique_ptr<Launcher>> launcher = Launcher::Create(options);
    if (!launcher.ok()) {
      *why = std::string(launcher.status().message());
      return std::nullopt;
    }
    return BackendRunner(std::move(*launcher), std::move(spec), options.state_dir);
  }

  absl::StatusOr<Sample> Once(int i) {
    ContainerSpec spec = spec_;
    spec.name = "bench" + std::to_string(i);
    Sample s;
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<std::shared_ptr<deepnex::launch::Handle>> h = launcher_->Start(spec);
    if (!h.ok()) return h.status();
    // A backend may report running a moment after Start returns.
    while ((*h)->Status().state == deepnex::launch::State::kStarting) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    s.running_ms = Ms(Clock::now() - t0);
    absl::StatusOr<deepnex::launch::ExitStatus> e = (*h)->Wait(std::chrono::seconds(60));
    if (!e.ok()) return e.status();
    s.exit_ms = Ms(Clock::now() - t0);
    if (!e->ok()) {
      return absl::InternalError(spec.name + " ended " + e->ToString());
    }
    absl::Status removed = launcher_->Remove(spec.name);
    if (!removed.ok()) return removed;
    return s;
  }

  // The config.json the backend writes for `spec` (oci): read from the
  // bundle of a container kept running while it is looked for. The files it
  // bind-mounts from the container's directory (its /etc/passwd) are copied
  // under `keep`, as they go with the container.
  absl::StatusOr<std::string> BundleConfig(const std::string& keep) {
    ContainerSpec spec = spec_;
    spec.name = "bundle-probe";
    spec.command = {"sleep", "60"};
    absl::StatusOr<std::shared_ptr<deepnex::launch::Handle>> h = launcher_->Start(spec);
    if (!h.ok()) return h.status();
    std::string found;
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(state_dir_)) {
      if (e.path().filename() == "config.json" &&
          e.path().string().find("bundle-probe") != std::string::npos) {
        std::ifstream in(e.path());
        std::stringstream ss;
        ss << in.rdbuf();
        found = ss.str();
      }
    }
    if (!found.empty()) {
      nlohmann::json config = nlohmann::json::parse(found);
      fs::create_directories(keep);
      int n = 0;
      for (auto& m : config["mounts"]) {
        const std::string source = m.value("source", "");
        if (source.rfind(state_dir_, 0) != 0 || !fs::is_regular_file(source)) continue;
        const std::string copy = keep + "/" + std::to_string(n++) + "-" +
                                 fs::path(source).filename().string();
        fs::copy_file(source, copy, fs::copy_options::overwrite_existing);
        m["source"] = copy;
      }
      found = config.dump();
    }
    (*h)->Stop(std::chrono::milliseconds(100)).IgnoreError();
    (*h)->Wait(std::chrono::seconds(30)).IgnoreError();
    launcher_->Remove(spec.name).IgnoreError();
    if (found.empty()) return absl::NotFoundError("no config.json of bundle-probe under " + state_dir_);
    return found;
  }

 private:
  BackendRunner(std::unique_ptr<Launcher> launcher, ContainerSpec spec, std::string state_dir)
      : launcher_(std::move(launcher)), spec_(std::move(spec)), state_dir_(std::move(state_dir)) {}

  std::shared_ptr<Launcher> launcher_;
  ContainerSpec spec_;
  std::string state_dir_;
};

// `runc run` by hand on a bundle with the oci backend's config.
class PlainRunc {
 public:
  PlainRunc(std::string dir, std::string config) : dir_(std::move(dir)) {
    config_ = nlohmann::json::parse(config);
    config_["process"]["args"] = {"true"};
    config_["annotations"] = nlohmann::json::object();
    fs::create_directories(dir_ + "/root");
  }

  absl::StatusOr<Sample> Once(int i) {
    const std::string id = "launch-bench-plain-" + std::to_string(getpid()) + "-" + std::to_string(i);
    const std::string bundle = dir_ + "/" + id;
    fs::create_directories(bundle);
    config_["linux"]["cgroupsPath"] = "deepnex-launch-bench/" + id;
    config_["hostname"] = id.substr(0, 63);
    std::ofstream(bundle + "/config.json") << config_.dump(1);
    const std::string pid_file = bundle + "/pid";
    int inotify = inotify_init1(IN_CLOEXEC);
    inotify_add_watch(inotify, bundle.c_str(), IN_MOVED_TO | IN_CREATE);
    std::vector<std::string> argv = {"runc",     "--root",     dir_ + "/root", "run",
                                     "--bundle", bundle,       "--pid-file",   pid_file, id};
    Sample s;
    const Clock::time_point t0 = Clock::now();
    pid_t pid;
    const int rc = SpawnLogged(argv, bundle + "/log", &pid);
    if (rc != 0) {
      close(inotify);
      return absl::InternalError(std::string("runc: ") + strerror(rc));
    }
    bool exited = false;
    int status = 0;
    while (access(pid_file.c_str(), F_OK) != 0) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        break;
      }
      // The pid file, or at the latest 1 ms later a look at whether runc failed.
      struct pollfd p = {inotify, POLLIN, 0};
      char buf[4096];
      if (poll(&p, 1, 1) > 0) read(inotify, buf, sizeof buf);
    }
    s.running_ms = Ms(Clock::now() - t0);
    if (!exited) waitpid(pid, &status, 0);
    s.exit_ms = Ms(Clock::now() - t0);
    close(inotify);
    std::stringstream log;
    log << std::ifstream(bundle + "/log").rdbuf();
    std::error_code ec;
    fs::remove_all(bundle, ec);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      return absl::InternalError("plain runc run of " + id + " failed with wait status " +
                                 std::to_string(status) + ": " + log.str());
    }
    return s;
  }

 private:
  std::string dir_;
  nlohmann::json config_;
};

// The process backend through deepnex-central and one deepnex-agent
// process, or (`agent` false) central's own launcher, on a node declared to
// it: what the agent's hop costs beside what central's service costs.
class AgentRunner {
 public:
  static absl::StatusOr<std::unique_ptr<AgentRunner>> Make(const std::string& state_dir,
                                                          bool agent, const Flags& flags) {
    auto r = std::unique_ptr<AgentRunner>(new AgentRunner);
    LauncherOptions local;
    local.state_dir = state_dir + (agent ? "/central" : "/central-local");
    fs::create_directories(local.state_dir);
    deepnex::launch::ContainerPolicy policy;
    policy.users[kBenchUser] = BenchIdentity();
    deepnex::gpu::CentralServerOptions server;
    server.address = flags.central_listen;
    DEEPNEX_ASSIGN_OR_RETURN(r->central_,
                             deepnex::launch::CreateCentralServer(server, local, policy));
    if (agent) {
      const std::string dir = state_dir + "/agent";
      fs::create_directories(dir);
      std::vector<std::string> argv;
      std::stringstream wrapper(flags.agent_on);
      for (std::string w; wrapper >> w;) argv.push_back(w);
      const std::string bin = fs::read_symlink("/proc/self/exe").parent_path() / "deepnex-agent";
      const std::string central = r->central_->address();
      for (const char* a : {bin.c_str(), "--central", central.c_str(), "--node",
                            kBenchNode, "--gpus", "0", "--cpus", "64", "--memory", "64GiB",
                            "--state-dir", dir.c_str()}) {
        argv.emplace_back(a);
      }
      const int rc = SpawnLogged(argv, dir + "/agent.log", &r->agent_pid_);
      if (rc != 0) {
        r->agent_pid_ = 0;
        return absl::InternalError(argv[0] + ": " + strerror(rc));
      }
      // Registered: its node is in central's allocator.
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
      while (!r->central_->allocator().GetNode(kBenchNode).ok()) {
        if (Clock::now() > deadline) {
          return absl::DeadlineExceededError(
              "deepnex-agent did not register within 10s; see " + dir + "/agent.log");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } else {
      deepnex::gpu::Node n;
      n.name = kBenchNode;
      n.cpus = 64;
      n.memory = 64ull << 30;
      DEEPNEX_RETURN_IF_ERROR(r->central_->allocator().AddNode(n));
    }
    deepnex::gpu::CentralClientOptions c;
    c.address = r->central_->address();
    DEEPNEX_ASSIGN_OR_RETURN(r->alloc_, deepnex::gpu::CentralClient::Create(c));
    DEEPNEX_ASSIGN_OR_RETURN(r->containers_, deepnex::launch::CentralClient::Create(c));
    return r;
  }

  ~AgentRunner() {
    if (agent_pid_ > 0) {
      kill(agent_pid_, SIGTERM);
      waitpid(agent_pid_, nullptr, 0);
    }
  }

  absl::StatusOr<Sample> Once(int i) {
    deepnex::gpu::Request req;
    req.user = kBenchUser;
    req.cpus = kGrantCpus;
    req.memory = kGrantMemory;
    req.node = kBenchNode;
    DEEPNEX_ASSIGN_OR_RETURN(deepnex::gpu::Allocation a, alloc_->Allocate(req));
    ContainerSpec spec;
    spec.name = "bench" + std::to_string(i);
    spec.command = {"true"};
    Sample s;
    const Clock::time_point t0 = Clock::now();
    DEEPNEX_RETURN_IF_ERROR(containers_->StartContainer(spec, a.id).status());
    s.running_ms = Ms(Clock::now() - t0);
    while (true) {
      DEEPNEX_ASSIGN_OR_RETURN(auto list, containers_->ListContainers());
      bool ended = false;
      for (const auto& c : list) {
        if (c.name == spec.name && c.state == deepnex::launch::State::kExited) ended = true;
      }
      if (ended) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    s.exit_ms = Ms(Clock::now() - t0);
    return s;
  }

 private:
  AgentRunner() = default;

  std::unique_ptr<deepnex::gpu::CentralServer> central_;
  pid_t agent_pid_ = 0;
  std::unique_ptr<deepnex::gpu::CentralClient> alloc_;
  std::unique_ptr<deepnex::launch::CentralClient> containers_;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        fprintf(stderr, "%s needs a value\n", a.c_str());
        exit(2);
      }
      return argv[++i];
    };
    if (a == "--n") {
      f.n = atoi(value().c_str());
    } else if (a == "--backends") {
      f.backends.clear();
      std::stringstream ss(value());
      for (std::string b; std::getline(ss, b, ',');) f.backends.push_back(b);
    } else if (a == "--csv") {
      f.csv = value();
    } else if (a == "--docker-socket") {
      f.docker_socket = value();
    } else if (a == "--docker-image") {
      f.docker_image = value();
    } else if (a == "--slurm-conf") {
      f.slurm_conf = value();
    } else if (a == "--via-agent") {
      f.via_agent = true;
    } else if (a == "--central-listen") {
      f.central_listen = value();
    } else if (a == "--agent-on") {
      f.agent_on = value();
    } else {
      fprintf(stderr,
              "usage: launch_bench [--n 20] [--backends process,oci,docker,slurm] [--csv FILE]\n"
              "                    [--docker-socket PATH] [--docker-image REF] [--slurm-conf FILE]\n"
              "                    [--via-agent [--central-listen HOST:PORT] [--agent-on WRAPPER]]\n");
      exit(2);
    }
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  char tmpl[] = "/tmp/deepnex-launch-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;

  // Backends in the order given, then the peer.
  std::vector<std::string> names;
  std::map<std::string, BackendRunner> runners;
  std::optional<PlainRunc> peer;
  for (const std::string& b : flags.backends) {
    std::string why;
    std::optional<BackendRunner> r = BackendRunner::Make(b, flags, dir, &why);
    if (!r) {
      printf("skipping %s: %s\n", b.c_str(), why.c_str());
      continue;
    }
    if (b == "oci") {
      absl::StatusOr<std::string> config = r->BundleConfig(dir + "/plain-files");
      if (!config.ok()) {
        printf("skipping %s and %s: %s\n", b.c_str(), kPeer, config.status().ToString().c_str());
        continue;
      }
      peer.emplace(dir + "/plain", *config);
    }
    names.push_back(b);
    runners.emplace(b, std::move(*r));
  }
  if (peer) names.push_back(kPeer);
  std::unique_ptr<AgentRunner> via_agent, via_central;
  if (flags.via_agent) {
    std::string why;
    std::optional<BackendRunner> r = BackendRunner::Make("process", flags, dir, &why, true);
    if (r) {
      names.push_back(kGranted);
      runners.emplace(kGranted, std::move(*r));
    } else {
      printf("skipping %s: %s\n", kGranted, why.c_str());
    }
    for (bool agent : {false, true}) {
      const char* name = agent ? kViaAgent : kViaCentral;
      absl::StatusOr<std::unique_ptr<AgentRunner>> r = AgentRunner::Make(dir, agent, flags);
      if (r.ok()) {
        (agent ? via_agent : via_central) = std::move(*r);
        names.push_back(name);
      } else {
        printf("skipping %s: %s\n", name, r.status().ToString().c_str());
      }
    }
  }
  if (names.empty()) {
    printf("no backend can start here\n");
    return 1;
  }

  std::map<std::string, std::vector<Sample>> samples;
  std::map<std::string, std::string> failed;
  fprintf(stderr, "%d rounds of %zu:", flags.n, names.size());
  for (int i = 0; i < flags.n; ++i) {
    for (const std::string& name : names) {
      if (failed.count(name)) continue;
      absl::StatusOr<Sample> s = name == kPeer       ? peer->Once(i)
                                 : name == kViaAgent ? via_agent->Once(i)
                                 : name == kViaCentral ? via_central->Once(i)
                                                       : runners.find(name)->second.Once(i);
      if (!s.ok()) {
        failed[name] = s.status().ToString();
        continue;
      }
      samples[name].push_back(*s);
    }
    fprintf(stderr, " %d", i + 1);
  }
  fprintf(stderr, "\n");

  auto column = [&](const std::string& name, double Sample::*field) {
    std::vector<double> v;
    for (const Sample& s : samples[name]) v.push_back(s.*field);
    return v;
  };
  const double peer_run = peer ? Quantile(column(kPeer, &Sample::running_ms), 0.5) : 0;
  const double peer_exit = peer ? Quantile(column(kPeer, &Sample::exit_ms), 0.5) : 0;
  printf("\nlatency of a container running `true`, ms (n rounds, interleaved)\n");
  printf("%-14s %4s %10s %10s %10s %10s %11s %11s\n", "backend", "n", "run p50", "run p90",
         "exit p50", "exit p90", "run/runc", "exit/runc");
  for (const std::string& name : names) {
    if (failed.count(name)) printf("%s failed: %s\n", name.c_str(), failed[name].c_str());
    if (samples[name].empty()) continue;
    std::vector<double> run = column(name, &Sample::running_ms);
    std::vector<double> exit = column(name, &Sample::exit_ms);
    char ratio_run[32] = "-", ratio_exit[32] = "-";
    if (peer_run > 0) {
      snprintf(ratio_run, sizeof ratio_run, "%.2fx", Quantile(run, 0.5) / peer_run);
      snprintf(ratio_exit, sizeof ratio_exit, "%.2fx", Quantile(exit, 0.5) / peer_exit);
    }
    printf("%-14s %4zu %10.1f %10.1f %10.1f %10.1f %11s %11s\n", name.c_str(), run.size(),
           Quantile(run, 0.5), Quantile(run, 0.9), Quantile(exit, 0.5), Quantile(exit, 0.9),
           ratio_run, ratio_exit);
  }
  // The agent's row against the local backend (the target: within 1.3x),
  // the same with the grant's spec (what central adds, not the limits) and
  // central's own launcher (the agent's hop alone).
  for (const char* base : {"process", kGranted, kViaCentral}) {
    if (!via_agent || samples[kViaAgent].empty() || samples[base].empty()) continue;
    const double agent = Quantile(column(kViaAgent, &Sample::running_ms), 0.5);
    const double other = Quantile(column(base, &Sample::running_ms), 0.5);
    printf("%s / %s, start-to-running p50: %.2fx%s\n", kViaAgent, base, agent / other,
           std::string(base) == "process" ? " (target: within 1.3x)" : "");
  }
  if (!flags.csv.empty()) {
    std::ofstream csv(flags.csv);
    csv << "backend,round,start_to_running_ms,start_to_exit_ms\n";
    for (const std::string& name : names) {
      for (size_t i = 0; i < samples[name].size(); ++i) {
        csv << name << "," << i << "," << samples[name][i].running_ms << ","
            << samples[name][i].exit_ms << "\n";
      }
    }
  }
  runners.clear();
  via_agent.reset();
  via_central.reset();
  std::error_code ec;
  fs::remove_all(dir, ec);
  return failed.empty() ? 0 : 1;
}
