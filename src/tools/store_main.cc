// deepnex-store: a job's rendezvous store, as a daemon.
#include <cstdio>
#include <iostream>
#include <string>

#include "deepnex/collective/store.h"
#include "tools/daemon.h"

namespace {

constexpr char kUsage[] = R"(usage: deepnex-store [flags]

Runs a rendezvous store (a key-value service the ranks of a job meet
through). Prints "deepnex-store listening on HOST:PORT" once it serves; stops
on SIGINT/SIGTERM.

flags:
  --listen HOST:PORT      address to listen on; port 0 picks a free one
                          (default 127.0.0.1:0)
  --advertise HOST        the host peers dial, printed in "listening on"
                          (default: the --listen host; for 0.0.0.0 or [::],
                          this host's primary address)
  --token T               bearer token every call must carry (default
                          $DEEPNEX_TOKEN, as deepnex-ps, which unlike a flag
                          other users cannot read in /proc)
  --token-file F          file with the token, or lines "TOKEN NAME ROLE [JOB]";
                          a job-scoped token only reaches keys under "JOB/"
  --max-value SIZE        largest value accepted, e.g. 64MiB (default 64MiB)
  --max-bytes SIZE        most bytes of keys and values held at once, every
                          job's together; a write past it is refused
                          (default 1GiB)
  --tls-cert F --tls-key F   serve TLS with this PEM certificate and key
  --help                  show this text
)";

}  // namespace

int main(int argc, char** argv) {
  deepnex::collective::StoreServerOptions options;
  deepnex::tools::Flags flags("deepnex-store", kUsage, argc, argv);
  while (flags.Next()) {
    if (flags.Is("--listen")) options.address = flags.Value();
    else if (flags.Is("--advertise")) options.advertise = flags.Value();
    else if (flags.Is("--token")) options.token = flags.Value();
    else if (flags.Is("--token-file")) options.token_file = flags.Value();
    else if (flags.Is("--max-value")) options.max_value_bytes = flags.Bytes();
    else if (flags.Is("--max-bytes")) options.max_bytes = flags.Bytes();
    else if (flags.Is("--tls-cert")) options.tls_cert_file = flags.Value();
    else if (flags.Is("--tls-key")) options.tls_key_file = flags.Value();
    else flags.Unknown();
  }
  if (options.address.empty()) flags.Die("--listen is empty");
  // As deepnex-ps: a user who set DEEPNEX_TOKEN for both expects the store
  // to need it too (a probe's store accepted any token).
  deepnex::tools::TokenFromEnvironment(&options.token, options.token_file);

  deepnex::tools::SignalStop signals;
  auto server = deepnex::collective::StoreServer::Create(options);
  if (!server.ok()) {
    std::cerr << "deepnex-store: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("deepnex-store listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  signals.Serve(**server);
  return 0;
}
