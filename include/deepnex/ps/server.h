// The parameter server: holds the partitions of dense tensors that clients
// assign to it, aggregates pushes and applies the server-side optimizer.
#ifndef DEEPNEX_PS_SERVER_H_
#define DEEPNEX_PS_SERVER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "deepnex/ps/optimizer.h"
#include "deepnex/status.h"

namespace deepnex::ps {

enum class Mode {
  kSync,   // a round completes when every worker pushed for it
  kAsync,  // each push is applied at once
};
const char* ModeName(Mode mode);
absl::StatusOr<Mode> ParseMode(const std::string& name);

// How a sync round combines the workers' gradients before the optimizer.
enum class Reduction { kMean, kSum };
const char* ReductionName(Reduction reduction);
absl::StatusOr<Reduction> ParseReduction(const std::string& name);

struct ServerOptions {
  // Where to listen; port 0 lets the OS pick (see Server::address()).
  // Default: "127.0.0.1:0"
  std::string address = "127.0.0.1:0";
  // Default: kSync
  Mode mode = Mode::kSync;
  // Workers taking part; worker ids are 0..num_workers-1. Default: 1
  int num_workers = 1;
  // Sync mode: mean or sum of the round's gradients. Default: kMean
  Reduction reduction = Reduction::kMean;
  OptimizerConfig optimizer;
  // Refuse gradients holding NaN or Inf (InvalidArgument); when false they
  // are applied as given. Default: true
  bool reject_nonfinite = true;
  // Largest request the server accepts; larger ones are ResourceExhausted.
  // Default: 256 MiB
  uint64_t max_message_bytes = 256ull << 20;
  // Bearer token every call must carry, or a token file (see auth.h).
  // Both empty: no auth. Default: ""
  std::string token;
  std::string token_file;
  // The job this server belongs to; job-scoped tokens of other jobs are
  // refused. Default: "" (any)
  std::string job_id;
  // TLS: PEM certificate chain and private key. Both empty: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;

  // InvalidArgument naming the field for a bad value.
  absl::Status Validate() const;
};

// A running parameter server. Thread-safe: Stop() may be called from any
// thread; the server serves from gRPC's threads until then.
class Server {
 public:
  // Starts serving; on success the server is listening.
  static absl::StatusOr<std::unique_ptr<Server>> Create(
      const ServerOptions& options);
  virtual ~Server() = default;

  // "host:port" with the port actually bound.
  virtual std::string address() const = 0;
  virtual int port() const = 0;
  // Stops accepting calls; calls in flight end with Unavailable. Idempotent.
  virtual void Stop() = 0;
  // Blocks until Stop() (from another thread or a signal handler's thread).
  virtual void Wait() = 0;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_SERVER_H_
