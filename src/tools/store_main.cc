// deepnex-store: a job's rendezvous store, as a daemon.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "deepnex/collective/store.h"
#include "deepnex/units.h"

namespace {

constexpr char kUsage[] = R"(usage: deepnex-store [flags]

Runs a rendezvous store (a key-value service the ranks of a job meet
through). Prints "deepnex-store listening on HOST:PORT" once it serves; stops
on SIGINT/SIGTERM.

flags:
  --listen HOST:PORT      address to listen on; port 0 picks a free one
                          (default 127.0.0.1:0)
  --token T               bearer token every call must carry
  --token-file F          file with the token, or lines "TOKEN NAME ROLE [JOB]";
                          a job-scoped token only reaches keys under "JOB/"
  --max-value SIZE        largest value accepted, e.g. 64MiB (default 64MiB)
  --tls-cert F --tls-key F   serve TLS with this PEM certificate and key
  --help                  show this text
)";

[[noreturn]] void Die(const std::string& message) {
  std::cerr << "deepnex-store: " << message << " (see --help)\n";
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  deepnex::collective::StoreServerOptions options;
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
    } else if (flag == "--token") {
      options.token = next();
    } else if (flag == "--token-file") {
      options.token_file = next();
    } else if (flag == "--max-value") {
      auto v = deepnex::ParseByteSize(next(), "--max-value");
      if (!v.ok()) Die(std::string(v.status().message()));
      options.max_value_bytes = *v;
    } else if (flag == "--tls-cert") {
      options.tls_cert_file = next();
    } else if (flag == "--tls-key") {
      options.tls_key_file = next();
    } else {
      Die("unknown flag \"" + flag + "\"");
    }
  }
  if (options.address.empty()) Die("--listen is empty");

  // Signals are taken by a thread of ours, so the gRPC threads never see them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = deepnex::collective::StoreServer::Create(options);
  if (!server.ok()) {
    std::cerr << "deepnex-store: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("deepnex-store listening on %s\n", (*server)->address().c_str());
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
