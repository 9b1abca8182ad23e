// deepnex-central: the GPU allocator as a service for many users, as a daemon.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "deepnex/gpu/central.h"
#include "deepnex/gpu/discovery.h"

namespace {

constexpr char kUsage[] = R"(usage: deepnex-central [flags]

Serves a GPU allocator (exclusive and shared nodes, quotas, queue, gangs,
leases) over gRPC. Prints "deepnex-central listening on HOST:PORT" once it
serves; stops on SIGINT/SIGTERM.

flags:
  --listen HOST:PORT      address to listen on; port 0 picks a free one
                          (default 127.0.0.1:0)
  --state-dir D           keep the allocator's crash-safe ledger in D; without
                          it, state lives in memory only
  --no-fsync              do not fsync the ledger (survives a process crash,
                          not a machine crash)
  --nodes F               add the nodes declared in the JSON file F that the
                          allocator does not have yet
  --local                 add this machine (GPUs found through NVML) as a node
  --token T               the administrator's bearer token
  --token-file F          lines "TOKEN NAME ROLE" (ROLE user|admin)
  --tls-cert F --tls-key F   serve TLS with this PEM certificate and key
  --metrics-listen HOST:PORT  serve Prometheus text at GET /metrics (plain HTTP)
  --help                  show this text
)";

[[noreturn]] void Die(const std::string& message) {
  std::cerr << "deepnex-central: " << message << " (see --help)\n";
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  deepnex::gpu::CentralServerOptions options;
  std::string nodes_file;
  bool local = false;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      return 0;
    }
    std::string value;
    bool has_value = false;
    auto eq = flag.find('=');
    if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_value = true;
    }
    auto next = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) Die(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--listen") {
      options.address = next();
    } else if (flag == "--state-dir") {
      options.allocator.state_dir = next();
    } else if (flag == "--no-fsync") {
      options.allocator.fsync = false;
    } else if (flag == "--nodes") {
      nodes_file = next();
    } else if (flag == "--local") {
      local = true;
    } else if (flag == "--token") {
      options.token = next();
    } else if (flag == "--token-file") {
      options.token_file = next();
    } else if (flag == "--tls-cert") {
      options.tls_cert_file = next();
    } else if (flag == "--tls-key") {
      options.tls_key_file = next();
    } else if (flag == "--metrics-listen") {
      options.metrics_address = next();
    } else {
      Die("unknown flag \"" + flag + "\"");
    }
  }
  if (options.address.empty()) Die("--listen is empty");
  std::vector<deepnex::gpu::Node> nodes;
  if (!nodes_file.empty()) {
    auto parsed = deepnex::gpu::LoadNodesFile(nodes_file);
    if (!parsed.ok()) {
      std::cerr << "deepnex-central: " << parsed.status().message() << "\n";
      return 1;
    }
    nodes = std::move(*parsed);
  }
  if (local) {
    std::cerr << "deepnex-central: local GPUs: " << deepnex::gpu::DiscoverLocalGpus().summary
              << "\n";
    auto node = deepnex::gpu::LocalNode();
    if (!node.ok()) {
      std::cerr << "deepnex-central: " << node.status().message() << "\n";
      return 1;
    }
    nodes.push_back(std::move(*node));
  }

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = deepnex::gpu::CentralServer::Create(options);
  if (!server.ok()) {
    std::cerr << "deepnex-central: " << server.status().message() << "\n";
    return 1;
  }
  for (const auto& n : nodes) {
    if ((*server)->allocator().GetNode(n.name).ok()) continue;  // kept in the ledger
    absl::Status s = (*server)->allocator().AddNode(n);
    if (!s.ok()) {
      std::cerr << "deepnex-central: " << s.message() << "\n";
      return 1;
    }
  }
  if ((*server)->metrics_port() != 0) {
    std::cerr << "deepnex-central: metrics at http://"
              << options.metrics_address.substr(0, options.metrics_address.rfind(':')) << ":"
              << (*server)->metrics_port() << "/metrics\n";
  }
  std::printf("deepnex-central listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    (*server)->Stop();
  });
  (*server)->Wait();
  waiter.join();
  return 0;
}
