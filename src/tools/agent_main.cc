// deepnex-agent: runs one GPU server's containers for deepnex-central.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "deepnex/agent/agent.h"
#include "deepnex/launch/central.h"
#include "tools/daemon.h"

namespace {

constexpr char kUsage[] = R"(usage: deepnex-agent --central ADDR --node NAME (--token T | --token-file F)
                     [flags]

Registers this machine as node NAME with deepnex-central, heartbeats, and
runs the containers central starts on the node's allocations. The agent
dials central and keeps one stream open (so an agent behind a NAT works);
it dials again when the stream breaks. Prints "deepnex-agent: node NAME
registered with ADDR" once central accepted it (before that, with --listen,
"deepnex-agent: serving /healthz and /metrics on HOST:PORT"); stops on SIGINT/SIGTERM,
stopping its containers. Exits 1 when central refuses it (a token of
another node, a user's token).

flags:
  --central HOST:PORT     deepnex-central's address
  --node NAME             this node's name
  --token T               the node's token (a "TOKEN NAME node" line of
                          central's token file)
  --token-file F          a file holding that token alone
  --tls-ca F              verify central's TLS certificate against F
  --backend B             process (default), oci or docker
  --docker-socket S       the Docker Engine API socket of the docker backend
                          (default /var/run/docker.sock)
  --state-dir D           the containers' logs and records, where a killed
                          agent's successor finds the containers it left
                          running (default: DIR/NODE, DIR being systemd's
                          $STATE_DIRECTORY, else /var/lib/deepnex-agent as
                          root, else $XDG_STATE_HOME/deepnex-agent or
                          ~/.local/state/deepnex-agent)
  --gpus NxSIZE           offer N GPUs of SIZE each (e.g. 2x16GiB) instead
                          of those NVML finds; 0: none
  --cpus N                CPU cores to offer (default: this machine's)
  --memory SIZE           host memory to offer (default: this machine's)
  --labels k=v,...        the node's labels (for selectors)
  --image NAME=DIR        image NAME runs the rootfs directory DIR (or
                          "host") here: this node's own catalog, as a
                          kubelet's image store; deepnex-central lets users
                          name only the images of its own --image list
  --listen HOST:PORT      serve GET /healthz (200 while registered with
                          central, 503 otherwise) and GET /metrics (the
                          node's and its containers' usage, Prometheus text)
                          on HOST:PORT, as kubelet's port; port 0 picks one
  --metrics-token-file F  tokens that may read /metrics (a token alone, or
                          "TOKEN NAME ROLE" lines): a scraper sends
                          "Authorization: Bearer TOKEN". Without it, /metrics
                          (every user's containers) is served to no one
                          where the agent has a token
  --advertise HOST        the host of this node that peers dial (a job's
                          addresses on it); default: this host's address on
                          the route to central
  --help                  show this text
)";

// A directory that outlives the agent, as kubelet's /var/lib/kubelet: on a
// temporary one, a killed agent's successor found none of the containers it
// left running, and central regranted their GPUs while they ran on. One per
// node, so that agents of simulated hosts on one machine do not share one.
std::string DefaultStateDir(deepnex::tools::Flags& flags, const std::string& node) {
  if (node.empty() || node == "." || node == ".." || node.find('/') != std::string::npos) {
    flags.Die(absl::StrCat("--node: \"", node, "\" is not a node name"));
  }
  const auto env = [](const char* name) {
    const char* value = std::getenv(name);
    return std::string(value != nullptr ? value : "");
  };
  // systemd's StateDirectory= may list several, colon-separated.
  std::string base = env("STATE_DIRECTORY");
  base = base.substr(0, base.find(':'));
  if (base.empty() && geteuid() == 0) base = "/var/lib/deepnex-agent";
  if (base.empty() && !env("XDG_STATE_HOME").empty()) {
    base = env("XDG_STATE_HOME") + "/deepnex-agent";
  }
  if (base.empty() && !env("HOME").empty()) base = env("HOME") + "/.local/state/deepnex-agent";
  if (base.empty()) flags.Die("--state-dir: give one (no HOME to keep the default under)");
  return absl::StrCat(base, "/", node);
}

}  // namespace

int main(int argc, char** argv) {
  deepnex::agent::AgentOptions options;
  deepnex::tools::Flags flags("deepnex-agent", kUsage, argc, argv);
  while (flags.Next()) {
    if (flags.Is("--central")) options.central = flags.Value();
    else if (flags.Is("--node")) options.node = flags.Value();
    else if (flags.Is("--token")) options.token = flags.Value();
    else if (flags.Is("--token-file")) options.token_file = flags.Value();
    else if (flags.Is("--tls-ca")) options.tls_ca_file = flags.Value();
    else if (flags.Is("--backend")) options.launcher.backend = flags.Value();
    else if (flags.Is("--state-dir")) {
      options.launcher.state_dir = flags.Value();
      if (options.launcher.state_dir.empty()) flags.Die("--state-dir: give a directory");
    }
    else if (flags.Is("--docker-socket")) options.launcher.docker.socket = flags.Value();
    else if (flags.Is("--gpus")) {
      const std::string flag = flags.flag();
      options.gpus = flags.OrDie(deepnex::agent::ParseGpus(flags.Value(), flag));
    } else if (flags.Is("--cpus")) {
      const int n = flags.Int();
      if (n < 1) flags.Die(absl::StrCat("--cpus: ", n, " must be at least 1"));
      options.cpus = n;
    } else if (flags.Is("--memory")) options.memory = flags.Bytes();
    else if (flags.Is("--labels")) {
      const std::string text = flags.Value();
      for (absl::string_view kv : absl::StrSplit(text, ',', absl::SkipEmpty())) {
        std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
        if (p.first.empty() || kv.find('=') == absl::string_view::npos) {
          flags.Die(absl::StrCat("--labels: \"", kv, "\" is not k=v"));
        }
        if (!options.labels.emplace(p.first, p.second).second) {
          flags.Die(absl::StrCat("--labels: key \"", p.first, "\" is given twice"));
        }
      }
    } else if (flags.Is("--image")) {
      absl::Status added =
          deepnex::launch::AddImageMapping("--image", flags.Value(), &options.launcher.images);
      if (!added.ok()) flags.Die(std::string(added.message()));
    } else if (flags.Is("--listen")) options.listen = flags.Value();
    else if (flags.Is("--metrics-token-file")) options.metrics_token_file = flags.Value();
    else if (flags.Is("--advertise")) options.advertise = flags.Value();
    else flags.Unknown();
  }
  if (options.central.empty()) flags.Die("--central is required");
  if (options.node.empty()) flags.Die("--node is required");
  if (options.launcher.state_dir.empty()) {
    options.launcher.state_dir = DefaultStateDir(flags, options.node);
  }

  deepnex::tools::SignalStop signals;
  auto agent = deepnex::agent::Agent::Create(options);
  if (!agent.ok()) {
    std::cerr << "deepnex-agent: " << agent.status().message() << "\n";
    return 1;
  }
  if (!(*agent)->http_address().empty()) {
    std::printf("deepnex-agent: serving /healthz and /metrics on %s\n",
                (*agent)->http_address().c_str());
    std::fflush(stdout);
  }
  // Serve's shape. A refusal ends the process here: Serve would wait for a
  // signal.
  struct Server {
    deepnex::agent::Agent& agent;
    void Stop() { agent.Stop(); }
    void Wait() {
      absl::Status s = agent.Wait();
      if (!s.ok()) {
        std::cerr << "deepnex-agent: " << s.message() << "\n";
        std::exit(1);
      }
    }
  } server{**agent};
  std::thread announce([&] {
    if ((*agent)->WaitRegistered(std::chrono::hours(24 * 365)).ok()) {
      std::printf("deepnex-agent: node %s registered with %s\n", options.node.c_str(),
                  options.central.c_str());
      std::fflush(stdout);
    }
  });
  signals.Serve(server);
  announce.join();
  return 0;
}
